"""The job's final counts, served after it ends until a scrape has read them (``npu-shadow run --linger``).

A job's endpoint goes away with its process, and Prometheus scrapes once a minute by default: the counts of the
job's last minute, its exit flush included, would never be scraped. The job's processes write their values to
files (prometheus-client's multiprocess mode, one folder per local rank or one per node); after the job, the
launcher serves those files on the job's own ports until each endpoint has been scraped once since the job ended,
or the grace period ends, or the launcher is signalled.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry


class ScrapeWatch:
    """A collector that adds no metric and notes that a scrape read its registry."""

    def __init__(self) -> None:
        self.scraped = threading.Event()

    def collect(self) -> Iterable[Any]:
        self.scraped.set()
        return iter(())


def rank_directories(base: str) -> dict[int, str]:
    """The per-rank value folders of a job (``rank0``, ``rank1``...) under ``base``, by local rank."""
    found = {}
    for name in sorted(os.listdir(base)):
        path = os.path.join(base, name)
        if name.startswith("rank") and name[4:].isdigit() and os.path.isdir(path) and not os.path.islink(path):
            found[int(name[4:])] = path
    return found


def serve_rank(directory: str, port: int, addr: str) -> tuple[Any, CollectorRegistry]:
    """Serve one rank's values on ``addr:port`` as its process did (the server is None where the port is taken).
    A connection that sends no request within REQUEST_SECONDS is closed (:func:`exporters.prometheus.serve_registry`):
    half-open clients never hold the descriptors a real scrape needs."""
    from exporters.prometheus import SignatureCappedCollector, serve_registry

    registry = CollectorRegistry()
    SignatureCappedCollector(registry, path=directory)
    return serve_registry(registry, port, addr), registry


@dataclasses.dataclass(frozen=True)
class LingerEnd:
    """How a linger ended: ``scraped`` (every endpoint read once), ``timeout`` (the grace period passed) or
    ``signal`` (the launcher was signalled); after ``seconds``."""

    how: str
    seconds: float


def wait_for_scrapes(
    registries: Iterable[CollectorRegistry],
    seconds: float,
    interrupted: Callable[[float], bool],
) -> LingerEnd:
    """Wait until each registry has been scraped once from now, for at most ``seconds``; ``interrupted(timeout)``
    waits up to ``timeout`` for a signal that ends the wait early."""
    watches = []
    for registry in registries:
        watch = ScrapeWatch()
        registry.register(watch)
        watches.append(watch)
    start = time.monotonic()
    while not all(watch.scraped.is_set() for watch in watches):
        left = seconds - (time.monotonic() - start)
        if left <= 0:
            return LingerEnd("timeout", time.monotonic() - start)
        if interrupted(min(left, 0.2)):
            return LingerEnd("signal", time.monotonic() - start)
    return LingerEnd("scraped", time.monotonic() - start)


def signalled(signals: Iterable[signal.Signals]) -> Callable[[float], bool]:
    """``interrupted`` for :func:`wait_for_scrapes`: True once one of ``signals`` (blocked by the caller) came."""
    wanted = set(signals)

    def interrupted(timeout: float) -> bool:
        return signal.sigtimedwait(wanted, timeout) is not None

    return interrupted
