"""Per-observation cost of the three exporters together: Prometheus, OpenTelemetry (SDK with an in-memory reader)
and the JSONL journal (every observation written), as the monitor's publisher hands them over: the observation
queued on the caller's thread, its samples made once and each exporter's ``record`` and ``export`` called at
delivery (the reporter's thread). Goal: under 50 microseconds for the delivery, the caller's share a fraction of it.

Run: ``python benchmarks/bench_exporters.py`` (``--quick`` for a smoke run).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from prometheus_client import CollectorRegistry

from exporters import JsonlExporter, OTelExporter, PrometheusExporter
from shadow.core.calls.record.record import Publisher
from shadow.core.model import contract
from shadow.core.model.observation import Observation


def _per_observation(publisher: Publisher, observation: Observation, count: int) -> tuple[float, float]:
    """(seconds per observation queued on the caller's thread, per observation delivered)."""
    start = time.perf_counter()
    for _ in range(count):
        publisher.export_observation(observation.target, observation, _ignore)
    queued = time.perf_counter()
    publisher.deliver()
    return (queued - start) / count, (time.perf_counter() - queued) / count


def _ignore(failed: int) -> None:
    raise AssertionError(f"{failed} exporters failed")


def measure(observation: Observation, count: int, trials: int, tmp: str) -> tuple[float, float, dict[str, float]]:
    """Median seconds per observation for the three exporters together (queued, delivered), and delivered to each
    alone."""
    exporters = [
        PrometheusExporter(registry=CollectorRegistry()),
        OTelExporter(meter_provider=MeterProvider(metric_readers=[InMemoryMetricReader()])),
        JsonlExporter(f"{tmp}/journal-{observation.outcome}.jsonl", max_bytes=64 << 20),
    ]
    for exporter in exporters:
        exporter.record(contract.registered_samples(observation.target, 0.01))
    together, queued, alone = Publisher(exporters), [], {type(e).__name__: [] for e in exporters}
    delivered = []
    for _ in range(trials):
        caller, delivery = _per_observation(together, observation, count)
        queued.append(caller)
        delivered.append(delivery)
        for exporter in exporters:
            alone[type(exporter).__name__].append(_per_observation(Publisher([exporter]), observation, count)[1])
    exporters[2].close()
    return (
        statistics.median(queued),
        statistics.median(delivered),
        {name: statistics.median(v) for name, v in alone.items()},
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    count, trials = (500, 3) if args.quick else (4096, 15)
    mismatch = Observation(
        target="tensor_type",
        outcome="mismatch",
        reasons=("dtype", "value"),
        max_abs_error=0.125,
        max_rel_error=0.01,
        mismatched=3,
        numel=4096,
        primary_seconds=2e-5,
        shadow_seconds=3e-5,
        compare_seconds=1e-4,
        signature="npu_name/npu/blocking",
        detail="output: dtype torch.float16 vs torch.float32; 3 / 4096 elements differ",
        timestamp=time.time(),
    )
    match = dataclasses.replace(mismatch, outcome="match", reasons=(), max_abs_error=0.0, max_rel_error=0.0, detail="")
    with tempfile.TemporaryDirectory() as tmp:
        for label, observation in (("match (journal skips it)", match), ("mismatch (journal writes it)", mismatch)):
            queued, together, alone = measure(observation, count, trials, tmp)
            parts = ", ".join(f"{name} {seconds * 1e6:.1f} us" for name, seconds in alone.items())
            print(
                f"exporters together, {label}: {together * 1e6:.1f} us per observation delivered "
                f"(goal < 50 us; median of {trials} x {count}), {queued * 1e6:.1f} us of it queued on the "
                f"caller's thread; alone: {parts}"
            )


if __name__ == "__main__":
    main()
