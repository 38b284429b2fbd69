"""What a verdict says: promote, rollback or inconclusive, and the frozen records of a decision (per target, per
phase, per slice) with the numbers behind it; the worst of several, and the lines that name a fire drill or an
idle canary. :mod:`shadow.analysis.verdict` makes them."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from shadow.analysis.evidence import TargetCounts
from shadow.core.model.observation import NEARER

PROMOTE, ROLLBACK, INCONCLUSIVE = "promote", "rollback", "inconclusive"
#: The command's exit code for each decision (2 is left to usage errors).
EXIT_CODES = {PROMOTE: 0, ROLLBACK: 1, INCONCLUSIVE: 3}
#: How bad each decision is: the worst of several decides.
SEVERITY = {PROMOTE: 0, INCONCLUSIVE: 1, ROLLBACK: 2}
DEFAULT_MAX_RATE = 0.001  # the divergence rate a rollout tolerates; the alert rules' budget too
DEFAULT_MIN_PER_SIGNATURE = 30  # comparisons each risky signature needs (--min-per-signature)
#: The recent window every verdict also decides on (``--recent``; the sustained-burn alert's long window too).
RECENT_SECONDS = 3600.0


@dataclasses.dataclass(frozen=True)
class PhaseDecision:
    """The decision on one phase of a target, with the numbers behind it."""

    primary: str
    decision: str
    compared: int
    divergent: int
    lower: float
    upper: float
    #: The divergence rate (signatures weighted by their share of calls) and the effective comparisons behind the
    #: bounds (after clustering: ``clusters`` when the source knows them).
    rate: float
    effective: float
    weighted: bool
    clusters: int
    #: The share of calls whose kind was never compared (non-response), and why, by skip reason ("never
    #: sampled" for signatures with calls and no comparison).
    uncovered_share: float
    uncovered_by: dict[str, float]
    why: str
    #: What would reach a decision sooner, for an inconclusive phase (:mod:`shadow.analysis.sooner`); "" otherwise.
    sooner: str = ""
    #: Under a device's noise (:mod:`shadow.analysis.noise_verdict`): the detection limit (the excess rate this
    #: evidence cannot tell from the noise; 0 where nothing was judged against noise thresholds), the size a wrong
    #: call must have to be seen, and legacy's own A/A exceedances (judged, beyond).
    detection_limit: float = 0.0
    size_limit: str = ""
    aa_judged: int = 0
    aa_beyond: int = 0
    #: The blocks of process time the phase's calls fell in (rank shares): the most clusters comparing every call
    #: could have made (0: not counted by the source).
    call_blocks: float = 0.0


@dataclasses.dataclass(frozen=True)
class SliceDecision:
    """One slice of a target's evidence (the last hour, one run), decided on its own: it can hold back or roll
    back the target, never promote it."""

    name: str
    decision: str
    compared: int
    divergent: int
    rate: float
    lower: float
    upper: float
    why: str


@dataclasses.dataclass(frozen=True)
class Decision:
    """The verdict on one target: the worst of its phases, with the numbers of the phase that decided."""

    target: str
    decision: str
    compared: int
    divergent: int
    lower: float
    upper: float
    hard: dict[str, int]
    why: str
    #: Each risky signature the jobs took (one matching a risky pattern, with calls, comparisons or skips) ->
    #: its comparisons; a pattern where calls are not counted by signature (which it took is not known).
    risky: dict[str, int] = dataclasses.field(default_factory=dict)
    #: Risky signature patterns no call of these jobs took (called never, compared never): the promotion covers
    #: the paths the jobs take, and says which it does not.
    not_exercised: tuple[str, ...] = ()
    #: Shared divergences by reason: legacy and upstream agree, both unlike a single-device run. Reported on
    #: their own line; they never change the decision (removing the patch changes nothing there).
    shared: dict[str, int] = dataclasses.field(default_factory=dict)
    #: Sampled calls the evidence does not reach, by skip reason (UNCOVERED_REASONS: a user's hooks or modes,
    #: compiled code): coverage still missing, whatever the bounds say.
    uncovered: dict[str, int] = dataclasses.field(default_factory=dict)
    rate: float = 0.0
    effective: float = 0.0
    weighted: bool = False
    clusters: int = 0
    clustering: str = ""
    uncovered_share: float = 0.0
    phases: tuple[PhaseDecision, ...] = ()
    rollbacks: tuple[str, ...] = ()
    resets: tuple[str, ...] = ()
    set_aside: int = 0
    notes: tuple[str, ...] = ()
    #: Comparisons a fire drill injected divergence into (-1: a drill was active, how many is not known); a
    #: verdict over a drill is a rehearsal of the alerting and rollback, not evidence about upstream.
    drilled: int = 0
    #: Comparisons of a fire drill that is over, set aside (see TargetCounts.drill_set_aside).
    drill_set_aside: int = 0
    #: Float64 truth runs of the value differences, by signature: which side was nearer the truth, and by how
    #: much. Shown beside the decision, never folded into it: a difference where upstream is nearer is no
    #: regression, one where it is further is.
    truth: tuple[TruthSummary, ...] = ()
    #: The slices decided besides the whole (the last hour, each run of several): each must allow promote.
    slices: tuple[SliceDecision, ...] = ()
    #: Under a device's noise: the greatest detection limit of its phases (the excess rate the evidence cannot tell
    #: from the noise; 0 where nothing was judged against noise thresholds), and the size a wrong call must have.
    detection_limit: float = 0.0
    size_limit: str = ""

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class TruthSummary:
    """The truth runs of one signature: how many found legacy, upstream or neither nearer the float64 truth, and
    the median decade of upstream's error over legacy's (-2: upstream's error a hundredth of legacy's; None where
    no run knew both errors)."""

    signature: str
    legacy: int
    upstream: int
    tie: int
    decade: int | None = None
    #: Runs where the two code paths differ in float64 too (the difference is the algorithm's: no truth to be near).
    differs: int = 0

    @property
    def runs(self) -> int:
        return self.legacy + self.upstream + self.tie + self.differs

    def describe(self) -> str:
        """One line: ``upstream nearer in 4 of 5 (its error ~10^-3 of legacy's), legacy in 1, tie 0``."""
        by_how_much = f" (upstream's error ~10^{self.decade} of legacy's, median)" if self.decade is not None else ""
        differs = (
            f"; the two code paths differ in float64 too in {self.differs} (the algorithm differs, not the rounding: "
            "no side is the truth)"
            if self.differs
            else ""
        )
        return (
            f"upstream nearer in {self.upstream} of {self.runs}, legacy nearer in {self.legacy}, tie {self.tie}"
            f"{by_how_much}{differs}"
        )


def truth_summaries(counts: TargetCounts) -> tuple[TruthSummary, ...]:
    """The truth runs of every signature of ``counts`` (all phases: a truth run asks about the two sides' code,
    whichever side's result the caller got)."""
    sides: dict[str, dict[str, float]] = {}
    decades: dict[str, dict[int, float]] = {}
    for phase in counts.phases.values():
        for (signature, nearer), value in phase.truth.items():
            by_side = sides.setdefault(signature, {})
            by_side[nearer] = by_side.get(nearer, 0) + value
        for (signature, decade), value in phase.truth_decades.items():
            by_decade = decades.setdefault(signature, {})
            by_decade[decade] = by_decade.get(decade, 0) + value
    found = []
    for signature in sorted(sides):
        by_side = {k: round(v) for k, v in sides[signature].items()}
        if not sum(by_side.values()):
            continue
        legacy, upstream, tie, differs = (by_side.get(side, 0) for side in NEARER)
        found.append(TruthSummary(signature, legacy, upstream, tie, _median(decades.get(signature, {})), differs))
    return tuple(found)


def _median(counts: dict[int, float]) -> int | None:
    """The median of values given with their counts (the lower one of an even count); None when empty."""
    total = sum(counts.values())
    if total <= 0:
        return None
    seen = 0.0
    for value in sorted(counts):
        seen += counts[value]
        if seen >= total / 2:
            return value
    return None


def overall(decisions: Iterable[Decision]) -> str:
    """The worst decision (rollback over inconclusive over promote); inconclusive when there is none."""
    decisions = list(decisions)
    if not decisions:
        return INCONCLUSIVE
    return max((d.decision for d in decisions), key=SEVERITY.__getitem__)


#: What the verdict and the report say of a canary A/B its sources hold nothing of.
IDLE_CANARY = (
    "not in these sources: it runs only in a canary (npu-shadow run --primary upstream), never while legacy's result "
    "is returned"
)


def idle_canaries(seen: Iterable[str]) -> list[str]:
    """The built-in canary A/B targets (the DataLoader's iterator, which cannot run twice) that are not in ``seen``:
    each is said, so that a verdict over a shadowing job never leaves it unmentioned."""
    from shadow.npu import catalog

    seen = set(seen)
    return [row.name for row in catalog.CATALOG if row.kind == catalog.CANARY and row.name not in seen]


def drill_note(decisions: Iterable[Decision]) -> str:
    """The line that names a fire drill in a verdict's output, or "" when none was active."""
    decisions = list(decisions)
    drilled = [d for d in decisions if d.drilled]
    if not drilled:
        over = [d for d in decisions if d.drill_set_aside]
        if over:
            return (
                f"a fire drill is over: its {sum(d.drill_set_aside for d in over):,} comparisons "
                f"({', '.join(d.target for d in over)}) were set aside by its marks, and the clean evidence after it "
                "decides"
            )
        return ""
    counted = sum(d.drilled for d in drilled if d.drilled > 0)
    how_many = f"{counted:,} comparisons carry" if counted else "the metrics show"
    return (
        f"FIRE DRILL: {how_many} synthetic divergence injected by a fire drill ({', '.join(d.target for d in drilled)})"
        ": this verdict rehearses the alerting and the rollback, it is not evidence about upstream"
    )
