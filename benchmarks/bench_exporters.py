"""Per-observation cost of the three exporters together: Prometheus, OpenTelemetry (SDK with an
in-memory reader) and the JSONL journal (every observation written). Goal: under 50 microseconds.

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
from shadow.core.model.observation import Observation


def measure(observation: Observation, count: int, trials: int, tmp: str) -> tuple[float, dict[str, float]]:
    """Median seconds per observation for the three exporters together, and for each alone."""
    exporters = [
        PrometheusExporter(registry=CollectorRegistry()),
        OTelExporter(meter_provider=MeterProvider(metric_readers=[InMemoryMetricReader()])),
        JsonlExporter(f"{tmp}/journal-{observation.outcome}.jsonl", max_bytes=64 << 20),
    ]
    for exporter in exporters[:2]:
        exporter.register(observation.target, 0.01)
    per_exporter: dict[str, list[float]] = {type(e).__name__: [] for e in exporters}
    together = []
    for _ in range(trials):
        start = time.perf_counter()
        for _ in range(count):
            for exporter in exporters:
                exporter.export(observation)
        together.append((time.perf_counter() - start) / count)
        for exporter in exporters:
            start = time.perf_counter()
            for _ in range(count):
                exporter.export(observation)
            per_exporter[type(exporter).__name__].append((time.perf_counter() - start) / count)
    exporters[2].close()
    return statistics.median(together), {name: statistics.median(v) for name, v in per_exporter.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    count, trials = (500, 3) if args.quick else (20_000, 9)
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
            together, alone = measure(observation, count, trials, tmp)
            parts = ", ".join(f"{name} {seconds * 1e6:.1f} us" for name, seconds in alone.items())
            print(
                f"exporters together, {label}: {together * 1e6:.1f} us per observation "
                f"(goal < 50 us; median of {trials} x {count}); alone: {parts}"
            )


if __name__ == "__main__":
    main()
