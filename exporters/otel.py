"""OpenTelemetry exporter, on opentelemetry-api only.

A library records through the API and leaves the SDK (readers, exporters, collectors) to the
application; without an SDK these instruments are no-ops. The instruments follow
:mod:`exporters.contract`, so the SDK's Prometheus translation yields the same names as
:class:`exporters.PrometheusExporter`.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

from opentelemetry import metrics

from exporters import contract
from shadow.observation import Observation

METER_NAME = "npu_shadow"


class OTelExporter:
    """Exports observations through an OpenTelemetry meter named ``npu_shadow``.

    ``meter_provider``: the provider to use (tests pass their own); the global one by default.
    Versions (this package, torch, torch_npu) are the meter's version and attributes.
    """

    def __init__(self, meter_provider: metrics.MeterProvider | None = None) -> None:
        versions = contract.versions()
        self.meter = metrics.get_meter(
            METER_NAME, versions["version"], meter_provider=meter_provider, attributes=versions
        )
        self._rates: dict[str, float] = {}
        self._rates_lock = threading.Lock()
        self._instruments: dict[contract.Metric, Any] = {}
        for metric in contract.ALL:
            if metric is contract.SAMPLE_RATE:
                self._instruments[metric] = self.meter.create_observable_gauge(
                    metric.otel_name, [self._observe_rates], unit=metric.unit, description=metric.description
                )
            elif metric.kind == "counter":
                self._instruments[metric] = self.meter.create_counter(
                    metric.otel_name, unit=metric.unit, description=metric.description
                )
            else:
                buckets = contract.DURATION_BUCKETS if metric is contract.SHADOW_DURATION else contract.ERROR_BUCKETS
                self._instruments[metric] = self.meter.create_histogram(
                    metric.otel_name,
                    unit=metric.unit,
                    description=metric.description,
                    explicit_bucket_boundaries_advisory=list(buckets),
                )

    def _observe_rates(self, options: metrics.CallbackOptions) -> Iterable[metrics.Observation]:
        with self._rates_lock:
            rates = dict(self._rates)
        return [metrics.Observation(rate, {"target": target}) for target, rate in rates.items()]

    def _add(self, metric: contract.Metric, amount: float, **attributes: str) -> None:
        self._instruments[metric].add(amount, attributes)

    def register(self, target: str, sample_rate: float) -> None:
        """Create the target's sums at zero and record its sample rate."""
        with self._rates_lock:
            self._rates[target] = sample_rate
        for metric, labels in contract.zero_series(target):
            self._add(metric, 0, **labels)

    def record_calls(self, target: str, calls: int) -> None:
        self._add(contract.CALLS, calls, target=target)

    def record_export_error(self, target: str) -> None:
        self._add(contract.SKIPPED, 1, target=target, reason="export")

    def export(self, observation: Observation) -> None:
        target = observation.target
        self._add(contract.COMPARISONS, 1, target=target, outcome=observation.outcome, signature=observation.signature)
        if observation.outcome == "skipped":
            for reason in observation.reasons:
                self._add(contract.SKIPPED, 1, target=target, reason=reason)
            return
        for reason in observation.reasons:
            self._add(contract.MISMATCHES, 1, target=target, reason=reason)
        attributes = {"target": target}
        if observation.outcome != "error" and observation.numel:
            self._instruments[contract.ABS_ERROR].record(min(observation.max_abs_error, contract.ERROR_CAP), attributes)
            self._instruments[contract.REL_ERROR].record(min(observation.max_rel_error, contract.ERROR_CAP), attributes)
        self._add(contract.LEGACY, observation.legacy_seconds, target=target)
        self._add(contract.SHADOW, observation.shadow_seconds, target=target)
        self._instruments[contract.SHADOW_DURATION].record(observation.shadow_seconds, attributes)
