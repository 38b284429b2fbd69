"""OpenTelemetry exporter, on opentelemetry-api only.

A library records through the API and leaves the SDK (readers, exporters, collectors) to the
application; without an SDK these instruments are no-ops. The instruments follow
:mod:`exporters.contract`, so the SDK's Prometheus translation yields the same names as
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

from exporters import contract
from shadow.core.calls.canary.arms import ArmRun
from shadow.core.model.observation import Observation, Outcome
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

_SUMS = (
    contract.CALLS,
    contract.ARM_ITERATORS,
    contract.ARM_FIRST_BATCH,
    contract.ARM_FIRST_BATCHES,
    contract.COMPARISONS,
    contract.CLUSTERS,
    contract.PROCESS_TIME,
    contract.MISMATCHES,
    contract.SKIPPED,
    contract.EXPORT_ERRORS,
    contract.SHARED_DIVERGENCES,
    contract.LEGACY,
    contract.SHADOW,
    contract.AA_RUNS,
    contract.BACKWARD_RUNS,
    contract.BACKWARD_SKIPS,
    contract.TRUTH_RUNS,
    contract.ROLLBACKS,
    contract.RESETS,
)
_HISTOGRAMS = (contract.ABS_ERROR, contract.REL_ERROR, contract.SHADOW_DURATION)


class OTelExporter:
    """Exports observations through an OpenTelemetry meter named ``npu_shadow``.

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
        self._totals: dict[contract.Metric, dict[tuple[str, ...], float]] = {m: {} for m in _SUMS}
        self._rates: dict[str, float] = {}
        self._pending: collections.deque[tuple[contract.Metric, float, str]] = collections.deque()
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
            for metric in _HISTOGRAMS
        }
        for metric in _SUMS:
            self.meter.create_observable_counter(
                metric.otel_name,
                [lambda options, metric=metric: self._observe_totals(metric)],
                unit=metric.unit,
                description=metric.description,
            )
        self.meter.create_observable_gauge(
            contract.SAMPLE_RATE.otel_name,
            [self._observe_rates],
            unit=contract.SAMPLE_RATE.unit,
            description=contract.SAMPLE_RATE.description,
        )
        self._primary: dict[tuple[str, str], int] = {}  # (target, side) -> 1 for the side the caller gets
        self.meter.create_observable_gauge(
            contract.PRIMARY.otel_name,
            [self._observe_primary],
            unit=contract.PRIMARY.unit,
            description=contract.PRIMARY.description,
        )
        self._floors: dict[tuple[str, str, str], float] = {}  # (target, signature, measure) -> the greatest
        self.meter.create_observable_gauge(
            contract.NOISE_FLOOR.otel_name,
            [self._observe_floors],
            unit=contract.NOISE_FLOOR.unit,
            description=contract.NOISE_FLOOR.description,
        )
        self._drill = 0
        self.meter.create_observable_gauge(
            contract.DRILL_ACTIVE.otel_name,
            [lambda options: [metrics.Observation(self._drill, {contract.RUN_LABEL: self.run})]],
            unit=contract.DRILL_ACTIVE.unit,
            description=contract.DRILL_ACTIVE.description,
        )
        forks.register(self)

    # ------------------------------------------------------------------ collection time

    def _observe_totals(self, metric: contract.Metric) -> Iterable[metrics.Observation]:
        if metric is _SUMS[0]:  # (once per collection: one callback records the queued values)
            self._record_pending()
        with self._lock:
            totals = list(self._totals[metric].items())
        return [
            metrics.Observation(value, {**self._run, **dict(zip(metric.labels, labels))}) for labels, value in totals
        ]

    def _observe_rates(self, options: metrics.CallbackOptions) -> Iterable[metrics.Observation]:
        with self._lock:
            rates = list(self._rates.items())
        return [metrics.Observation(rate, {**self._run, "target": target}) for target, rate in rates]

    def _observe_primary(self, options: metrics.CallbackOptions) -> Iterable[metrics.Observation]:
        with self._lock:
            primary = list(self._primary.items())
        return [metrics.Observation(value, {**self._run, "target": t, "side": side}) for (t, side), value in primary]

    def _observe_floors(self, options: metrics.CallbackOptions) -> Iterable[metrics.Observation]:
        with self._lock:
            floors = list(self._floors.items())
        labels = contract.NOISE_FLOOR.labels
        return [metrics.Observation(value, {**self._run, **dict(zip(labels, key))}) for key, value in floors]

    def _record_pending(self) -> None:
        """Record queued histogram values, a bounded share per collection (MAX_RECORDED_PER_COLLECTION values,
        RECORD_SECONDS): a collection never takes on the whole queue, however long it grew."""
        deadline = time.monotonic() + RECORD_SECONDS
        for done in range(MAX_RECORDED_PER_COLLECTION):
            if done % 256 == 255 and time.monotonic() > deadline:
                return
            try:
                metric, value, target = self._pending.popleft()
            except IndexError:
                return
            try:
                self._histograms[metric].record(value, {**self._run, "target": target})
            except Exception:  # the SDK's fault: the value is lost, and counted as such
                with self._lock:
                    self.dropped += 1
                    self._add(contract.EXPORT_ERRORS, 1, target)

    # ------------------------------------------------------------------ exporter protocol

    def _add(self, metric: contract.Metric, amount: float, *labels: str) -> None:
        totals = self._totals[metric]
        totals[labels] = totals.get(labels, 0) + amount

    def register(self, target: str, sample_rate: float) -> None:
        """Create the target's sums at zero and record its sample rate."""
        with self._lock:
            self._rates[target] = sample_rate
            for metric, labels in contract.zero_series(target):
                self._add(metric, 0, *(labels[name] for name in metric.labels))

    def set_drill(self, active: bool) -> None:
        """Show whether a fire drill is injecting synthetic divergence."""
        self._drill = 1 if active else 0

    def record_calls(self, target: str, calls: int, signature: str = "") -> None:
        with self._lock:
            self._add(contract.CALLS, calls, target, signature, self._side(target))

    def _side(self, target: str) -> str:
        """The side the caller of ``target`` gets now (as set_primary last said)."""
        return "upstream" if self._primary.get((target, "upstream")) else "legacy"

    def set_primary(self, target: str, side: str) -> None:
        with self._lock:
            for each in ("legacy", "upstream"):
                self._primary[(target, each)] = 1 if each == side else 0

    def record_rollback(self, target: str, by: str) -> None:
        with self._lock:
            self._add(contract.ROLLBACKS, 1, target, contract.rollback_source(by))

    def record_reset(self, target: str, by: str) -> None:
        with self._lock:
            self._add(contract.RESETS, 1, target)

    def record_skips(self, target: str, reason: str, count: int) -> None:
        """Sampled calls skipped without an observation each (the overhead budget), reported in bulk."""
        with self._lock:
            self._add(contract.SKIPPED, count, target, reason, "", self._side(target))

    def record_time(self, seconds: float) -> None:
        if seconds > 0:
            with self._lock:
                self._add(contract.PROCESS_TIME, seconds)

    def record_export_error(self, target: str) -> None:
        with self._lock:
            self._add(contract.EXPORT_ERRORS, 1, target)

    def export(self, observation: Observation) -> None:
        target, add = observation.target, self._add
        with self._lock:
            if observation.outcome == Outcome.SKIPPED:
                for reason in observation.reasons:
                    add(contract.SKIPPED, 1, target, reason, observation.signature, observation.primary)
                return
            add(contract.COMPARISONS, 1, target, observation.outcome, observation.signature, observation.primary)
            if observation.cluster_share:
                add(contract.CLUSTERS, observation.cluster_share, target, observation.primary)
            for reason in observation.reasons:
                add(contract.MISMATCHES, 1, target, reason, observation.primary)
            if observation.shared_divergence:
                add(contract.SHARED_DIVERGENCES, 1, target, observation.shared_divergence, observation.primary)
            if observation.aa:
                signature = observation.signature
                differs = observation.aa_abs_error > 0 or observation.aa_rel_error > 0
                add(contract.AA_RUNS, 1, target, signature, "differs" if differs else "same")
                for measure, value in (("abs", observation.aa_abs_error), ("rel", observation.aa_rel_error)):
                    key = (target, signature, measure)
                    self._floors[key] = max(self._floors.get(key, 0.0), min(value, contract.ERROR_CAP))
            if observation.backward:
                add(
                    contract.BACKWARD_RUNS, 1, target, observation.signature, observation.primary,
                    observation.backward_outcome,
                )  # fmt: skip
            if observation.backward_skip:
                add(contract.BACKWARD_SKIPS, 1, target, observation.backward_skip)
            if observation.nearer:
                add(contract.TRUTH_RUNS, 1, target, observation.signature, observation.nearer)
            add(contract.LEGACY, observation.primary_seconds, target)
            add(contract.SHADOW, observation.overhead_seconds, target)
        values = [(contract.SHADOW_DURATION, observation.overhead_seconds, target)]
        if observation.outcome != Outcome.ERROR and observation.numel:
            values.append((contract.ABS_ERROR, min(observation.max_abs_error, contract.ERROR_CAP), target))
            values.append((contract.REL_ERROR, min(observation.max_rel_error, contract.ERROR_CAP), target))
        if len(self._pending) + len(values) > MAX_PENDING:
            with self._lock:
                self.dropped += 1
                add(contract.EXPORT_ERRORS, 1, target)
            return
        self._pending.extend(values)

    def export_arm(self, run: ArmRun) -> None:
        """One iterator of a canary A/B (:mod:`shadow.core.calls.canary.arms`)."""
        with self._lock:
            self._add(contract.ARM_ITERATORS, 1, run.target, run.arm, "bound" if run.workers_bound else "unbound")
            if run.first_batch_seconds is not None:
                self._add(contract.ARM_FIRST_BATCH, run.first_batch_seconds, run.target, run.arm)
                self._add(contract.ARM_FIRST_BATCHES, 1, run.target, run.arm)

    def _after_fork_in_child(self) -> None:
        # The parent's totals are the parent's: a forked child reports its own, from zero (its series stay).
        self._lock = threading.Lock()
        for totals in self._totals.values():
            for labels in totals:
                totals[labels] = 0
        self._pending.clear()
        self.dropped = 0
