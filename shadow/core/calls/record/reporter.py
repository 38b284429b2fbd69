"""Counts as they happen: what every installed monitor counted reaches its exporters within a second.

The records a sampled call makes wait for the exporters (:class:`~shadow.core.calls.record.record.Publisher`: no
exporter runs on the caller's thread), and the calls between sampled calls are only counted (the unsampled path
costs one Python call and does no more): each round reports the calls and hands everything waiting over. Without
it a scrape shows fewer calls than sampled ones, and a job that makes calls but compares none looks like no job.
One daemon thread per process reports every monitor that has exporters once per :data:`INTERVAL_SECONDS`; it is
started with the first such monitor, again in a forked child (a DataLoader worker), and sleeps while no monitor has
exporters. Exporter failures are counted where every hook's are (the publisher's delivery).
"""

from __future__ import annotations

import atexit
import logging
import threading
import weakref
from typing import Any, Protocol

from shadow.core.support import forks

log = logging.getLogger("shadow")

#: How often the calls counted since the last report reach the exporters.
INTERVAL_SECONDS = 1.0


class Reported(Protocol):
    def report(self) -> None:
        """Report the calls counted since the last report to the exporters, and hand over what waits for them."""

    def flush(self) -> None:
        """Report everything, and have the exporters write out what they buffer (at exit)."""


class Reporter:
    """The process's reporting thread and the monitors it reports (held weakly: a monitor that is gone needs no
    report)."""

    def __init__(self, interval: float = INTERVAL_SECONDS) -> None:
        self.interval = interval
        self._monitors: weakref.WeakSet[Any] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closed = threading.Event()
        forks.register(self)

    def add(self, monitor: Reported) -> None:
        """Report ``monitor`` from now on (until :meth:`discard`)."""
        with self._lock:
            self._monitors.add(monitor)
            self._start()

    def discard(self, monitor: Reported) -> None:
        with self._lock:
            self._monitors.discard(monitor)

    def report_all(self) -> None:
        """One round: every monitor reported (what the thread does each interval)."""
        for monitor in list(self._monitors):
            try:
                monitor.report()
            except Exception as exc:  # (the thread must outlive any one monitor's failure)
                log.warning("npu-shadow: reporting the calls of %r failed: %r", monitor, exc)

    def close(self, wait: float = 2.0) -> None:
        """Stop the thread and wait (at most ``wait`` seconds) for it to end: at interpreter exit, while the
        interpreter is whole (a daemon thread still running when it finalizes can abort the process: see
        :meth:`shadow.core.runs.deadline._Workers.close`); then the monitors still installed are flushed (the
        launcher's exit flushes its own before)."""
        self._closed.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(wait)
        for monitor in list(self._monitors):  # (a job that never uninstalled: its last records, flushed)
            try:
                monitor.flush()
            except Exception as exc:
                log.warning("npu-shadow: flushing %r at exit failed: %r", monitor, exc)

    def _start(self) -> None:
        if self._closed.is_set():
            return
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._loop, name="npu-shadow reporter", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        closed = self._closed
        while not closed.wait(self.interval):
            self.report_all()

    def _after_fork_in_child(self) -> None:
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._thread = None  # (threads do not survive a fork)
        if len(self._monitors):
            self._start()


#: The process's reporter.
REPORTER = Reporter()
atexit.register(REPORTER.close)
