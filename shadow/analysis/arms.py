"""What a canary A/B's iterators say (:mod:`shadow.core.calls.canary.arms`): the affinity each arm gives its
workers and leaves on the caller's thread, its throughput and time to the first batch as distributions, and
whether batches of the same seed are equal.

Throughput and first-batch time are compared as ratios, upstream's over legacy's: the Hodges-Lehmann estimate of
the shift between the two arms' log values (the median of every upstream-minus-legacy difference), with the 95%
interval that inverts the Mann-Whitney test (Hollander, Wolfe and Chicken, "Nonparametric Statistical Methods",
3rd ed., section 4.3: the differences ranked C + 1 and mn - C, C = mn/2 - z sqrt(mn(m + n + 1)/12) from the normal
approximation): the same rank test the noise floor uses (:mod:`shadow.core.judging.noise`), so a difference the test
would
call noise shows as an interval that holds 1.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Iterable, Sequence
from statistics import median
from typing import Any

from shadow.core.model import contract

ARMS = ("legacy", "upstream")
_Z = 1.959963984540054  # (the normal's 97.5% quantile: a two-sided 95% interval)


@dataclasses.dataclass(frozen=True)
class Ratio:
    """upstream / legacy: the estimate and its 95% interval (None where an arm has too few values for one)."""

    estimate: float
    lower: float | None
    upper: float | None
    legacy_values: int
    upstream_values: int

    def describe(self) -> str:
        interval = "" if self.lower is None else f" [{self.lower:.2f}, {self.upper:.2f}]"
        return f"{self.estimate:.2f}x{interval}"

    @property
    def differs(self) -> bool:
        """Whether the interval excludes 1 (no interval: not shown to differ)."""
        return self.lower is not None and (self.lower > 1 or self.upper < 1)


def hodges_lehmann(upstream: Sequence[float], legacy: Sequence[float]) -> tuple[float, float | None, float | None]:
    """(estimate, lower, upper) of the shift upstream - legacy: the median of the pairwise differences and the 95%
    interval that inverts the two-sided Mann-Whitney test (None, None where the samples are too small for one)."""
    differences = sorted(u - v for u in upstream for v in legacy)
    m, n = len(upstream), len(legacy)
    estimate = median(differences)
    c = math.floor(m * n / 2 - _Z * math.sqrt(m * n * (m + n + 1) / 12))
    if c < 0:
        return estimate, None, None
    return estimate, differences[c], differences[m * n - 1 - c]


def ratio(upstream: Sequence[float], legacy: Sequence[float]) -> Ratio | None:
    """upstream / legacy of positive values, by :func:`hodges_lehmann` on their logarithms (None without values
    on both sides)."""
    ups = [math.log(v) for v in upstream if v > 0]
    legs = [math.log(v) for v in legacy if v > 0]
    if not ups or not legs:
        return None
    estimate, lower, upper = hodges_lehmann(ups, legs)
    return Ratio(
        math.exp(estimate),
        None if lower is None else math.exp(lower),
        None if upper is None else math.exp(upper),
        len(legs),
        len(ups),
    )


def _cores(cores: Iterable[int]) -> str:
    """``0-3,6`` for a set of cores."""
    ordered = sorted(set(cores))
    spans: list[str] = []
    start = previous = None
    for core in [*ordered, None]:
        if core is not None and previous is not None and core == previous + 1:
            previous = core
            continue
        if start is not None:
            spans.append(str(start) if start == previous else f"{start}-{previous}")
        start = previous = core
    return ",".join(spans) or "none"


@dataclasses.dataclass(frozen=True)
class ArmSummary:
    """One A/B target's iterators, by arm, and what they show."""

    target: str
    iterators: dict[str, int]
    affinity: str  # "same", or what differs
    throughput: Ratio | None
    first_batch: Ratio | None
    seeds_equal: int
    seeds_differ: tuple[int, ...]
    raised: dict[str, int]

    def line(self) -> str:
        """``upstream's iterator: affinity differs (...), throughput 0.97x [0.93, 1.01], ...``."""
        parts = [f"affinity {self.affinity}"]
        if self.throughput is not None:
            parts.append(f"throughput {self.throughput.describe()}")
        if self.first_batch is not None:
            parts.append(f"first batch {self.first_batch.describe()}")
        if self.seeds_differ:
            parts.append(f"batches DIFFER for seeds {', '.join(map(str, self.seeds_differ[:5]))}")
        elif self.seeds_equal:
            parts.append(f"batches equal for {self.seeds_equal} seed(s) seen in both arms")
        if self.raised:
            parts.append("raised: " + ", ".join(f"{arm} {count}" for arm, count in sorted(self.raised.items())))
        counts = ", ".join(f"{arm} {count}" for arm, count in sorted(self.iterators.items()))
        return f"upstream's iterator: {', '.join(parts)} ({counts} iterators)"

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _affinity(runs: list[dict]) -> str:
    """What the arms do to CPU affinity: "same", or how legacy's workers and caller's thread differ."""
    by_arm: dict[str, list[dict]] = {"legacy": [], "upstream": []}
    for run in runs:
        by_arm.setdefault(run.get("arm", ""), []).append(run)

    def workers(arm: str) -> set[tuple]:
        return {tuple(c) for r in by_arm[arm] for c in r.get("worker_cores") or ()}

    def caller_changed(arm: str) -> list[tuple]:
        return [
            tuple(r["caller_cores_after"]) for r in by_arm[arm] if r["caller_cores_after"] != r["caller_cores_before"]
        ]

    legacy_workers, upstream_workers = workers("legacy"), workers("upstream")
    notes = []
    if legacy_workers and upstream_workers and legacy_workers != upstream_workers:
        process = _cores(next(iter(runs))["process_cores"])
        notes.append(
            f"legacy's workers run on cores {' / '.join(_cores(c) for c in sorted(legacy_workers))}, upstream's on "
            f"{' / '.join(_cores(c) for c in sorted(upstream_workers))} (of {process})"
        )
    changed = caller_changed("legacy")
    if changed and not caller_changed("upstream"):
        notes.append(f"legacy leaves the caller's thread on cores {_cores(changed[-1])}")
    return "differs: " + "; ".join(notes) if notes else "same"


def _values(runs: list[dict], arm: str, field: str) -> list[float]:
    return [r[field] for r in runs if r["arm"] == arm and isinstance(r.get(field), (int, float))]


def summarize(records: Iterable[dict]) -> list[ArmSummary]:
    """One summary per A/B target from its iterator records (the journal's ``"event": "arm"`` lines)."""
    by_target: dict[str, list[dict]] = {}
    for record in records:
        if isinstance(record.get("target"), str) and record.get("arm") in ("legacy", "upstream"):
            by_target.setdefault(record["target"], []).append(record)
    summaries = []
    for target, runs in sorted(by_target.items()):
        iterators: dict[str, int] = {}
        raised: dict[str, int] = {}
        for run in runs:
            iterators[run["arm"]] = iterators.get(run["arm"], 0) + 1
            if run.get("raised"):
                raised[run["arm"]] = raised.get(run["arm"], 0) + 1

        digests: dict[Any, dict[str, set]] = {}
        for run in runs:
            if run.get("first_batch_digest") and run.get("base_seed") is not None:
                digests.setdefault(run["base_seed"], {}).setdefault(run["arm"], set()).add(run["first_batch_digest"])
        both = {seed: arms for seed, arms in digests.items() if len(arms) == 2}
        differ = tuple(sorted(seed for seed, arms in both.items() if arms["legacy"] != arms["upstream"]))
        summaries.append(
            ArmSummary(
                target=target,
                iterators=iterators,
                affinity=_affinity(runs),
                throughput=ratio(
                    _values(runs, "upstream", "batches_per_second"), _values(runs, "legacy", "batches_per_second")
                ),
                first_batch=ratio(
                    _values(runs, "upstream", "first_batch_seconds"), _values(runs, "legacy", "first_batch_seconds")
                ),
                seeds_equal=len(both) - len(differ),
                seeds_differ=differ,
                raised=raised,
            )
        )
    return summaries


def summarize_series(samples: Iterable[tuple[str, dict[str, str], float]]) -> list[ArmSummary]:
    """One summary per A/B target from its metrics (``npu_shadow_arm_*``): iterators by arm, whether their workers
    were bound, and the mean time to the first batch (a ratio of means: metrics keep no distribution, so no
    interval; the journals have one)."""
    totals: collections.Counter[tuple[str, str, str]] = collections.Counter()  # (series kind, target, arm)
    for series, labels, value in samples:
        target, arm = labels.get("target", ""), labels.get("arm", "")
        if arm not in ("legacy", "upstream") or value <= 0:
            continue
        if series == contract.ARM_ITERATORS.series:
            totals["iterators", target, arm] += value
            if labels.get("workers") == "bound":
                totals["bound", target, arm] += value
        elif series == contract.ARM_FIRST_BATCHES.series:
            totals["first batches", target, arm] += value
        elif series == contract.ARM_FIRST_BATCH.series:
            totals["first batch seconds", target, arm] += value
    summaries = []
    for target in sorted({target for kind, target, _ in totals if kind == "iterators"}):
        counts = {arm: round(totals["iterators", target, arm]) for arm in ARMS if totals["iterators", target, arm]}
        bound = {arm: round(totals["bound", target, arm]) for arm in ARMS}
        affinity = "same"
        if any(bound.values()) and bound["legacy"] != bound["upstream"]:
            affinity = "differs: workers bound to fewer cores than the process had in " + ", ".join(
                f"{bound[arm]} of {counts.get(arm, 0)} {arm} iterators" for arm in sorted(counts)
            )
        means = {
            arm: totals["first batch seconds", target, arm] / totals["first batches", target, arm]
            for arm in ARMS
            if totals["first batches", target, arm] > 0 and totals["first batch seconds", target, arm] > 0
        }
        first = None
        if len(means) == 2:
            first = Ratio(
                means["upstream"] / means["legacy"], None, None, counts.get("legacy", 0), counts.get("upstream", 0)
            )
        summaries.append(ArmSummary(target, counts, affinity, None, first, 0, (), {}))
    return summaries
