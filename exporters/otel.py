"""OpenTelemetry exporter, on opentelemetry-api only.

A library records through the API and leaves the SDK (readers, exporters, collectors) to the
application; without an SDK these instruments are no-ops. The instruments follow
:mod:`shadow.core.model.contract`, so the SDK's Prometheus translation yields the same names as
:class:`exporters.PrometheusExporter`.

The SDK spends about ten microseconds on each synchronous measurement, which is too much for a
training thread. So the training thread only adds to plain totals and queues histogram values; the
sums are observable counters whose callbacks report the totals at collection time, and the first
callback of a collection records the queued histogram values, on the collecting thread.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Iterable

from opentelemetry import metrics

from shadow.core.model import contract
from shadow.core.support import forks

METER_NAME = "npu_shadow"

#: Histogram values waiting for a collection. An observation whose values would not fit (nobody collects, or
#: collections are slower than the job) keeps its sums but loses its histogram values, and is counted in
#: ``npu_shadow.export_errors`` and :attr:`OTelExporter.dropped`.
MAX_PENDING = 100_000

#: What one collection may spend recording queued histogram values: at most this many values, for at most this
#: many seconds (the SDK gives a whole collection 10 s and drops it past that). The rest wait for the next one.
MAX_RECORDED_PER_COLLECTION = 10_000
RECORD_SECONDS = 1.0


def _target(metric: contract.Metric, value: float, labels: tuple[str, ...]) -> str:
    """The target of a histogram value (every histogram is by target)."""
    return labels[metric.labels.index("target")]


class OTelExporter:
    """Records the contract's samples through an OpenTelemetry meter named ``npu_shadow``.

    ``meter_provider``: the provider to use (tests pass their own); the global one by default.
    Versions (this package, torch, torch_npu) are the meter's version and attributes; every value carries the
    ``run`` attribute.
    """

    def __init__(self, meter_provider: metrics.MeterProvider | None = None, run: str | None = None) -> None:
        #: The run every value is attributed to (``run``): ``shadow.core.support.environment.run_id()`` unless given.
        self.run = run if run is not None else contract.run_id()
        self._run = {contract.RUN_LABEL: self.run}
        versions = contract.versions()
        self.meter = metrics.get_meter(
            METER_NAME, versions["version"], meter_provider=meter_provider, attributes=versions
        )
        self._lock = threading.Lock()
        kinds = {kind: tuple(m for m in contract.ALL if m.kind == kind) for kind in ("counter", "histogram", "gauge")}
        self._sums = kinds["counter"]  # (the contract's instruments, each sum an observable counter)
        self._totals: dict[contract.Metric, dict[tuple[str, ...], float]] = {m: {} for m in self._sums}
        self._gauges: dict[contract.Metric, dict[tuple[str, ...], float]] = {m: {} for m in kinds["gauge"]}
        self._pending: collections.deque[tuple[contract.Metric, float, tuple[str, ...]]] = collections.deque()
        self.dropped = 0  # histogram values lost: the queue was full, or the SDK failed to record them
        self._histograms = {
            metric: self.meter.create_histogram(
                metric.otel_name,
                unit=metric.unit,
                description=metric.description,
                explicit_bucket_boundaries_advisory=list(
                    contract.DURATION_BUCKETS if metric is contract.SHADOW_DURATION else contract.ERROR_BUCKETS
                ),
            )
            for metric in kinds["histogram"]
        }
        for metric in self._sums:
            self.meter.create_observable_counter(
                metric.otel_name,
                [lambda options, metric=metric: self._observe(metric, self._totals)],
                unit=metric.unit,
                description=metric.description,
            )
        for metric in kinds["gauge"]:
            self.meter.create_observable_gauge(
                metric.otel_name,
                [lambda options, metric=metric: self._observe(metric, self._gauges)],
                unit=metric.unit,
                description=metric.description,
            )
        self._apply(contract.drill_samples(False) + contract.start_samples(self.run) + contract.process_samples())
        forks.register(self)

    # ------------------------------------------------------------------ collection time

    def _observe(
        self, metric: contract.Metric, values: dict[contract.Metric, dict[tuple[str, ...], float]]
    ) -> Iterable[metrics.Observation]:
        if metric is self._sums[0]:  # (once per collection: one callback records the queued values)
            self._record_pending()
        with self._lock:
            found = list(values[metric].items())
        return [
            metrics.Observation(value, {**self._run, **dict(zip(metric.labels, labels))}) for labels, value in found
        ]

    def _record_pending(self) -> None:
        """Record queued histogram values, a bounded share per collection (MAX_RECORDED_PER_COLLECTION values,
        RECORD_SECONDS): a collection never takes on the whole queue, however long it grew."""
        deadline = time.monotonic() + RECORD_SECONDS
        for done in range(MAX_RECORDED_PER_COLLECTION):
            if done % 256 == 255 and time.monotonic() > deadline:
                return
            try:
                metric, value, labels = self._pending.popleft()
            except IndexError:
                return
            try:
                self._histograms[metric].record(value, {**self._run, **dict(zip(metric.labels, labels))})
            except Exception:  # the SDK's fault: the value is lost, and counted as such
                with self._lock:
                    self.dropped += 1
                    self._apply_totals(contract.export_error_samples(_target(metric, value, labels)))

    # ------------------------------------------------------------------ exporter protocol

    def _apply_totals(self, samples: Iterable[contract.Sample]) -> list[tuple[contract.Metric, float, tuple]]:
        """Each counter's and gauge's sample on its value (under the lock); the histograms' samples returned, to be
        queued."""
        values = []
        for metric, labels, value in samples:
            if metric.kind == "counter":
                totals = self._totals[metric]
                totals[labels] = totals.get(labels, 0) + value
            elif metric.kind == "gauge":
                gauge = self._gauges[metric]
                gauge[labels] = max(gauge.get(labels, value), value) if metric.greatest else value
            else:
                values.append((metric, value, labels))
        return values

    def _apply(self, samples: Iterable[contract.Sample]) -> None:
        """The samples on the totals and gauges (under the lock), and histogram values queued for the next
        collection (an observation whose values would not fit loses them, counted as an export error)."""
        with self._lock:
            values = self._apply_totals(samples)
            if values and len(self._pending) + len(values) > MAX_PENDING:
                self.dropped += 1
                self._apply_totals(
                    contract.export_error_samples(dict(zip(values[0][0].labels, values[0][2]))["target"])
                )
                return
        self._pending.extend(values)

    def record(self, samples: Iterable[contract.Sample]) -> None:
        """The contract's samples: on the totals and gauges, histogram values queued (:meth:`_apply`)."""
        self._apply(samples)

    def _after_fork_in_child(self) -> None:
        # The parent's totals are the parent's: a forked child reports its own, from zero (its series stay).
        self._lock = threading.Lock()
        for totals in self._totals.values():
            for labels in totals:
                totals[labels] = 0
        for metric, gauge in self._gauges.items():
            if metric.greatest:
                gauge.clear()
        self._pending.clear()
        self.dropped = 0
        self._apply_totals(contract.process_samples())
