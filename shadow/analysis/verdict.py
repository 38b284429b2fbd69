"""Turning counts into a decision: promote, rollback or inconclusive, per target.

Divergence counts whole comparisons: a comparison diverges when its outcome is ``mismatch`` or
``error``. With k divergent comparisons out of n, the one-sided 95% Clopper-Pearson bounds of the
divergence rate are ``beta.ppf(0.05, k, n - k + 1)`` (lower) and ``beta.ppf(0.95, k + 1, n - k)``
(upper). Calls inside one training step are correlated, so these bounds are optimistic when many
comparisons share a step.

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
    "compiling": "called inside torch.compile; compare compiled code with a suite A/B run",
    "inplace": "legacy wrote a tensor argument in place; such calls cannot be re-run from their start",
}
DEFAULT_MAX_RATE = 0.001  # the divergence rate a rollout tolerates; the alert rules' budget too


def upper_bound(k: int, n: int, confidence: float = CONFIDENCE) -> float:
    """One-sided Clopper-Pearson upper bound of a rate with k events in n trials (1.0 when n == 0)."""
    return 1.0 if k >= n else float(beta.ppf(confidence, k + 1, n - k))


def lower_bound(k: int, n: int, confidence: float = CONFIDENCE) -> float:
    """One-sided Clopper-Pearson lower bound (0.0 when k == 0)."""
    return 0.0 if k == 0 else float(beta.ppf(1 - confidence, k, n - k + 1))


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

    def add_outcome(self, signature: str, outcome: str, count: float) -> None:
        key = (signature, outcome)
        self.outcomes[key] = self.outcomes.get(key, 0) + count

    def add_reason(self, reason: str, count: float) -> None:
        self.reasons[reason] = self.reasons.get(reason, 0) + count

    def add_shared(self, reason: str, count: float) -> None:
        self.shared[reason] = self.shared.get(reason, 0) + count

    def add_skip(self, reason: str, count: float) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + count

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
    lower, upper = lower_bound(k, n), upper_bound(k, n)
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
    }
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
        more = comparisons_needed(max_rate, k) - n
        missing.append(
            f"upper bound {upper:.3g} >= max rate {max_rate:g}: about {more} more comparisons without divergence"
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


def decide_all(
    counts: Mapping[str, TargetCounts],
    max_rate: float,
    risky: Mapping[str, Iterable[str]],
    min_per_signature: int,
) -> list[Decision]:
    return [decide(t, c, max_rate, risky.get(t, ()), min_per_signature) for t, c in sorted(counts.items())]
