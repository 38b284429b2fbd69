"""The result objects that flow from the engine to exporters: frozen, cheap to copy, easy to test."""

from __future__ import annotations

import dataclasses
import enum
import math
import re
import time
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from shadow.npu import catalog


class Outcome(str, enum.Enum):
    """Outcome of one sampled call. Observations, journals and metrics hold the values (plain strings)."""

    MATCH = "match"  # bitwise equal
    CLOSE = "close"  # within tolerance
    MISMATCH = "mismatch"  # outside it
    NOISE = "noise"  # outside it, but within what legacy itself varies by (its A/A runs): not a divergence
    ERROR = "error"  # exactly one side raised, or the two raised different exception types
    SKIPPED = "skipped"  # sampled but not compared

    def __str__(self) -> str:
        return self.value


OUTCOMES = tuple(o.value for o in Outcome)

#: Which side's result the caller gets: legacy while shadowing, upstream in a canary (until a rollback).
LEGACY, UPSTREAM = "legacy", "upstream"
PRIMARY_SIDES = (LEGACY, UPSTREAM)

#: Sampled calls are compared or skipped: a *compared* call really ran legacy and upstream and compared them.
COMPARED_OUTCOMES = tuple(o.value for o in Outcome if o is not Outcome.SKIPPED)

#: Compared calls where upstream is not what legacy is: the evidence against promotion.
DIVERGENT_OUTCOMES = (Outcome.MISMATCH.value, Outcome.ERROR.value)

#: Reasons a comparison did not match.
#: "stride" is a layout difference (strides or memory format): a mismatch for exact targets, since ``.view()``
#: works on one layout and raises on the other; tolerance targets note it in the detail.
#: "requires_grad": an output requires grad on one side only (it would or would not take part in backward);
#: "state": the torch settings each side left behind differ (the current device, the default dtype, ...);
#: "grad": forward outputs agree, but the gradients through the two sides' graphs do not (a backward comparison);
#: "custom": the target's own ``compare`` found a difference (results the comparator cannot read).
MISMATCH_REASONS = (
    "structure",
    "type",
    "dtype",
    "shape",
    "device",
    "stride",
    "alias",
    "requires_grad",
    "nan",
    "value",
    "exception",
    "state",
    "grad",
    "custom",
)

#: Reasons a sampled call was not compared.
#: "comparator" is a fault of this tool (counted, logged, never raised); "mode": a user's TorchFunctionMode or
#: TorchDispatchMode was active, or a tensor subclass with its own hooks was reached (an argument, a parameter or
#: buffer of a module in the call, or legacy's output): their code would see the shadow side, and upstream's
#: calls would come back through them; "hooks": a module in the call (or the global registry) has user forward,
#: pre-forward or backward hooks, whose effects the shadow side could not undo; "inplace": legacy wrote a tensor
#: argument in place (upstream could not start from what legacy started from: arguments are copied after legacy,
#: never at the cost of legacy's memory); "oom": the shadow side's copies would not fit in the memory free, or
#: upstream ran out of it; "budget": the shadow side had used its share of the job's wall time; "deadline": the
#: shadow side of a call took longer than its deadline (that call), or one did earlier (the target stopped shadowing);
#: "ineligible": the target says the call cannot be run twice (``Target.run_if``: a stream that cannot seek back).
SKIP_REASONS = (
    "oom",
    "compiling",
    "mode",
    "hooks",
    "inplace",
    "budget",
    "deadline",
    "comparator",
    "noise_pending",
    "ineligible",
)

#: Why a backward comparison planned for a compared call was not made: "deadline" (a run of it passed the
#: deadline), "reentrant" (reentrant activation checkpointing, which ``torch.autograd.grad`` refuses), "sparse"
#: (a sparse gradient: ``nn.Embedding(sparse=True)``), "raised" (a forward or both graphs' backward raised), "no_grad"
#: (grad mode off, or no output requires grad: nothing to pull back), "diverged" (the forward already diverged: it is
#: the finding), "failed" (this tool's fault, logged), "hooks" (a forward registered autograd hooks on its graph: the
#: job's code, which pulling products through the shadow side's graphs would run again), "memory" (its two graphs
#: would take more device memory than the shadow side may add, or its signature's graph was not measured yet:
#: shadow.core.calls.gate.graph_memory).
BACKWARD_SKIP_REASONS = (
    "deadline", "reentrant", "sparse", "raised", "no_grad", "diverged", "failed", "hooks", "memory",
)  # fmt: skip

#: A noise check (shadow.core.judging.noise): where a run stood against its signature's thresholds, which evidence
#: it is of, and which pair of runs it compares (legacy against upstream, legacy against itself).
CHECK_RESULTS = ("below", "within", "beyond")
CHECKED_EVIDENCE = ("forward", "gradients")
CHECKED_PAIRS = ("ab", "aa")

#: What a backward comparison found: the gradients agree, or they differ (the call's outcome is then a mismatch
#: with reason "grad", its forward having agreed: a backward comparison runs only after a forward that did not
#: diverge). The gradients are evidence of their own, rated over the calls that had one (shadow.analysis.verdict).
BACKWARD_OUTCOMES = ("match", "mismatch")

#: Where the two sides' own code paths, both run in float64, differ by more than float64 rounding: the difference is
#: in the algorithm, not in rounding, and neither side's float64 run is the truth (shadow.core.judging.truth).
DIFFERS_IN_FLOAT64 = "differs-in-float64"

#: Which side a float64 truth run found nearer the truth (shadow.core.judging.truth): the values of ``nearer``.
NEARER = ("legacy", "upstream", "tie", DIFFERS_IN_FLOAT64)

#: The built-in targets' names, those compared as a canary A/B (their calls cannot run twice: the DataLoader's
#: iterator starts its workers once; shadow.core.calls.canary.arms; the arms: legacy, upstream), and the patterns of
#: each one's risky signatures, where legacy and upstream are known to differ (a verdict must see them compared):
#: one row each in shadow.npu.catalog.
BUILTIN_TARGETS = tuple(row.name for row in catalog.rows(catalog.SHADOWED))
ARM_TARGETS = tuple(row.name for row in catalog.rows(catalog.CANARY))
BUILTIN_RISKY = {row.name: row.risky for row in catalog.rows(catalog.SHADOWED)}

#: What a built-in target's own comparison (reason "custom") finds, in a few words (the verdict says it; the
#: journal's and the report's detail say which way each call went).
CUSTOM_MEANING = {
    "foreach_devices": "deleting the patch changes whether the optimizers run their foreach (multi-tensor) kernels "
    "on this device type: the journal's detail says which way",
    "torch_save": "the two saves load back to different content: the journal's detail names the first place",
    "storage_cpu": "the host copies of the storage differ (size, device or bytes)",
    "storage_deepcopy": "the deep copies of the storage differ (dtype, size, device or bytes)",
}

#: The faults a fire drill can inject into the upstream result (shadow.core.calls.sampled.drill).
DRILL_KINDS = ("value", "dtype", "nan", "exception")

#: What each skip reason means, in a few words (the exit summary names every reason it counts).
SKIP_REASON_MEANING = {
    "oom": "the shadow side's copies would not fit in the memory free, or upstream ran out of it",
    "compiling": "the call ran inside torch.compile tracing",
    "mode": "a user's torch mode or tensor subclass would have seen the shadow side",
    "hooks": "a module in the call has user hooks the shadow side could not undo (--pure-hooks)",
    "inplace": "legacy wrote a tensor argument in place",
    "budget": "the shadow side had used its share of the job's wall time (--budget)",
    "deadline": "the shadow side of a call took longer than --deadline: that call, and every later one",
    "comparator": "a fault of npu-shadow's own on the shadow side (logged)",
    "noise_pending": "a value difference held until the noise floor had its A/A runs, which it never had",
    "ineligible": "the call cannot be run twice (a stream that cannot seek back, a forward that reads its own graph "
    "the first time its signature is met, ...)",
}

#: Skip reasons that say the evidence does not reach a kind of call at all (not a passing condition such as the
#: budget): the verdict shows them as coverage still missing.
UNCOVERED_REASONS = ("compiling", "mode", "hooks", "inplace", "ineligible")

#: Skip reasons tied to the call itself (its size, its hooks, its modes, a fault of ours on it): the calls skipped
#: for them are non-response, and nothing says how they would have compared, so the verdict counts their share of
#: calls as unknown (Manski's worst case). Only the budget skips calls whatever they hold (by time spent): the calls
#: compared are then still a random sample of the sampled ones (RANDOM_SKIP_REASONS; the verdict takes every other
#: reason, one it does not know included, for non-response).
RANDOM_SKIP_REASONS = ("budget",)
NONRESPONSE_REASONS = tuple(r for r in SKIP_REASONS if r not in RANDOM_SKIP_REASONS)

#: Reasons a DataParallel call's result (legacy and upstream agreeing) departs from the single-device oracle's.
SHARED_DIVERGENCE_REASONS = ("structure", "type", "dtype", "shape", "device", "nan", "value")

#: Reasons that show a difference in kind, not in degree: no tolerance can make them pass.
HARD_REASONS = frozenset(
    {"structure", "type", "dtype", "shape", "device", "stride", "requires_grad", "nan", "exception", "state", "custom"}
)

DETAIL_LIMIT = 600


def bounded(text: str, limit: int = DETAIL_LIMIT) -> str:
    """Cut ``text`` to ``limit`` characters, marking the cut."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


#: The decades a truth run's error ratio is counted in (journals and the verdict keep whole counts).
DECADE_LIMIT = 12


def error_decade(legacy_error: float, upstream_error: float) -> int | None:
    """``log10(upstream's error / legacy's)`` rounded to a whole decade (-3: upstream's error a thousandth of
    legacy's), within +-DECADE_LIMIT; None where either error is zero or not finite (no ratio)."""
    if not (0 < legacy_error < math.inf and 0 < upstream_error < math.inf):
        return None
    return max(-DECADE_LIMIT, min(DECADE_LIMIT, round(math.log10(upstream_error / legacy_error))))


def within_noise_floor(found: Any, test: str) -> Any:
    """A value mismatch (a Comparison or an Observation) the noise floor judged noise, with its test in the detail."""
    return dataclasses.replace(
        found, outcome=Outcome.NOISE, reasons=(), detail=bounded(f"within the noise floor ({test}): {found.detail}")
    )


#: The signature of a call whose target's signature function raised or changed a generator, or that the budget did
#: not classify.
UNCLASSIFIED_SIGNATURE = "unclassified"

#: Distinct signatures a target may have (each is a metric series); later ones count as ``OTHER_SIGNATURE``.
MAX_SIGNATURES = 100
OTHER_SIGNATURE = "other"

#: Coverage guidance's default: the first calls of every signature that are compared whatever the rate.
DEFAULT_FIRST_PER_SIGNATURE = 30


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def label_text(text: str, limit: int) -> str:
    """``text`` fit for a metric label and a journal field: control characters (a NUL makes an exposition
    unreadable) as ``?``, cut to ``limit``."""
    return bounded(_CONTROL.sub("?", text), limit)


@dataclasses.dataclass(frozen=True)
class Evidence:
    """The call behind a mismatch: inputs as legacy received them, both results, the module state.

    Holds references, not copies; exporters that keep it (repro captures) save it at once.
    """

    args: tuple
    kwargs: dict
    legacy: Any
    upstream: Any
    module_state: dict | None = None
    legacy_fn: Any = None
    upstream_fn: Any = None
    exact: bool = False
    #: The accelerator's current device when the call ran ("npu:1"; None without one): where a cast to a device
    #: type puts a host tensor, and what a replay makes current again.
    device: str | None = None


@dataclasses.dataclass(frozen=True)
class Observation:
    """What one sampled call showed. Exporters receive these; they are never mutated."""

    target: str
    outcome: str
    reasons: tuple[str, ...] = ()
    max_abs_error: float = 0.0
    max_rel_error: float = 0.0
    mismatched: int = 0
    numel: int = 0
    #: The time the primary's run took (the caller's own call), and the shadow run's.
    primary_seconds: float = 0.0
    shadow_seconds: float = 0.0
    compare_seconds: float = 0.0
    signature: str = "call"
    detail: str = ""
    timestamp: float = 0.0
    #: True when a fire drill injected this observation's divergence.
    drill: bool = False
    #: Where legacy and upstream agree but both depart from the single-device oracle: its first reason (one of
    #: SHARED_DIVERGENCE_REASONS) and what differs; empty when the oracle agreed or did not run.
    shared_divergence: str = ""
    shared_detail: str = ""
    #: Time the single-device oracle run and its comparison took (part of the shadow side's time).
    oracle_seconds: float = 0.0
    #: An A/A run (legacy again, isolated as upstream is) ran on this call: its greatest absolute and relative
    #: difference from legacy's own result (0.0 for a deterministic target), and the time it took.
    aa: bool = False
    aa_abs_error: float = 0.0
    aa_rel_error: float = 0.0
    aa_seconds: float = 0.0
    #: For a value difference: the noise floor's judgement of it (its greatest leaf error against that leaf's
    #: threshold), whether it made the outcome noise or not.
    noise_test: str = ""
    #: Where the call (``noise_check``), its A/A run (``aa_check``) and its backward comparison's gradients and their
    #: A/A products (``grad_noise_check``, ``grad_aa_check``) stood against their signature's noise thresholds
    #: (shadow.core.judging.noise): ``within``, ``beyond`` (an exceedance), or "" where none was judged (a burn-in not
    #: over, a target that repeats itself bitwise, no A/A runs). The verdict bounds the rate of A/B exceedances beyond
    #: the A/A rate with them.
    noise_check: str = ""
    aa_check: str = ""
    grad_noise_check: str = ""
    grad_aa_check: str = ""
    #: A backward comparison ran on this call (shadow.core.judging.gradients), and the time it took.
    backward: bool = False
    backward_seconds: float = 0.0
    #: Why a backward comparison planned for this call was not made (BACKWARD_SKIP_REASONS; "" where it was, or
    #: none was planned).
    backward_skip: str = ""
    #: A value difference the noise floor cannot judge yet (too few A/A runs of its signature): held by the engine,
    #: never published as it is, until the floor decides it (noise or mismatch) or the job ends first (a skip,
    #: reason noise_pending); ``leaf_errors`` are what it is judged on.
    noise_pending: bool = False
    leaf_errors: tuple[tuple[str, float], ...] = dataclasses.field(default=(), repr=False, compare=False)
    #: The share of a cluster this comparison opened (0 where it opened none; ``1 / WORLD_SIZE`` in a distributed
    #: job, 1 elsewhere: shadow.core.calls.record.clusters): the unit the verdict counts evidence in, counted once,
    #: here, for
    #: every exporter.
    cluster_share: float = 0.0
    #: For a value difference, a float64 truth run (shadow.core.judging.truth): the side nearer it (legacy, upstream
    #: or tie;
    #: "" where none ran), each side's error against it, and the time it took.
    nearer: str = ""
    legacy_truth_error: float = 0.0
    upstream_truth_error: float = 0.0
    truth_seconds: float = 0.0
    #: The bytes by which the shadow side raised the accelerator's peak allocation (summed over devices: what the
    #: job's ``max_memory_allocated`` shows beyond its own; 0 on the host or where it stayed below the peak).
    shadow_peak_bytes: int = 0
    #: Where the legacy side came from: 'torch_npu', 'torch_npu X source', 'reference', or '' (a custom target).
    legacy: str = ""
    #: The side whose result the caller got (the other ran as the shadow): 'legacy', or 'upstream' in a canary.
    primary: str = LEGACY
    #: For mismatches and errors: what a repro capture needs (never compared, never printed).
    evidence: Evidence | None = dataclasses.field(default=None, repr=False, compare=False)

    @classmethod
    def compared(cls, target: str, found: Any, signature: str, primary: str, **fields: Any) -> Observation:
        """The observation of a compared call from its comparison ``found`` (outcome, reasons, errors, elements,
        detail: :class:`shadow.core.judging.compare.Comparison`) and the other ``fields``."""
        return cls(
            target, found.outcome, found.reasons, max_abs_error=found.max_abs_error, max_rel_error=found.max_rel_error,
            mismatched=found.mismatched, numel=found.numel, detail=found.detail, signature=signature,
            timestamp=time.time(), primary=primary, **fields,
        )  # fmt: skip

    def __post_init__(self) -> None:
        try:
            outcome = Outcome(self.outcome)
        except ValueError:
            raise ValueError(f"outcome {self.outcome!r} is not one of {OUTCOMES}") from None
        object.__setattr__(self, "outcome", outcome.value)  # the plain value, also when given a member

    @property
    def legacy_seconds(self) -> float:
        """The time legacy's run took, whichever side it ran as."""
        return self.primary_seconds if self.primary == LEGACY else self.shadow_seconds

    @property
    def upstream_seconds(self) -> float:
        """The time upstream's run took, whichever side it ran as."""
        return self.shadow_seconds if self.primary == LEGACY else self.primary_seconds

    @property
    def noise_checks(self) -> tuple[tuple[str, str, str], ...]:
        """(evidence, pair, check) of each of this call's runs judged against its noise thresholds: evidence
        ``forward`` or ``gradients``, pair ``ab`` (legacy against upstream) or ``aa`` (legacy against itself), check
        ``within`` or ``beyond``."""
        judged = (
            ("forward", "ab", self.noise_check), ("forward", "aa", self.aa_check),
            ("gradients", "ab", self.grad_noise_check), ("gradients", "aa", self.grad_aa_check),
        )  # fmt: skip
        return tuple(check for check in judged if check[2])

    @property
    def backward_outcome(self) -> str:
        """What its backward comparison found (:data:`BACKWARD_OUTCOMES`), or "" where none ran."""
        if not self.backward:
            return ""
        return "mismatch" if "grad" in self.reasons else "match"

    @property
    def overhead_seconds(self) -> float:
        """Time the shadow side cost the caller: the shadow run, the comparison, the oracle, the A/A, backward
        and truth runs."""
        return (
            self.shadow_seconds + self.compare_seconds + self.oracle_seconds + self.aa_seconds
            + self.backward_seconds + self.truth_seconds
        )  # fmt: skip


#: What switched a target's primary: the rollback switch (to legacy), or a person's reset (to the configured side).
SWITCH_EVENTS = ("rollback", "reset")


@dataclasses.dataclass(frozen=True)
class Switched:
    """The side whose result the caller of ``target`` gets was switched to ``primary``: a ``rollback`` (the rollback
    switch made legacy the primary) or a person's ``reset``; ``by`` says who or what ("http:<requester>",
    "file:<path>", "api:<caller>")."""

    target: str
    event: str
    by: str
    primary: str


@dataclasses.dataclass(frozen=True)
class TargetStats:
    """Counts for one installed target since it was installed.

    ``sampled == compared + skipped`` and ``compared == match + close + mismatch + noise + error`` always hold for a
    consistent snapshot. ``by_reason`` counts each reason of each observation (an observation may carry
    several): mismatch reasons and skip reasons. ``export_errors`` counts exporter failures, which change no
    observation's outcome.
    """

    calls: int = 0
    sampled: int = 0
    match: int = 0
    close: int = 0
    mismatch: int = 0
    noise: int = 0  # value differences within the noise floor (legacy differs from itself as much)
    error: int = 0
    skipped: int = 0
    #: Value differences held now until the noise floor can judge them (not in ``sampled`` until it does).
    noise_pending: int = 0
    by_reason: Mapping[str, int] = dataclasses.field(default_factory=lambda: MappingProxyType({}))
    #: Shared divergences found by the single-device oracle, by reason; and how often the oracle ran.
    shared_divergences: Mapping[str, int] = dataclasses.field(default_factory=lambda: MappingProxyType({}))
    oracle_runs: int = 0
    #: Backward comparisons run, and float64 truth runs by the side nearer the truth (legacy, upstream, tie).
    backward_runs: int = 0
    #: Backward comparisons planned but not made, by reason (BACKWARD_SKIP_REASONS).
    backward_skips: Mapping[str, int] = dataclasses.field(default_factory=lambda: MappingProxyType({}))
    truth_runs: Mapping[str, int] = dataclasses.field(default_factory=lambda: MappingProxyType({}))
    #: Sampled calls whose signature was counted as "other": the target had MAX_SIGNATURES already.
    #: Clusters of this process's comparisons (shadow.core.calls.record.clusters), every phase together (a distributed
    #: job's
    #: rank counts each of its blocks as ``1 / WORLD_SIZE``).
    clusters: float = 0.0
    #: Comparisons a fire drill injected its fault into (shadow.core.calls.sampled.drill).
    drilled: int = 0
    signatures_over_cap: int = 0
    #: Observations an exporter failed to export (one per failing exporter).
    export_errors: int = 0
    #: Sampled calls after which a global setting could not be taken or put back (each said in the log).
    settings_failures: int = 0
    #: The side whose result the caller gets now ('legacy', or 'upstream' in a canary until a rollback), and who
    #: or what threw the rollback switch ('' if nobody did).
    primary: str = LEGACY
    rolled_back_by: str = ""
    #: Calls by signature, for a coverage-guided target (every call classified); empty otherwise.
    signature_calls: Mapping[str, int] = dataclasses.field(default_factory=lambda: MappingProxyType({}))
    #: The most a sampled call's shadow side raised the accelerator's peak allocation, in bytes (0 on the host).
    shadow_peak_bytes: int = 0
    #: Runs judged against their signature's noise thresholds, by ``evidence/pair/check`` (``forward/ab/beyond``: an
    #: A/B exceedance; ``forward/aa/beyond``: legacy beyond its own threshold; shadow.core.judging.noise).
    noise_checks: Mapping[str, int] = dataclasses.field(default_factory=lambda: MappingProxyType({}))

    @property
    def compared(self) -> int:
        """Sampled calls that were actually compared."""
        return self.match + self.close + self.mismatch + self.noise + self.error

    def then(self, later: TargetStats) -> TargetStats:
        """The counts of this install of the target followed by ``later``'s (the monitor installed anew over new
        legacy patches): every count added, the side returned and the rollback as they are now."""
        fields: dict[str, Any] = {}
        for field in dataclasses.fields(self):
            mine, theirs = getattr(self, field.name), getattr(later, field.name)
            if isinstance(mine, int):
                fields[field.name] = mine + theirs
            elif isinstance(mine, Mapping):
                merged = dict(mine)
                for key, count in theirs.items():
                    merged[key] = merged.get(key, 0) + count
                fields[field.name] = MappingProxyType(merged)
            else:
                fields[field.name] = theirs
        return TargetStats(**fields)
