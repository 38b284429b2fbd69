"""Turning counts into a decision: promote, rollback or inconclusive, per target.

Divergence counts whole comparisons: a comparison diverges when its outcome is ``mismatch`` or ``error``. The
bounds are those of :mod:`shadow.analysis.bounds`: anytime-valid (a verdict re-read as evidence grows stays
valid), jointly over signatures weighted by their share of calls, with calls never compared counted as
non-response (their whole share added to the upper bound). Each target's evidence is judged:

- **by phase.** Calls whose result came from legacy (shadowing) and from upstream (a canary) are two bodies of
  evidence, never pooled: each phase is decided on its own and the target gets the worst decision of its phases.
  A rollback (the switch thrown in a running job) that no person has reset since is a rollback decision: promote
  needs a person's reset and fresh evidence after it (evidence from before a reset is set aside, and said so).
- **in clusters.** Comparisons of one process share its steps, batches and state: they are not independent trials.
  Where the source knows each comparison's process (journals), the process, cut into time blocks counted from its
  own start (``--cluster-window``; a run of blocks with divergences is one incident and never cut), is the unit:
  the counts are scaled to ``C`` effective comparisons, C the number of clusters, as if everything inside a
  cluster were one trial. This is conservative, and monotone: adding a divergence never narrows the bounds.

Decisions:

- rollback: any hard mismatch (a difference in kind: dtype, shape, NaN/inf, structure, device, requires_grad,
  the torch state left behind, an exception), the lower bound above ``max_rate``, or a rollback not reset;
- promote: no hard mismatch, the upper bound below ``max_rate`` in every phase, every risky signature of the
  target that the jobs called compared ``min_per_signature`` times (one they never called, where calls are counted
  by signature, is listed as not exercised: the promotion covers the paths the jobs take), and no sampled call
  skipped for a reason that keeps the evidence
  from a kind of call (user hooks or modes, compiled code, in-place legacy: ``UNCOVERED_REASONS``);
- inconclusive otherwise, saying what more is needed.

**Recent evidence and runs apart.** The whole pooled history is not the only witness: the last hour
(:data:`~shadow.analysis.decisions.RECENT_SECONDS`, ``--recent``) and, where several runs are pooled
(``--all-runs``), each run are *slices* of the evidence, each decided on its own. Both the whole and every slice
must allow promote (the worst decides): a slice that rolls back rolls the target back; one whose divergence rate is
above the max rate, however little evidence it holds, holds promote as inconclusive. A slice never promotes on its
own (an hour rarely holds the evidence to), so a clean history is not outvoted by a quiet hour, and ten clean hours
do not hide a diverging one."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from typing import Any

from shadow.analysis import bounds, eta, noise_verdict, strata
from shadow.analysis.bounds import Prior, Stratum
from shadow.analysis.decisions import (
    DEFAULT_MIN_PER_SIGNATURE,
    INCONCLUSIVE,
    PROMOTE,
    ROLLBACK,
    SEVERITY,
    Decision,
    PhaseDecision,
    SliceDecision,
    truth_summaries,
)
from shadow.analysis.evidence import PhaseCounts, TargetCounts
from shadow.analysis.sooner import sooner
from shadow.core.calls.record import clusters
from shadow.core.model import contract
from shadow.core.model.observation import (
    CUSTOM_MEANING,
    HARD_REASONS,
    PRIMARY_SIDES,
    UNCOVERED_REASONS,
)

CONFIDENCE = 1 - bounds.ALPHA

#: What to do about each kind of call the evidence does not reach (the verdict's "why").
_UNCOVERED_WHY = {
    "hooks": "user module hooks; declare them free of side effects with --pure-hooks to compare such calls",
    "mode": "a user's TorchFunctionMode/TorchDispatchMode or tensor subclass was in the call",
    "compiling": "called inside torch.compile; compare compiled code with a suite A/B run (npu-shadow ab)",
    "inplace": "legacy wrote a tensor argument in place; such calls cannot be re-run from their start",
    "ineligible": "the call cannot be run twice as the same call (a stream that cannot seek back; a forward that reads "
    "its own graph, the first time its signature is met)",
}
#: The recent windows decided, as fractions of ``--recent`` (an hour: its last hour, 15 and 5 minutes). A burst of
#: a few minutes is diluted in an hour (ten minutes at 5x the max rate are 0.83x of it over the hour); each window
#: sees the bursts of about its own length.
RECENT_FRACTIONS = (1.0, 1 / 4, 1 / 12)
#: Hourly looks in a week: the slices' rollback bound holds over a week of looks (:data:`SLICE_ALPHA`).
LOOKS_A_WEEK = 7 * 24
#: The level of a recent window's rollback: ALPHA over the distinct windows a week holds (168 hours, 672 quarter
#: hours, 2,016 five-minute windows: 2,856), a union bound (Bonferroni) over every window a reader could look at
#: in a week however often, so that an honest job at the max rate is rolled back by a window at most ALPHA of the
#: weeks. A window holds promote back on its rate alone, which needs no level.
SLICE_ALPHA = bounds.ALPHA / (LOOKS_A_WEEK * sum(1 / f for f in RECENT_FRACTIONS))
#: The burn-rate alerts fire at these multiples of the max rate (the rules and the report's chart share them).
BURN_RATE_FACTORS = {"fast burn": 14.4, "slow burn": 6.0, "sustained burn": 3.0}


def comparisons_needed(max_rate: float, k: float = 0) -> float:
    """The least effective number of comparisons whose anytime-valid upper bound with k divergences is below
    max_rate (about 4.5 / max_rate for k = 0)."""
    return bounds.effective_needed(max_rate, k, Prior.for_max_rate(max_rate))


def wilson_upper(k: float, n: float, z: float = 1.6448536269514722) -> float:
    """One-sided 95% Wilson score upper bound at a single look: what the dashboard draws for display (cheap in
    PromQL); never what a decision rests on."""
    if n == 0:
        return 1.0
    p = k / n
    return (p + z * z / (2 * n) + z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))) / (1 + z * z / n)


def _when(more: float, seen: float, process_seconds: float, units: str) -> str:
    """How much more running ``more`` units take at the evidence rate seen (``seen`` units in ``process_seconds``
    of process time): "" where the source does not say how long its evidence took. A cluster is at least a minute
    of one process's time (:data:`~shadow.core.calls.record.clusters.WINDOW_SECONDS`), so clusters come at most 60
    per process-hour, however short the processes: a process of 24 seconds with one cluster is no rate of 150."""
    if not (math.isfinite(more) and more > 0 and seen > 0 and process_seconds > 0):
        return ""
    if units == "clusters":
        process_seconds = max(process_seconds, seen * clusters.WINDOW_SECONDS)
    per_hour = seen / (process_seconds / 3600)
    hours = more / per_hour
    jobs = more / seen
    return (
        f" (at this evidence's rate, {per_hour:,.3g} {units} per process-hour: about {hours:,.3g} more process-hours, "
        f"or {jobs:,.3g} more runs like these)"
    )


#: A signature whose own rate is surely above this diverges systematically (on most of its calls, not by chance).
SYSTEMATIC_RATE = 0.5


def _diverging_stratum(own: Mapping[str, tuple[float, float]], max_rate: float, level: float = bounds.ALPHA) -> str:
    """Why one signature's own evidence rolls the phase back, or "": its own anytime-valid lower bound, at
    ``ALPHA / m`` for m signatures compared (a union bound: every signature is looked at), above
    :data:`SYSTEMATIC_RATE` (and the max rate). A path where upstream diverges on most calls is a rollback of its
    own, however small its share of the calls: decided here rather than left to widen the joint bound of every
    other signature. A few divergences in a rare signature are left to the joint bound (they are evidence about
    the rate of the calls, which the max rate is about)."""
    compared = {s: kn for s, kn in own.items() if s and kn[1] > 0}
    if len(compared) < 2:
        return ""  # (one stratum: the phase's own lower bound is this one's)
    alpha = level / len(compared)
    found = [(bounds.lower_bound(k, n, alpha), s, k, n) for s, (k, n) in compared.items()]
    low, signature, k, n = max(found)
    if low <= max(max_rate, SYSTEMATIC_RATE):
        return ""
    return (
        f"signature {signature} diverges on its own, on most of its calls: its rate is at least {low:.3g} (95% lower "
        f"bound over {len(compared)} signatures, {k:.3g}/{n:.3g} effective), whatever its share of calls"
    )


def decide_phase(
    primary: str,
    phase: PhaseCounts,
    max_rate: float,
    process_seconds: float = 0.0,
    alpha: float = bounds.ALPHA,
    target: str = "",
    evidence: str = "forward",
    most_clusters: float = math.inf,
    explain: bool = True,
) -> PhaseDecision:
    """The decision on one phase of ``target``'s evidence (its hard mismatches and coverage: :func:`decide`); ``alpha``:
    its lower bound's level; ``evidence``: which runs judged against noise thresholds are its own (forward, gradients):
    where any were, it is on the rate beyond the noise (:mod:`shadow.analysis.noise_verdict`); ``most_clusters``: the
    most its processes' time allows; ``explain=False``: the same decision, its reason without the ETA."""
    n, k = phase.compared, phase.divergent
    clustered, cluster_count = _clusters_of(phase, most_clusters)
    lower_strata, upper_strata, uncovered, weighted, own = strata.of(phase, cluster_count if clustered else None)
    prior = Prior.for_max_rate(max_rate)
    lower, upper = bounds.lower(lower_strata, alpha), bounds.upper(upper_strata, prior)
    covered = sum(s.weight for s in lower_strata if s.n > 0)
    rate = sum(s.weight * s.k / s.n for s in lower_strata if s.n > 0) / covered if covered else 0.0
    effective = sum(s.n for s in lower_strata)
    share = sum(uncovered.values())
    common = {
        "primary": primary,
        "compared": round(n),
        "divergent": round(k),
        "lower": lower,
        "upper": upper,
        "rate": rate,
        "effective": effective,
        "weighted": weighted,
        "clusters": round(cluster_count) if clustered else 0,
        "call_blocks": round(phase.call_blocks, 6),
        "uncovered_share": share,
        "uncovered_by": uncovered,
    }
    if n == 0:
        return PhaseDecision(decision=INCONCLUSIVE, why=f"{primary} phase: no call compared", **common)
    noisy = noise_verdict.NoiseEvidence.of(phase.noise, evidence)
    if noisy is not None:
        return _decide_under_noise(primary, noisy, (lower_strata, upper_strata), own, max_rate, alpha, prior, common)
    diverging = _diverging_stratum(own, max_rate, alpha)
    if diverging and lower <= max_rate:
        return PhaseDecision(decision=ROLLBACK, why=diverging, **common)
    if lower > max_rate:
        why = f"divergence rate is at least {lower:.3g} (95% lower bound, {k:.0f}/{n:.0f}) > max rate {max_rate:g}"
        return PhaseDecision(decision=ROLLBACK, why=why, **common)
    if upper < max_rate:
        why = f"divergence rate below {upper:.3g} (95% upper bound, {k:.0f}/{n:.0f}) < max rate {max_rate:g}"
        return PhaseDecision(decision=PROMOTE, why=why, **common)
    units = "clusters" if clustered else "effective comparisons"
    found = (lower, upper)
    missing = _promote_needs(found, max_rate, share, uncovered, rate, effective, units, prior, process_seconds, explain)
    faster = ""
    if clustered and share < max_rate and rate < max_rate - share:
        more, calls = bounds.needed_at_rate(max_rate - share, rate, prior) - effective, sum(phase.calls.values())
        faster = sooner(target or "this target", more, cluster_count, calls, process_seconds, phase.call_blocks)
    return PhaseDecision(decision=INCONCLUSIVE, why=f"{primary} phase: {missing}", sooner=faster, **common)


def _clusters_of(phase: PhaseCounts, most_clusters: float) -> tuple[bool, float]:
    """(whether the phase's comparisons are known in clusters, how many): counted where they happened (every
    source), else a journal's blocks formed from its count records' times."""
    counted = phase.compared + sum(phase.unmatched.values())
    if phase.cluster_count > 0 and not phase.clusters_missing:
        # (a distributed job's ranks count 1 / WORLD_SIZE of a cluster each: a fraction, rounded only against the
        # float sum's noise; never more clusters than comparisons, nor than the processes' time holds blocks)
        return True, round(min(phase.cluster_count, counted, most_clusters), 6)
    clusters = [c for c in phase.clusters.values() if c[0] > 0]
    return bool(clusters) and round(sum(c[0] for c in clusters)) == round(counted), len(clusters)


def _decide_under_noise(
    primary: str,
    noisy: noise_verdict.NoiseEvidence,
    strata: tuple[list[Stratum], list[Stratum]],
    own: Mapping[str, tuple[float, float]],
    max_rate: float,
    alpha: float,
    prior: Prior,
    common: dict[str, Any],
) -> PhaseDecision:
    """The decision on a phase whose runs were judged against noise thresholds: on the divergence rate beyond legacy's
    own A/A rate, at every look (:mod:`shadow.analysis.noise_verdict`); promote only where the detection limit is
    below the max rate too."""
    n = common["compared"]
    scale = min(1.0, common["effective"] / n if n else 1.0)
    found = noise_verdict.excess_bounds(*strata, prior, noisy, n, scale, common["rate"], alpha)
    # (two ways to roll back, each at half the level: beyond the thresholds, and a shift inside them)
    beyond_lower = noise_verdict.excess_bounds(*strata, prior, noisy, n, scale, common["rate"], alpha / 2).lower
    moved = noise_verdict.shift_lower(noisy, scale, alpha / 2)
    common = {
        **common, "lower": beyond_lower, "upper": found.upper, "rate": found.rate, "detection_limit": found.width,
        "size_limit": noise_verdict.SIZE_LIMIT, "aa_judged": round(noisy.aa_judged),
        "aa_beyond": round(noisy.aa_beyond),
    }  # fmt: skip
    seen = noise_verdict.describe(found, noisy)
    diverging = _diverging_stratum(own, max_rate, alpha)
    if diverging and beyond_lower <= max_rate:
        return PhaseDecision(decision=ROLLBACK, why=f"{diverging}; {seen}", **common)
    if beyond_lower > max_rate:
        why = f"{primary} phase: the divergence rate beyond the noise is at least {beyond_lower:.3g} > max rate "
        return PhaseDecision(decision=ROLLBACK, why=f"{why}{max_rate:g}: {seen}", **common)
    if moved > max_rate:
        return PhaseDecision(decision=ROLLBACK, why=f"{primary} phase: {noise_verdict.shifted(noisy, moved)}", **common)
    factor = noise_verdict.aa_factor(noisy, found.share, scale, prior, max_rate)
    if found.width >= max_rate:
        why = f"{primary} phase: {noise_verdict.hidden(found, noisy, max_rate, factor)}; {seen}"
        lever = f"sooner: --aa-rate x{factor:g} (more A/A runs narrow the detection limit)"
        lever = lever if math.isfinite(factor) else ""
        return PhaseDecision(decision=INCONCLUSIVE, why=why, sooner=lever, **common)
    if found.upper < max_rate:
        why = f"{primary} phase: {seen} < max rate {max_rate:g}; {noise_verdict.SIZE_LIMIT}"
        return PhaseDecision(decision=PROMOTE, why=why, **common)
    why = f"{primary} phase: upper bound {found.upper:.3g} >= max rate {max_rate:g}: more comparisons needed; {seen}"
    return PhaseDecision(decision=INCONCLUSIVE, why=why, **common)


def _promote_needs(
    found: tuple[float, float],
    max_rate: float,
    share: float,
    uncovered: Mapping[str, float],
    rate: float,
    effective: float,
    units: str,
    prior: Prior,
    process_seconds: float,
    explain: bool = True,
) -> str:
    """What an inconclusive phase needs to promote (its bounds ``found``): the calls never compared that no
    comparison can make up for, a rate surely not below the max rate (its lower bound reaches it), or how much more
    running takes: at the rate seen, and its median and 90% range over the futures the evidence allows
    (:mod:`shadow.analysis.eta`)."""
    lower, upper = found
    if share >= max_rate:
        kinds = ", ".join(f"{reason} {value:.3g}" for reason, value in sorted(uncovered.items()))
        return (
            f"{share:.3g} of the calls are of a kind never compared ({kinds}): no number of comparisons of the "
            "others can bound the rate below max rate"
        )
    if lower >= max_rate - share:
        return (
            f"upper bound {upper:.3g} >= max rate {max_rate:g}, and the rate is at least {lower:.3g} (95% lower "
            f"bound){f', with the uncovered share {share:.3g},' if share else ''} not below it: running on cannot "
            "promote"
        )
    # (running on brings divergences at the rate seen: the bound is reached where it falls below max rate with
    # them, not with today's divergences alone)
    needed = bounds.needed_at_rate(max_rate - share, rate, prior)
    seen = f"at the rate seen ({rate:.3g}, its divergences included)" if rate else "without divergence"
    if math.isinf(needed) and rate >= max_rate - share:
        point = f"at the rate seen ({rate:.3g}) running on never promotes, though the rate may be below it"
    else:
        more = "more than any job makes:" if math.isinf(needed) else f"about {max(1, math.ceil(needed - effective)):,}"
        point = f"{more} more {units} {seen}{_when(needed - effective, effective, process_seconds, units)}"
    if not explain:
        return f"upper bound {upper:.3g} >= max rate {max_rate:g}: {point}"
    predicted = eta.predict(rate * effective, effective, max_rate - share, prior)
    ahead = _eta_text(predicted, effective, process_seconds, units)
    return f"upper bound {upper:.3g} >= max rate {max_rate:g}: {point}; {ahead}"


def _eta_text(predicted: eta.Eta, seen: float, process_seconds: float, units: str) -> str:
    """The predicted ETA as words: median and 90% range (:mod:`shadow.analysis.eta`), in ``units`` and in
    process-hours where the source says how long its evidence took."""
    per_hour = _hours(seen, process_seconds, units)

    def amount(value: float) -> str:
        if math.isinf(value):
            return "never"
        hours = f" ({value / per_hour:,.3g} process-hours)" if per_hour else ""
        return f"{max(1, math.ceil(value)):,}{hours}"

    never = f"; {predicted.never:.0%} of them never promote" if predicted.never >= 0.005 else ""
    if math.isinf(predicted.median):
        return (
            f"predicted from the evidence so far: most futures it allows never promote ({predicted.never:.0%}); "
            f"90% of them need at least {amount(predicted.low)} more {units}"
        )
    return (
        f"predicted from the evidence so far: {amount(predicted.median)} more {units}, the median of the futures "
        f"it allows (90% of them: {amount(predicted.low)} to {amount(predicted.high)}{never})"
    )


def _hours(seen: float, process_seconds: float, units: str) -> float | None:
    """The evidence's ``units`` per process-hour (clusters come at most 60 an hour); None where not known."""
    if not (seen > 0 and process_seconds > 0):
        return None
    if units == "clusters":
        process_seconds = max(process_seconds, seen * clusters.WINDOW_SECONDS)
    return seen / (process_seconds / 3600)


#: The suffix of a phase's gradient evidence in the phases decided (``legacy gradients``).
GRADIENTS = "gradients"


def forward_evidence(phase: PhaseCounts) -> PhaseCounts:
    """The phase's forward evidence: a call whose gradients differed had a forward that agreed (a backward
    comparison runs only after a forward that did not diverge), so its mismatch (reason grad) is the gradients'
    evidence (:func:`gradient_evidence`), not the forward's: counted here as a compared call that agreed."""
    if not phase.backward and not phase.backward_unmatched:
        return phase
    outcomes = dict(phase.outcomes)
    for (signature, found), value in phase.backward.items():
        if found == "mismatch" and value > 0:
            moved = min(value, outcomes.get((signature, "mismatch"), 0))
            outcomes[(signature, "mismatch")] = outcomes.get((signature, "mismatch"), 0) - moved
            outcomes[(signature, "match")] = outcomes.get((signature, "match"), 0) + moved
    unmatched = {s: max(0.0, v - phase.backward_unmatched.get(s, 0)) for s, v in phase.unmatched.items()}
    return dataclasses.replace(phase, series={**phase.series, contract.COMPARISONS: outcomes}, unmatched=unmatched)


#: The backward skips that are not the gradient evidence's non-response: "no_grad" (no gradient to compare) and
#: "diverged" (the forward is the finding). Every other one is a gradient the job has that no comparison reached.
NO_GRADIENT_SKIPS = ("no_grad", "diverged")


def gradient_evidence(phase: PhaseCounts) -> PhaseCounts:
    """The phase's gradient evidence, rated over the calls that had a backward comparison (one stratum: backward
    runs are drawn among compared calls at the backward rate), those whose comparison was not made non-response
    (all but :data:`NO_GRADIENT_SKIPS`), its clusters the phase's (a gradient comparison falls in one of the
    clusters its forward did)."""
    found: dict[tuple[str, str], float] = {}
    for (_, outcome), value in phase.backward.items():
        found[("", outcome)] = found.get(("", outcome), 0) + value
    unmatched = sum(phase.backward_unmatched.values())
    series = {
        contract.COMPARISONS: found,
        contract.CLUSTERS: phase.of(contract.CLUSTERS),
        contract.NOISE_CHECKS: {key: value for key, value in phase.noise.items() if key[0] == GRADIENTS},
    }
    if found:  # (calls whose gradients no comparison reached: non-response; none made, no gradient evidence at all)
        skips = phase.of(contract.BACKWARD_SKIPS).items()
        series[contract.SKIPPED] = {("", r): value for r, value in skips if r not in NO_GRADIENT_SKIPS}
    unmatched_by = {"": unmatched} if unmatched else {}
    return PhaseCounts(series=series, unmatched=unmatched_by, clusters_missing=phase.clusters_missing)


def _decide_phases(
    counts: TargetCounts, max_rate: float, alpha: float = bounds.ALPHA, target: str = "", explain: bool = True
) -> list[PhaseDecision]:
    """Each phase of ``target``'s forward evidence and gradient evidence, decided (legacy's first; ``explain``: see
    :func:`decide_phase`)."""
    order = {side: i for i, side in enumerate(PRIMARY_SIDES)}
    phases: list[PhaseDecision] = []
    most = counts.blocks_allowed()
    for primary, phase in sorted(counts.phases.items(), key=lambda kv: order.get(kv[0], len(order))):
        if phase.cluster_count > min(most, phase.compared + sum(phase.unmatched.values())) + 1e-6:
            note = (
                f"{primary} phase: {phase.cluster_count:,.6g} clusters counted, more than its comparisons or the 60 s "
                f"blocks its processes' {counts.process_seconds:,.0f} s allow: taken as that many"
            )
            if note not in counts.notes:
                counts.notes.append(note)
        if not phase.empty():
            forward = forward_evidence(phase)
            phases.append(decide_phase(primary, forward, max_rate, counts.process_seconds, alpha, target,
                                       most_clusters=most, explain=explain))  # fmt: skip
        gradients = gradient_evidence(phase)
        if not gradients.empty():
            name = f"{primary} {GRADIENTS}"
            phases.append(decide_phase(name, gradients, max_rate, counts.process_seconds, alpha, evidence=GRADIENTS,
                                       most_clusters=most, explain=explain))  # fmt: skip
    return phases


def recent_windows(seconds: float) -> list[float]:
    """The recent windows decided for ``--recent`` seconds (:data:`RECENT_FRACTIONS`); none for 0."""
    return [seconds * fraction for fraction in RECENT_FRACTIONS] if seconds > 0 else []


def recent_slice(seconds: float) -> str:
    """The name of the recent window's slice: ``the last 1h``."""
    return f"{_RECENT_PREFIX}{_duration(seconds)}"


def _duration(seconds: float) -> str:
    """``1h5m``, ``30s``."""
    hours, rest = divmod(round(seconds), 3600)
    minutes, secs = divmod(rest, 60)
    return "".join(f"{v}{u}" for v, u in ((hours, "h"), (minutes, "m"), (secs, "s")) if v) or "0s"


_RECENT_PREFIX = "the last "


def _slice_alpha(name: str) -> float:
    """The level a slice rolls back at: a recent window's :data:`SLICE_ALPHA`, a run's ``ALPHA`` (runs are few)."""
    return SLICE_ALPHA if name.startswith(_RECENT_PREFIX) else bounds.ALPHA


def run_slice(run: str) -> str:
    """The name of one run's slice, where several are pooled."""
    return f"run {run or '(no id)'}"


def decide_slice(name: str, counts: TargetCounts, max_rate: float) -> SliceDecision:
    """One slice of a target's evidence decided on its own: rollback where a phase's lower bound is above the max
    rate (at the slice's level: :func:`_slice_alpha`), inconclusive where a phase's rate is (promote is held back),
    promote (allows it) otherwise."""
    # (a slice's reason is its rate, or a rollback's: no inconclusive phase's ETA is said of it)
    phases = _decide_phases(counts, max_rate, _slice_alpha(name), explain=False)
    worst = max(phases, key=lambda p: (SEVERITY[p.decision], p.rate), default=None)
    if worst is None:
        return SliceDecision(name, PROMOTE, 0, 0, 0.0, 0.0, 1.0, f"{name}: no comparison (allows promote)")
    numbers = {
        "compared": round(sum(p.compared for p in phases)),
        "divergent": round(sum(p.divergent for p in phases)),
        "rate": worst.rate,
        "lower": worst.lower,
        "upper": worst.upper,
    }
    if worst.decision == ROLLBACK:
        return SliceDecision(name, ROLLBACK, why=f"{name}, {worst.primary} phase: {worst.why}", **numbers)
    above = [p for p in phases if p.rate > max_rate]
    if above:
        p = max(above, key=lambda p: p.rate)
        why = (
            f"{name}, {p.primary} phase: divergence rate {p.rate:.3g} ({p.divergent}/{p.compared}) is above max rate "
            f"{max_rate:g}: promote waits until it is not"
        )
        return SliceDecision(name, INCONCLUSIVE, why=why, **numbers)
    return SliceDecision(name, PROMOTE, why=f"{name}: rate {worst.rate:.3g} allows promote", **numbers)


def decide(
    target: str,
    counts: TargetCounts,
    max_rate: float,
    risky: Iterable[str] = (),
    min_per_signature: int = DEFAULT_MIN_PER_SIGNATURE,
    slices: Mapping[str, TargetCounts] | None = None,
    explain: bool = True,
) -> Decision:
    """The decision for one target (see the module docstring): on its whole evidence, then held back or rolled back
    by any of ``slices`` (name -> that slice's counts) that does not allow promote. ``explain=False``: without the
    predicted ETA in an inconclusive phase's reason (:func:`decide_phase`); the decision is the same."""
    whole = _decide_whole(target, counts, max_rate, risky, min_per_signature, explain)
    decided = tuple(decide_slice(name, each, max_rate) for name, each in (slices or {}).items() if not each.empty())
    if not decided:
        return whole
    whole = dataclasses.replace(whole, slices=decided)
    worst = max(decided, key=lambda s: SEVERITY[s.decision])
    if SEVERITY[worst.decision] <= SEVERITY[whole.decision]:
        return whole
    return dataclasses.replace(whole, decision=worst.decision, why=f"{worst.why}; the whole history: {whole.why}")


def _reasons_of(counts: TargetCounts) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
    """(hard mismatches, shared divergences, sampled calls never compared) of every phase, by reason."""
    hard: dict[str, int] = {}
    shared: dict[str, int] = {}
    uncovered: dict[str, int] = {}
    for phase in counts.phases.values():
        for reason, value in phase.reasons.items():
            if reason in HARD_REASONS and value > 0:
                hard[reason] = hard.get(reason, 0) + round(value)
        for reason, value in phase.shared.items():
            if value > 0:
                shared[reason] = shared.get(reason, 0) + round(value)
        for reason, value in phase.skipped_by_reason().items():
            if reason in UNCOVERED_REASONS and value > 0:
                uncovered[reason] = uncovered.get(reason, 0) + round(value)
    return hard, shared, uncovered


def _risky_coverage(counts: TargetCounts, risky: list[str], not_exercised: tuple[str, ...]) -> dict[str, int]:
    """Comparisons of each risky signature taken, each on its own (another one matching the same pattern covers
    none of its calls); by pattern where calls are not counted by signature (which were taken is not known)."""
    coverage: dict[str, int] = {}
    for pattern in risky:
        if pattern in not_exercised:
            continue
        taken = counts.taken_matching(pattern)
        if taken and any(s for p in counts.phases.values() for s in p.calls):
            coverage.update({signature: counts.compared_of(signature) for signature in taken})
        else:
            coverage[pattern] = counts.compared_matching(pattern)
    return coverage


def _worst_fields(worst: PhaseDecision | None) -> dict[str, Any]:
    """The Decision's bounds and rates: its worst phase's (none decided: no evidence, the widest bounds)."""
    if worst is None:
        return {"lower": 0.0, "upper": 1.0, "rate": 0.0, "effective": 0.0, "weighted": False, "clusters": 0,
                "uncovered_share": 0.0}  # fmt: skip
    names = ("lower", "upper", "rate", "effective", "weighted", "clusters", "uncovered_share")
    return {name: getattr(worst, name) for name in names}


def _decide_whole(
    target: str, counts: TargetCounts, max_rate: float, risky: Iterable[str], min_per_signature: int, explain: bool
) -> Decision:
    phases = _decide_phases(counts, max_rate, target=target, explain=explain)
    hard, shared, uncovered = _reasons_of(counts)
    risky = list(risky)
    not_exercised = tuple(p for p in risky if counts.never_called(p))
    coverage = _risky_coverage(counts, risky, not_exercised)
    worst = max(phases, key=lambda p: (SEVERITY[p.decision], p.upper), default=None)
    made = {
        "target": target, "compared": counts.compared, "divergent": counts.divergent, "hard": hard,
        "risky": coverage, "not_exercised": not_exercised, "shared": shared, "uncovered": uncovered,
        "clustering": counts.clustering, "phases": tuple(phases), "rollbacks": tuple(counts.rollbacks),
        "resets": tuple(counts.resets), "set_aside": round(counts.set_aside), "notes": tuple(counts.notes),
        "drilled": round(counts.drilled), "drill_set_aside": round(counts.drill_set_aside),
        "truth": truth_summaries(counts), **_worst_fields(worst),
        "detection_limit": max((p.detection_limit for p in phases), default=0.0),
        "size_limit": next((p.size_limit for p in phases if p.size_limit), ""),
    }  # fmt: skip
    if counts.compared == 0 and worst is None:
        needed = comparisons_needed(max_rate)
        about = f"about {needed:,.0f}" if math.isfinite(needed) else "more than any job makes:"
        why = f"not exercised: no call of this target was compared ({about} comparisons without divergence)"
        return Decision(decision=INCONCLUSIVE, why=why, **made)
    if hard:
        kinds = ", ".join(f"{count} {reason}" for reason, count in sorted(hard.items()))
        if counts.drilled:  # (a drill's injected difference is no cause: the meaning of a real one would mislead)
            into = f" into {round(counts.drilled):,} comparisons" if counts.drilled > 0 else ""
            why = f"hard mismatches: {kinds}, while a fire drill injected divergence{into} (a rehearsal, not a cause)"
            return Decision(decision=ROLLBACK, why=why, **made)
        meaning = CUSTOM_MEANING.get(target, "") if "custom" in hard else ""
        return Decision(decision=ROLLBACK, why=f"hard mismatches: {kinds}{f' ({meaning})' if meaning else ''}", **made)
    if counts.rollbacks:
        return Decision(
            decision=ROLLBACK,
            why=f"rolled back in a running job ({'; '.join(counts.rollbacks[:3])}) and not reset since: promote "
            "needs a person's reset (Monitor.reset_primary) and fresh evidence after it",
            **made,
        )
    assert worst is not None
    if worst.decision == ROLLBACK:
        return Decision(decision=ROLLBACK, why=f"{worst.primary} phase: {worst.why}", **made)
    missing = [p.why for p in phases if p.decision == INCONCLUSIVE]
    for pattern, seen in coverage.items():
        if seen < min_per_signature:
            missing.append(f"risky signature {pattern} compared {seen} times, needs {min_per_signature}")
    for reason, count in sorted(uncovered.items()):
        missing.append(f"{count} sampled calls not compared ({reason}: {_UNCOVERED_WHY[reason]})")
    missing += _one_moment_unseen(counts)
    if missing:
        return Decision(decision=INCONCLUSIVE, why="; ".join(missing), **made)
    return Decision(decision=PROMOTE, why="; ".join(f"{p.primary} phase: {p.why}" for p in phases), **made)


def _one_moment_unseen(counts: TargetCounts) -> list[str]:
    """What one moment of a run's metrics (a metrics file) cannot see: a restart's earlier processes, counted by the
    launcher (``restarted``) or seen in the processes' start after their run's (``unseen_before``)."""
    if counts.restarted:
        return [
            f"the job was restarted ({counts.restarted} restarts): one moment of its metrics holds only what its "
            "processes counted since, and a rollback before the restart is not in it; decide over Prometheus (which "
            "keeps the run's history) or the journals"
        ]
    if counts.unseen_before:
        return [
            f"the metrics' processes began {_duration(counts.unseen_before)} after their run did (a restart no "
            "launcher counted?): one moment of their metrics holds only what they counted since, and what the run "
            "counted before, a rollback included, is not in it; decide over Prometheus (which keeps the run's "
            "history) or the journals"
        ]
    return []


def decide_all(
    counts: Mapping[str, TargetCounts],
    max_rate: float,
    risky: Mapping[str, Iterable[str]],
    min_per_signature: int,
    slices: Mapping[str, Mapping[str, TargetCounts]] | None = None,
) -> list[Decision]:
    """Every target decided; ``slices``: slice name -> that slice's counts by target (see :func:`decide`)."""
    slices = slices or {}
    return [
        decide(
            t, c, max_rate, risky.get(t, ()), min_per_signature,
            {name: by_target[t] for name, by_target in slices.items() if t in by_target},
        )
        for t, c in sorted(counts.items())
    ]  # fmt: skip
