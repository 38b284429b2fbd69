"""Prometheus exporter, on prometheus-client.

Single process: metrics live in ``registry`` (a private one by default) and are served from it.

Multiprocess (``PROMETHEUS_MULTIPROC_DIR`` set *before* prometheus_client is first imported, one fresh
directory per job): every process of the job (ranks, forked or spawned DataLoader workers) writes its
values to files there through the client's own multiprocess mode, and the serving process aggregates
them with ``MultiProcessCollector``. Counters and histograms of exited processes stay in the files, so
nothing is lost when a worker exits. The client's limits apply: no Info or Enum metrics (hence the
``npu_shadow_build_info`` gauge), no custom collectors, and gauges aggregate by their mode (``max`` here).
Use one PrometheusExporter per process in this mode.
"""

from __future__ import annotations

import contextlib
import glob
import io
import json
import logging
import math
import os
import socket
import time
import warnings
from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, values
from prometheus_client.exposition import generate_latest, push_to_gateway, start_http_server
from prometheus_client.metrics_core import Metric
from prometheus_client.mmap_dict import MmapedDict
from prometheus_client.multiprocess import MultiProcessCollector

from exporters.signatures import JobSignatures
from shadow.core.model import contract
from shadow.core.model.observation import MAX_SIGNATURES, OTHER_SIGNATURE
from shadow.core.support import forks
from shadow.core.support.safe_paths import check_private_directory, replace_regular_file

log = logging.getLogger("shadow")


def multiprocess_mode() -> bool:
    """True when prometheus_client writes values to PROMETHEUS_MULTIPROC_DIR in this process."""
    return values.ValueClass is not values.MutexValue


def serve_registry(
    registry: CollectorRegistry, port: int, addr: str = "127.0.0.1", mark_dir: str | None = None, **tls: Any
) -> Any:
    """Serve ``registry`` on ``addr:port``; the server, or None with a warning when the port cannot be
    bound (a busy port degrades the endpoint, never the job). ``mark_dir``: where its first scrape leaves
    :data:`SCRAPED_MARK` (:class:`ScrapeMarking`)."""
    served: Any = registry if mark_dir is None else ScrapeMarking(registry, mark_dir)
    try:
        server, thread = start_http_server(port, addr=addr, registry=served, **tls)
        thread.name = "npu-shadow metrics endpoint"  # (the tool's: shadow.core.runs.sides.OWN_THREADS)
    except (OSError, OverflowError) as exc:  # (OverflowError: a port past 65535)
        message = f"npu-shadow: cannot serve metrics on {addr}:{port} ({exc}); the job goes on without it"
        warnings.warn(message, RuntimeWarning, stacklevel=3)
        log.warning(message)
        return None
    # (a connection that never sends its request would hold a thread and a descriptor for good: enough of them keep
    # a real scrape out; each connection has REQUEST_SECONDS in all to send its request, ANSWER_SECONDS to read the
    # answer, and the kernel queues the connections the server cannot take yet rather than dropping them)
    server.RequestHandlerClass = _timed(server.RequestHandlerClass)
    with contextlib.suppress(OSError):
        server.socket.listen(LISTEN_BACKLOG)
    return server


class _ReadBy(io.RawIOBase):
    """A connection's reads, all of them over by ``deadline`` (``time.monotonic()``): a client that sends its
    request a byte at a time is cut off at the deadline, not at one timeout per byte."""

    def __init__(self, connection: socket.socket, deadline: float) -> None:
        self.connection, self.deadline = connection, deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("the request took longer than its deadline")
        self.connection.settimeout(remaining)
        return self.connection.recv_into(buffer)


def _timed(handler: type) -> type:
    """``handler`` whose connection has REQUEST_SECONDS in all to send its request and ANSWER_SECONDS to read the
    answer, a timed-out or dropped one closed quietly (socketserver would print each one's traceback on the job's
    stderr)."""

    def setup(self: Any) -> None:
        handler.setup(self)
        self.rfile = io.BufferedReader(_ReadBy(self.connection, time.monotonic() + REQUEST_SECONDS))

    def parse_request(self: Any) -> bool:
        parsed = handler.parse_request(self)
        self.connection.settimeout(ANSWER_SECONDS)  # (the request is read: the answer's writes get their own time)
        return parsed

    def handle(self: Any) -> None:
        try:
            handler.handle(self)
        except (TimeoutError, ConnectionError):
            self.close_connection = True

    members = {"timeout": ANSWER_SECONDS, "setup": setup, "parse_request": parse_request, "handle": handle}
    return type(handler.__name__, (handler,), members)


#: How long a connection may take to send its whole request (a scraper sends it at once, on connecting).
REQUEST_SECONDS = 1.0
#: How long a scrape may take to read the answer.
ANSWER_SECONDS = 5.0
#: The connections the kernel holds for the server while its threads or descriptors are busy.
LISTEN_BACKLOG = 256


#: The file a served endpoint leaves in its multiprocess folder at its first scrape: something scrapes the job, so
#: the launcher keeps the endpoint after the job until that something has read the final counts.
SCRAPED_MARK = "scraped"


class ScrapeMarking:
    """What an endpoint serves: ``registry``, and :data:`SCRAPED_MARK` left in ``directory`` at its first scrape
    (an HTTP request; the process's own reads of ``registry``, its exit summary's, leave none)."""

    def __init__(self, registry: CollectorRegistry, directory: str) -> None:
        self.registry = registry
        self.path = os.path.join(directory, SCRAPED_MARK)
        self.marked = False

    def _mark(self) -> None:
        if not self.marked:
            self.marked = True
            # (a private folder, never through a link planted there; without the mark the endpoint is not kept
            # after the job: a feature lost, never the job)
            with contextlib.suppress(OSError):
                os.close(os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600))

    def collect(self) -> Iterable[Any]:
        self._mark()
        return self.registry.collect()

    def restricted_registry(self, names: Iterable[str]) -> Any:
        self._mark()
        return self.registry.restricted_registry(names)


def scraped(directory: str) -> bool:
    """Whether an endpoint serving ``directory`` was scraped (:class:`ScrapeMarking`)."""
    return os.path.isfile(os.path.join(directory, SCRAPED_MARK))


_KINDS = ("counter", "gauge", "histogram", "summary")


def _check_value_file(path: str) -> None:
    """Raise unless ``path`` reads as prometheus_client's multiprocess collector reads a value file: a name
    ``<kind>_..._<pid>.db`` and entries whose keys are JSON ``[metric, sample, labels, help]``."""
    kind, *rest = os.path.basename(path).split("_")
    if kind not in _KINDS or (kind == "gauge" and len(rest) < 2):
        raise ValueError(f"not a value file's name: {os.path.basename(path)!r}")
    for key, value, *_ in MmapedDict.read_all_values_from_file(path):
        metric, sample, labels, _help = json.loads(key)
        if not (isinstance(metric, str) and isinstance(sample, str) and isinstance(labels, dict)):
            raise ValueError("an entry's key is not [metric, sample, labels, help]")
        float(value)


class SignatureCappedCollector:
    """The job's processes' values (``MultiProcessCollector``), with at most MAX_SIGNATURES signature values per
    target on the endpoint: each process caps its own signatures, so twelve processes could show 1,200. The first
    MAX_SIGNATURES a target shows here keep their series for the endpoint's life; the rest are summed into
    ``other`` (the greatest, for a gauge), as a process sums its own beyond the cap."""

    def __init__(self, registry: CollectorRegistry | None = None, path: str | None = None) -> None:
        self._processes = MultiProcessCollector(None, path=path)  # (raises where no folder is given nor set)
        self._path = path or os.environ["PROMETHEUS_MULTIPROC_DIR"]
        self._admitted: dict[str, set[str]] = {}
        #: Value files that could not be read (torn by a process killed while it grew one, a full disk, a stranger's
        #: file): left out of the exposition, said once each, never a traceback on the job's stderr nor a failed
        #: scrape.
        self.unreadable: set[str] = set()
        if registry is not None:
            registry.register(self)

    def _readable_files(self) -> list[str]:
        files = []
        for path in sorted(glob.glob(os.path.join(self._path, "*.db"))):
            try:
                _check_value_file(path)
            except Exception as exc:
                if path not in self.unreadable:
                    self.unreadable.add(path)
                    log.warning("npu-shadow: metrics file %s cannot be read, left out (%s)", path, type(exc).__name__)
                continue
            files.append(path)
        return files

    def _signature(self, target: str, signature: str) -> str:
        admitted = self._admitted.setdefault(target, set())
        if signature in admitted or signature == OTHER_SIGNATURE:
            return signature
        if len(admitted) < MAX_SIGNATURES:
            admitted.add(signature)
            return signature
        return OTHER_SIGNATURE

    def collect(self) -> Any:
        for family in self._processes.merge(self._readable_files(), accumulate=True):
            if not any("signature" in sample.labels for sample in family.samples):
                yield family
                continue
            merged: dict[tuple, list] = {}
            for sample in family.samples:
                labels = dict(sample.labels)
                if "signature" in labels:
                    labels["signature"] = self._signature(labels.get("target", ""), labels["signature"])
                key = (sample.name, tuple(sorted(labels.items())))
                if key not in merged:
                    merged[key] = [sample.name, labels, sample.value]
                elif family.type == "gauge":
                    merged[key][2] = max(merged[key][2], sample.value)
                else:
                    merged[key][2] += sample.value
            folded = Metric(family.name, family.documentation, family.type, family.unit)
            for name, labels, value in merged.values():
                folded.add_sample(name, labels, value)
            yield folded


class PrometheusExporter:
    """Records the contract's samples as the ``npu_shadow_*`` metrics; serves /metrics when ``port`` is given.

    Every series carries the ``run`` label (``run``, default ``shadow.core.support.environment.run_id()``).
    ``addr`` defaults to loopback (prometheus-client's own default is every interface). ``certfile``,
    ``keyfile``, ``client_cafile``, ``client_capath`` and ``client_auth_required`` turn on TLS and client
    certificates, passed through to prometheus-client. A port that cannot be bound gives a warning and
    no endpoint: the training job goes on.
    """

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        port: int | None = None,
        addr: str = "127.0.0.1",
        certfile: str | None = None,
        keyfile: str | None = None,
        client_cafile: str | None = None,
        client_capath: str | None = None,
        client_auth_required: bool = False,
        run: str | None = None,
    ) -> None:
        if port is not None and (isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535):
            raise ValueError(f"PrometheusExporter: port must be an int in 0..65535 or None, got {port!r}")
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR") and not multiprocess_mode():
            warnings.warn(
                "npu-shadow: PROMETHEUS_MULTIPROC_DIR was set after prometheus_client was imported; "
                "this process exports its own metrics only",
                stacklevel=2,
            )
        self.multiprocess = multiprocess_mode()
        if self.multiprocess:
            # Another user's folder could hold planted symlinks or their values: refuse it (ValueError).
            check_private_directory(os.environ["PROMETHEUS_MULTIPROC_DIR"], "PROMETHEUS_MULTIPROC_DIR")
            # Values go to the job's files; the served registry aggregates them.
            metric_registry = None
            self.registry = registry if registry is not None else CollectorRegistry()
            SignatureCappedCollector(self.registry)
        else:
            self.registry = metric_registry = registry if registry is not None else CollectorRegistry()
        forks.register(self)
        #: The run every series is labelled with (``run``): ``shadow.core.support.environment.run_id()`` unless given.
        self.run = run if run is not None else contract.run_id()
        self._metrics = self._create(metric_registry)
        self._children: dict[tuple, Any] = {}
        self._greatest: dict[tuple, float] = {}  # (metric, labels) -> the greatest value of a gauge that keeps it
        #: The signature values the job's processes share under the launcher (None: this process's own cap alone).
        self._job_signatures = JobSignatures.from_environment()
        self._metrics[contract.BUILD_INFO].labels(self.run, *contract.build_info()).set(1)
        self._apply(contract.drill_samples(False) + contract.start_samples(self.run) + contract.process_samples())
        self.server: Any = None
        self.port: int | None = None
        if port is not None:
            self.serve(
                port,
                addr,
                certfile=certfile,
                keyfile=keyfile,
                client_cafile=client_cafile,
                client_capath=client_capath,
                client_auth_required=client_auth_required,
            )

    @staticmethod
    def _create(registry: CollectorRegistry | None) -> dict[contract.Metric, Any]:
        metrics: dict[contract.Metric, Any] = {}
        for metric in (*contract.ALL, contract.BUILD_INFO):
            common = {"registry": registry, "labelnames": (contract.RUN_LABEL, *metric.labels)}
            name = metric.prometheus_name
            if metric.kind == "counter":
                metrics[metric] = Counter(name, metric.description, **common)
            elif metric.kind == "gauge":
                metrics[metric] = Gauge(name, metric.description, multiprocess_mode="max", **common)
            else:
                buckets = contract.DURATION_BUCKETS if metric is contract.SHADOW_DURATION else contract.ERROR_BUCKETS
                metrics[metric] = Histogram(name, metric.description, buckets=buckets, **common)
        return metrics

    # ------------------------------------------------------------------ exporter protocol

    def _child(self, metric: contract.Metric, *labels: str) -> Any:
        """The labelled child of a metric, cached: labels come from bounded sets, and ``labels()`` is slow."""
        key = (metric, labels)
        child = self._children.get(key)
        if child is None:
            shown = labels
            if self._job_signatures is not None and "signature" in metric.labels:  # (shared with the job's processes)
                where, target = metric.labels.index("signature"), labels[metric.labels.index("target")]
                shown = (*labels[:where], self._job_signatures.admit(target, labels[where]), *labels[where + 1 :])
            child = self._children[key] = self._metrics[metric].labels(self.run, *shown)
        return child

    def _apply(self, samples: Iterable[contract.Sample]) -> None:
        """Each sample on its child: a counter's increment, a histogram's observation, a gauge's value (the
        greatest so far, for a gauge that keeps it)."""
        # No lock of our own: each prometheus-client value has its own, and the child cache is a dict whose get/set
        # are atomic (a race at worst asks labels() twice for the same child).
        for metric, labels, value in samples:
            child = self._child(metric, *labels)
            if metric.kind == "counter":
                child.inc(value)
            elif metric.kind == "histogram":
                child.observe(value)
            elif not metric.greatest:
                child.set(value)
            elif value >= self._greatest.get((metric, labels), -math.inf):
                self._greatest[(metric, labels)] = value
                child.set(value)

    def record(self, samples: Iterable[contract.Sample]) -> None:
        """The contract's samples, each on its series (:meth:`_apply`)."""
        self._apply(samples)

    # ------------------------------------------------------------------ getting metrics out

    def serve(self, port: int, addr: str = "127.0.0.1", **tls: Any) -> int | None:
        """Serve /metrics on ``addr:port`` (0 picks a free port). Returns the bound port, or None.

        ``tls``: prometheus-client's ``certfile``, ``keyfile``, ``client_cafile``, ``client_capath`` and
        ``client_auth_required``, passed through.
        """
        mark_dir = os.environ["PROMETHEUS_MULTIPROC_DIR"] if self.multiprocess else None
        self.server = serve_registry(self.registry, port, addr, mark_dir=mark_dir, **tls)
        self.port = self.server.server_port if self.server is not None else None
        return self.port

    def write_textfile(self, path: str) -> None:
        """Write the exposition atomically to ``path`` (for node_exporter's textfile collector): into a new
        file beside it, renamed over ``path`` only where ``path`` is a regular file or absent (a device, a FIFO
        or a directory there is never replaced). Raises OSError saying why it could not."""
        replace_regular_file(path, generate_latest(self.registry))

    def push_to_gateway(self, gateway: str, job: str, **kwargs: Any) -> None:
        """Push the exposition to a Pushgateway (batch jobs end before the next scrape)."""
        push_to_gateway(gateway, job=job, registry=self.registry, **kwargs)

    def close(self) -> None:
        """Stop serving (metrics already written stay)."""
        if self.server is not None:
            with contextlib.suppress(Exception):
                self.server.shutdown()
                self.server.server_close()
            self.server = None

    def _after_fork_in_child(self) -> None:
        self.server = None  # the serving thread did not survive the fork
        self._apply(contract.process_samples())  # (a process of its own: its own values, its own first block)
