"""A simulated fleet, as its jobs' endpoints show it: each job one node of ``ranks`` processes under the launcher (one
endpoint for them all), its series those of the launcher's defaults (the metric contract's names and labels: the
targets it calls with their comparisons, clusters, times and histograms; the ones it never calls with their calls at
zero), its counts growing with its hours of evidence. For ``tests/test_fleet.py`` and ``benchmarks/bench_fleet.py``:
served as an exposition to a Prometheus that scrapes it, or written with timestamps for the stores' own ingestion
(promtool's backfill, VictoriaMetrics' import)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator

from shadow.core.model import contract

#: The targets each simulated job calls (compared at its sample rate), and those installed that it never calls.
CALLED = ("parallel_apply", "data_parallel", "tensor_type", "tensor_repr", "torch_save")
IDLE = ("foreach_devices", "lstm_forward", "module_npu", "module_to", "storage_cpu", "storage_deepcopy", "torch_load")
#: The function patches of torch_npu 2.14.0 each job calls, with its calls a rank-minute.
PATCHES = {"torch.Tensor.__repr__": 2, "torch.serialization._save": 1, "torch.load": 1}
SAMPLE_RATE = 0.2
#: The one call signature each called target takes (none of the built-in risky ones: those are never called).
SIGNATURE = "sim"
#: Calls of each called target a rank-minute, and the shadow side's seconds per comparison.
CALLS_PER_RANK_MINUTE = 50
SHADOW_SECONDS = 0.002

Series = tuple[str, dict[str, str], float]


@dataclasses.dataclass(frozen=True)
class Job:
    """One simulated job: its Prometheus ``job`` and run, how long it has run, the fraction of its comparisons that
    diverge (a value mismatch), its ranks, and when it started (unix seconds)."""

    name: str
    run: str
    hours: float
    diverging: float = 0.0
    ranks: int = 8
    started: float = 0.0

    def series(self, elapsed: float) -> list[Series]:
        """Every series of the job's endpoint ``elapsed`` seconds after it started: (name, labels, value)."""
        minutes = elapsed / 60
        found: list[Series] = []

        def add(metric: contract.Metric, value: float, suffix: str = "", **labels: str) -> None:
            found.append((metric.prometheus_name + suffix, labels, float(value)))

        def counter(metric: contract.Metric, value: float, **labels: str) -> None:
            add(metric, value, "_total", **labels)

        def histogram(metric: contract.Metric, buckets: tuple[float, ...], value: float, count: float, **labels: str):
            for bound in (*buckets, math.inf):
                le = "+Inf" if bound == math.inf else repr(bound)
                add(metric, count if value <= bound else 0, "_bucket", le=le, **labels)
            add(metric, value * count, "_sum", **labels)
            add(metric, count, "_count", **labels)

        legacy = {"primary": "legacy"}
        for target in CALLED:
            calls = round(self.ranks * CALLS_PER_RANK_MINUTE * minutes)
            compared = round(calls * SAMPLE_RATE)
            divergent = round(compared * self.diverging)
            signed = {"signature": SIGNATURE, **legacy}
            counter(contract.CALLS, calls, target=target, **signed)
            counter(contract.COMPARISONS, compared - divergent, target=target, outcome="match", **signed)
            if divergent:
                counter(contract.COMPARISONS, divergent, target=target, outcome="mismatch", **signed)
                counter(contract.MISMATCHES, divergent, target=target, reason="value", **legacy)
            blocks = self.ranks * math.ceil(minutes)
            counter(contract.CLUSTERS, blocks, target=target, **legacy)
            counter(contract.CALL_BLOCKS, blocks, target=target, **legacy)
            counter(contract.PRIMARY_TIME, compared * SHADOW_SECONDS / 2, target=target)
            counter(contract.SHADOW, compared * SHADOW_SECONDS, target=target)
            histogram(contract.SHADOW_DURATION, contract.DURATION_BUCKETS, SHADOW_SECONDS, compared, target=target)
            histogram(contract.ABS_ERROR, contract.ERROR_BUCKETS, 1e-7, compared, target=target)
            histogram(contract.REL_ERROR, contract.ERROR_BUCKETS, 1e-5, compared, target=target)
        for target in CALLED + IDLE:
            counter(contract.CALLS, 0, target=target, signature="", **legacy)  # (created at zero when installed)
            add(contract.SAMPLE_RATE, SAMPLE_RATE, target=target)
            add(contract.PRIMARY, 1, target=target, side="legacy")
            add(contract.PRIMARY, 0, target=target, side="upstream")
        for patch, per_rank_minute in PATCHES.items():
            counter(contract.PATCH_CALLS, round(self.ranks * per_rank_minute * minutes), patch=patch)
        counter(contract.PROCESSES, self.ranks)
        counter(contract.PROCESS_TIME, self.ranks * elapsed)
        versions = {"version": "0.1.0", "torch": "2.13.0", "torch_npu": "2.14.0", "command": f"c-{self.name}"}
        add(contract.BUILD_INFO, 1, **versions, restart="0")
        add(contract.STARTED, self.started)
        add(contract.RUN_STARTED, self.started)
        add(contract.DRILL_ACTIVE, 0)
        return [(name, {"run": self.run, **labels}, value) for name, labels, value in found]


def exposition(job: Job, elapsed: float) -> str:
    """The job's endpoint as a scrape reads it ``elapsed`` seconds after its start."""
    lines = []
    for name, labels, value in job.series(elapsed):
        rendered = ",".join(f'{key}="{text}"' for key, text in sorted(labels.items()))
        lines.append(f"{name}{{{rendered}}} {value!r}")
    return "\n".join(lines) + "\n"


def timestamped(job: Job, instance: str, moments: list[float], millis: bool = False) -> Iterator[str]:
    """The job's series at each of ``moments`` (unix seconds, from its start on), one line a sample with its time
    (seconds, OpenMetrics, for promtool's backfill; ``millis``: milliseconds, for VictoriaMetrics' import), with the
    ``job`` and ``instance`` labels a scrape would have added."""
    for moment in moments:
        for name, labels, value in job.series(moment - job.started):
            labels = {**labels, "job": job.name, "instance": instance}
            rendered = ",".join(f'{key}="{text}"' for key, text in sorted(labels.items()))
            at = f"{round(moment * 1000)}" if millis else f"{moment:.3f}"
            yield f"{name}{{{rendered}}} {value!r} {at}"


def openmetrics_types(job: Job) -> list[str]:
    """The ``# TYPE`` lines of the job's families (promtool's backfill needs each family typed before its samples)."""
    kinds: dict[str, str] = {}
    for metric in (*contract.ALL, contract.BUILD_INFO):
        kinds[metric.prometheus_name] = metric.kind
    return [f"# TYPE {name} {kind}" for name, kind in sorted(kinds.items())]


def moments(job: Job, end: float, every: float = 600.0, dense_last: float = 900.0, dense_every: float = 60.0):
    """The times a job's history is sampled at: every ``every`` seconds from its start, and every ``dense_every``
    seconds over its last ``dense_last`` (a scrape's spacing there, where the verdict finds the run's last sample and
    its recent windows begin), up to ``end``."""
    start = end - job.hours * 3600
    sparse = [start + k * every for k in range(int((end - dense_last - start) // every) + 1)]
    dense = [end - dense_last + k * dense_every for k in range(int(dense_last // dense_every) + 1)]
    return sorted({round(m, 3) for m in sparse + dense if start <= m <= end})
