"""Turning counts into a decision: promote, rollback or inconclusive, per target.

Divergence counts whole comparisons: a comparison diverges when its outcome is ``mismatch`` or
``error``. With k divergent comparisons out of n, the one-sided 95% Clopper-Pearson bounds of the
divergence rate are ``beta.ppf(0.05, k, n - k + 1)`` (lower) and ``beta.ppf(0.95, k + 1, n - k)``
(upper).

Two corrections make those bounds honest where comparisons are not a simple random sample of calls, both by
an effective sample size in the same Clopper-Pearson formula (Korn and Graubard's method for survey data: k and n
replaced by p * n_eff and n_eff, real numbers):

- **Weights.** Coverage-guided sampling compares the first calls of every signature, so rare signatures are
  over-represented among comparisons. Where the source has calls by signature, the rate is estimated as
  ``sum_s (N_s / N) * (k_s / n_s)`` (each signature weighted by its share of calls) with Kish's effective sample
  size ``n_eff = N**2 / sum_s (N_s**2 / n_s)`` (n itself when sampling was uniform).
- **Clusters.** Comparisons inside one process and one time window share a step, a batch, a state: they are not
  independent trials. Where the source has each comparison's process and time (journals), comparisons are grouped
  into clusters and the design effect of the cluster-robust variance of the rate gives ``n_eff = n / deff``; with
  no divergence at all the data cannot show how correlated a cluster is, and the cluster bound assumes it wholly
  is (``n_eff`` = Kish's effective number of clusters, ``(sum n_c)**2 / sum n_c**2``). The decision takes the more
  conservative of the call bound and the cluster bound (the wider interval).

- rollback: any hard mismatch (a difference in kind: dtype, shape, NaN/inf, structure, device, requires_grad,
  the torch state left behind, an exception), or the lower bound above ``max_rate``;
- promote: no hard mismatch, the upper bound below ``max_rate`` (zero divergences need about
  3 / max_rate comparisons), every risky signature of the target compared ``min_per_signature`` times, and no
  sampled call skipped for a reason that keeps the evidence from a kind of call (user hooks or modes, compiled
  code: ``UNCOVERED_REASONS``);
- inconclusive otherwise, saying what more is needed.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
from collections.abc import Iterable, Mapping

from scipy.stats import beta

from shadow.core.observation import COMPARED_OUTCOMES, DIVERGENT_OUTCOMES, HARD_REASONS, UNCOVERED_REASONS

PROMOTE, ROLLBACK, INCONCLUSIVE = "promote", "rollback", "inconclusive"
EXIT_CODES = {PROMOTE: 0, ROLLBACK: 1, INCONCLUSIVE: 3}  # 2 is left to usage errors
_SEVERITY = {PROMOTE: 0, INCONCLUSIVE: 1, ROLLBACK: 2}
CONFIDENCE = 0.95
#: More comparisons than any job makes: what the tiniest max rates would need is reported as this.
_MOST_COMPARISONS = 2**63

#: What to do about each kind of call the evidence does not reach (the verdict's "why").
_UNCOVERED_WHY = {
    "hooks": "user module hooks; declare them free of side effects with --pure-hooks to compare such calls",
    "mode": "a user's TorchFunctionMode/TorchDispatchMode or tensor subclass was in the call",
    "compiling": "called inside torch.compile; compare compiled code with a suite A/B run (npu-shadow ab)",
    "inplace": "legacy wrote a tensor argument in place; such calls cannot be re-run from their start",
}
DEFAULT_MAX_RATE = 0.001  # the divergence rate a rollout tolerates; the alert rules' budget too
#: The burn-rate alerts fire at these multiples of the max rate (the rules and the report's chart share them).
BURN_RATE_FACTORS = {"fast burn": 14.4, "slow burn": 6.0}


def upper_bound(k: float, n: float, confidence: float = CONFIDENCE) -> float:
    """One-sided Clopper-Pearson upper bound of a rate with k events in n trials (1.0 when n == 0); k and n may be
    effective (real) counts."""
    return 1.0 if k >= n else float(beta.ppf(confidence, k + 1, n - k))


def lower_bound(k: float, n: float, confidence: float = CONFIDENCE) -> float:
    """One-sided Clopper-Pearson lower bound (0.0 when k == 0)."""
    return 0.0 if k <= 0 else float(beta.ppf(1 - confidence, k, n - k + 1))


def weighted_rate(
    compared: Mapping[str, float], divergent: Mapping[str, float], calls: Mapping[str, float]
) -> tuple[float, float] | None:
    """(rate, effective sample size) with each signature weighted by its share of calls (see the module
    docstring), over the signatures that were compared; None where calls by signature are not known for them."""
    seen = {s: n for s, n in compared.items() if n > 0}
    if not seen or any(calls.get(s, 0) <= 0 for s in seen):
        return None
    total = sum(calls[s] for s in seen)
    rate = sum(calls[s] / total * divergent.get(s, 0) / n for s, n in seen.items())
    return rate, total * total / sum(calls[s] ** 2 / n for s, n in seen.items())


def clustered_rate(clusters: Iterable[tuple[float, float]]) -> tuple[float, float] | None:
    """(rate, effective sample size) of (compared, divergent) clusters (see the module docstring); None for none."""
    clusters = [(n, k) for n, k in clusters if n > 0]
    if not clusters:
        return None
    n = sum(c for c, _ in clusters)
    k = sum(d for _, d in clusters)
    rate = k / n
    kish = n * n / sum(c * c for c, _ in clusters)  # clusters, weighted by size: full correlation inside each
    if k == 0 or k == n or len(clusters) < 2:
        return rate, kish
    variance = len(clusters) / (len(clusters) - 1) * sum((d - rate * c) ** 2 for c, d in clusters) / (n * n)
    design_effect = variance / (rate * (1 - rate) / n)
    return rate, min(n, max(kish, n / design_effect)) if design_effect > 1 else n


def comparisons_needed(max_rate: float, k: int = 0, confidence: float = CONFIDENCE) -> int:
    """The least n whose upper bound with k divergences is below max_rate (about 3 / max_rate for k = 0)."""
    if k == 0:  # closed form: 1 - (1 - confidence) ** (1 / n) < max_rate
        needed = math.log(1 - confidence) / math.log1p(-max_rate)  # inf for the tiniest rates
        return math.floor(needed) + 1 if needed < _MOST_COMPARISONS else _MOST_COMPARISONS
    low, high = k + 1, max(k + 2, comparisons_needed(max_rate, 0, confidence))
    while upper_bound(k, high, confidence) >= max_rate:
        low, high = high, high * 2
    while low < high:
        middle = (low + high) // 2
        if upper_bound(k, middle, confidence) < max_rate:
            high = middle
        else:
            low = middle + 1
    return low


def wilson_upper(k: int, n: int, z: float = 1.6448536269514722) -> float:
    """One-sided 95% Wilson score upper bound (what the dashboard shows; cheap enough for PromQL)."""
    if n == 0:
        return 1.0
    p = k / n
    return (p + z * z / (2 * n) + z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))) / (1 + z * z / n)


@dataclasses.dataclass
class TargetCounts:
    """What a source knows about one target: comparisons by signature and outcome, reasons."""

    outcomes: dict[tuple[str, str], float] = dataclasses.field(default_factory=dict)  # (signature, outcome)
    reasons: dict[str, float] = dataclasses.field(default_factory=dict)
    shared: dict[str, float] = dataclasses.field(default_factory=dict)  # shared divergences by reason
    skipped: dict[str, float] = dataclasses.field(default_factory=dict)  # sampled calls not compared, by reason
    calls: dict[str, float] = dataclasses.field(default_factory=dict)  # calls by signature ("" when not guided)
    #: (compared, divergent) by cluster (process and time window), where the source knows them (journals).
    clusters: dict[tuple, list[float]] = dataclasses.field(default_factory=dict)
    #: How the clusters were formed, for the output ("process x 60 s windows").
    clustering: str = ""
    #: A fire drill injected synthetic divergence into these sources: how many comparisons carry it (journals),
    #: or -1 where only that a drill was active is known (metrics).
    drilled: float = 0
    #: Rollbacks the journals recorded (who or what threw the switch), in order.
    rollbacks: list[str] = dataclasses.field(default_factory=list)

    def add_outcome(self, signature: str, outcome: str, count: float) -> None:
        key = (signature, outcome)
        self.outcomes[key] = self.outcomes.get(key, 0) + count

    def add_reason(self, reason: str, count: float) -> None:
        self.reasons[reason] = self.reasons.get(reason, 0) + count

    def add_shared(self, reason: str, count: float) -> None:
        self.shared[reason] = self.shared.get(reason, 0) + count

    def add_skip(self, reason: str, count: float) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + count

    def add_calls(self, signature: str, count: float) -> None:
        self.calls[signature] = self.calls.get(signature, 0) + count

    def add_to_cluster(self, cluster: tuple, outcome: str) -> None:
        if outcome in COMPARED_OUTCOMES:
            counts = self.clusters.setdefault(cluster, [0.0, 0.0])
            counts[0] += 1
            counts[1] += outcome in DIVERGENT_OUTCOMES

    @property
    def clustered(self) -> int:
        """Comparisons whose cluster is known."""
        return round(sum(c for c, _ in self.clusters.values()))

    def by_signature(self, outcomes: Iterable[str]) -> dict[str, float]:
        found: dict[str, float] = {}
        for (signature, outcome), value in self.outcomes.items():
            if outcome in outcomes:
                found[signature] = found.get(signature, 0) + value
        return found

    @property
    def compared(self) -> int:
        return round(sum(v for (_, o), v in self.outcomes.items() if o in COMPARED_OUTCOMES))

    @property
    def divergent(self) -> int:
        return round(sum(v for (_, o), v in self.outcomes.items() if o in DIVERGENT_OUTCOMES))

    def compared_matching(self, pattern: str) -> int:
        return round(
            sum(v for (s, o), v in self.outcomes.items() if o in COMPARED_OUTCOMES and fnmatch.fnmatchcase(s, pattern))
        )


@dataclasses.dataclass(frozen=True)
class Decision:
    """The verdict on one target, with the numbers behind it."""

    target: str
    decision: str
    compared: int
    divergent: int
    lower: float
    upper: float
    hard: dict[str, int]
    why: str
    risky: dict[str, int] = dataclasses.field(default_factory=dict)  # risky signature pattern -> compared
    #: Shared divergences by reason: legacy and upstream agree, both unlike a single-device run. Reported on
    #: their own line; they never change the decision (removing the patch changes nothing there).
    shared: dict[str, int] = dataclasses.field(default_factory=dict)
    #: Sampled calls the evidence does not reach, by skip reason (UNCOVERED_REASONS: a user's hooks or modes,
    #: compiled code): coverage still missing, whatever the bounds say.
    uncovered: dict[str, int] = dataclasses.field(default_factory=dict)
    #: The rate and the effective sample size behind the bounds: over calls (weighted by each signature's share of
    #: calls where the source has calls by signature) and over clusters (where it has them); see the module doc.
    rate: float = 0.0
    effective: float = 0.0
    weighted: bool = False
    clusters: int = 0
    clustering: str = ""
    cluster_effective: float | None = None
    #: Comparisons a fire drill injected divergence into (-1: a drill was active, how many is not known); a
    #: verdict over a drill is a rehearsal of the alerting and rollback, not evidence about upstream.
    drilled: int = 0

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def decide(
    target: str,
    counts: TargetCounts,
    max_rate: float,
    risky: Iterable[str] = (),
    min_per_signature: int = 30,
) -> Decision:
    """The decision for one target (see the module docstring)."""
    n, k = counts.compared, counts.divergent
    weighted = weighted_rate(
        counts.by_signature(COMPARED_OUTCOMES), counts.by_signature(DIVERGENT_OUTCOMES), counts.calls
    )
    rate, effective = weighted if weighted is not None else (k / n if n else 0.0, float(n))
    lower, upper = lower_bound(rate * effective, effective), upper_bound(rate * effective, effective)
    # (only where every comparison's cluster is known: records without process and time say nothing of theirs)
    clustered = clustered_rate(counts.clusters.values()) if counts.clustered == n else None
    if clustered is not None:
        lower = min(lower, lower_bound(clustered[0] * clustered[1], clustered[1]))
        upper = max(upper, upper_bound(clustered[0] * clustered[1], clustered[1]))
    hard = {r: round(v) for r, v in counts.reasons.items() if r in HARD_REASONS and v > 0}
    coverage = {pattern: counts.compared_matching(pattern) for pattern in risky}
    made = {
        "target": target,
        "compared": n,
        "divergent": k,
        "lower": lower,
        "upper": upper,
        "hard": hard,
        "risky": coverage,
        "shared": {r: round(v) for r, v in counts.shared.items() if v > 0},
        "uncovered": {r: round(v) for r, v in counts.skipped.items() if r in UNCOVERED_REASONS and v > 0},
        "rate": rate,
        "effective": effective,
        "weighted": weighted is not None,
        "clusters": len(counts.clusters) if clustered is not None else 0,
        "clustering": counts.clustering,
        "cluster_effective": clustered[1] if clustered is not None else None,
        "drilled": round(counts.drilled),
    }
    if n == 0:
        needed = comparisons_needed(max_rate)
        why = f"not exercised: no call of this target was compared (about {needed} more comparisons without divergence)"
        return Decision(decision=INCONCLUSIVE, why=why, **made)
    if hard:
        kinds = ", ".join(f"{count} {reason}" for reason, count in sorted(hard.items()))
        return Decision(decision=ROLLBACK, why=f"hard mismatches: {kinds}", **made)
    if lower > max_rate:
        return Decision(
            decision=ROLLBACK,
            why=f"divergence rate is at least {lower:.3g} (95% lower bound, {k}/{n}) > max rate {max_rate:g}",
            **made,
        )
    missing = []
    if upper >= max_rate:
        effective_now = min(effective, clustered[1]) if clustered is not None else effective
        more = max(1, comparisons_needed(max_rate, k) - math.floor(effective_now))
        missing.append(
            f"upper bound {upper:.3g} >= max rate {max_rate:g}: about {more} more "
            f"{'independent ' if effective_now < n else ''}comparisons without divergence"
        )
    for pattern, seen in coverage.items():
        if seen < min_per_signature:
            missing.append(f"risky signature {pattern} compared {seen} times, needs {min_per_signature}")
    for reason, count in sorted(made["uncovered"].items()):
        missing.append(f"{count} sampled calls not compared ({reason}: {_UNCOVERED_WHY[reason]})")
    if missing:
        return Decision(decision=INCONCLUSIVE, why="; ".join(missing), **made)
    return Decision(
        decision=PROMOTE,
        why=f"divergence rate below {upper:.3g} (95% upper bound, {k}/{n}) < max rate {max_rate:g}",
        **made,
    )


def overall(decisions: Iterable[Decision]) -> str:
    """The worst decision (rollback over inconclusive over promote); inconclusive when there is none."""
    decisions = list(decisions)
    if not decisions:
        return INCONCLUSIVE
    return max((d.decision for d in decisions), key=_SEVERITY.__getitem__)


def drill_note(decisions: Iterable[Decision]) -> str:
    """The line that names a fire drill in a verdict's output, or "" when none was active."""
    drilled = [d for d in decisions if d.drilled]
    if not drilled:
        return ""
    counted = sum(d.drilled for d in drilled if d.drilled > 0)
    how_many = f"{counted:,} comparisons carry" if counted else "the metrics show"
    return (
        f"FIRE DRILL: {how_many} synthetic divergence injected by a fire drill ({', '.join(d.target for d in drilled)})"
        ": this verdict rehearses the alerting and the rollback, it is not evidence about upstream"
    )


def decide_all(
    counts: Mapping[str, TargetCounts],
    max_rate: float,
    risky: Mapping[str, Iterable[str]],
    min_per_signature: int,
) -> list[Decision]:
    return [decide(t, c, max_rate, risky.get(t, ()), min_per_signature) for t, c in sorted(counts.items())]
