"""The metric contract: the series every exporter and every source share, and the one place values become samples.

One dashboard and one rule file serve both metric paths: the OpenTelemetry instruments below come out of the SDK's
Prometheus translation with exactly the Prometheus names (dots become underscores, ``_total`` is added to
monotonic sums, ``_seconds`` for unit ``s``, and ``{annotation}`` units add nothing).
Labels come only from bounded sets: target, outcome, reason, signature; and every series carries the run it
belongs to (:data:`RUN_LABEL`, one value per process).

What an :class:`Observation` (and each event of the core's: calls, skips in bulk, process time, a switch of the
primary) says is turned into samples here, once, by the core (:func:`observation_samples` and the ``*_samples``
functions; after prometheus/client_python's collectors: values become samples in one place, backends stay thin): a
:data:`Sample` is (metric, its labels in the metric's order, value), a counter's increment, a histogram's
observation or a gauge's value. Every exporter's ``record`` gets them (:mod:`shadow.core.calls.record.exporting`):
Prometheus and OpenTelemetry apply them, the journal sums a phase's into its count records. Adding a metric is a
:class:`Metric` in :data:`ALL` and, where an observation carries it, a rule in :data:`OBSERVATION_RULES`; every
exporter then carries it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping

from shadow.core.model.observation import (
    BACKWARD_OUTCOMES,
    CHECK_RESULTS,
    CHECKED_EVIDENCE,
    CHECKED_PAIRS,
    COMPARED_OUTCOMES,
    DIVERGENT_OUTCOMES,
    HARD_REASONS,
    MISMATCH_REASONS,
    NEARER,
    SHARED_DIVERGENCE_REASONS,
    SKIP_REASONS,
    Observation,
    Outcome,
)
from shadow.core.model.observation import LEGACY as LEGACY_SIDE
from shadow.core.model.run_ids import command_id as command_id
from shadow.core.model.run_ids import restarts as restarts
from shadow.core.model.run_ids import run_id as run_id
from shadow.core.model.run_ids import run_started, started
from shadow.core.support.environment import device as device  # the environment labels come from the core
from shadow.core.support.environment import versions as versions

PREFIX = "npu_shadow"

#: The label every series carries: the run it belongs to (``shadow.core.support.environment.run_id``).
RUN_LABEL = "run"

#: The label sets, from the core's vocabulary (rules, dashboard and verdict read them here).
VOCABULARY = {
    "compared_outcomes": COMPARED_OUTCOMES,
    "divergent_outcomes": DIVERGENT_OUTCOMES,
    "hard_reasons": tuple(r for r in MISMATCH_REASONS if r in HARD_REASONS),  # in a stable order
    "mismatch_reasons": MISMATCH_REASONS,
    "skip_reasons": SKIP_REASONS,
    "shared_divergence_reasons": SHARED_DIVERGENCE_REASONS,
    "nearer": NEARER,
    "backward_outcomes": BACKWARD_OUTCOMES,
}

#: Buckets for absolute and relative errors, 1e-8 .. 1: every second decade (the tolerances live between 1e-8 and
#: 1e-2; a bucket per decade doubled the histograms' share of a job's series for a resolution no rule reads).
ERROR_BUCKETS = tuple(10.0**e for e in range(-8, 1, 2))

#: Errors above this land in the +Inf bucket anyway; capping keeps histogram sums finite.
ERROR_CAP = 1e3

#: Buckets for the shadow side's duration per sampled call, 100 us .. 10 s, a bucket per decade.
DURATION_BUCKETS = (1e-4, 1e-3, 1e-2, 0.1, 1.0, 10.0)


@dataclasses.dataclass(frozen=True, eq=False)  # identity hashing: these are singletons used as dict keys
class Metric:
    """One metric: its OpenTelemetry instrument name and unit, and the Prometheus name it becomes."""

    otel_name: str
    unit: str
    kind: str  # counter, histogram, gauge
    labels: tuple[str, ...]
    description: str
    #: A gauge that shows the greatest value its samples gave (else the last).
    greatest: bool = False
    #: Where the verdict reads the metric (:data:`EVIDENCE`): the labels, besides target and primary, a phase's
    #: counts of it are kept by, in the order of their keys (None: the verdict does not read it).
    evidence: tuple[str, ...] | None = None
    #: Labels whose values are a closed set: a source takes a series with another value for none of the evidence
    #: (a series from before the label, a value a later version added).
    closed: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)

    @property
    def prometheus_name(self) -> str:
        """The name as exposed (without the ``_total`` a counter gets on exposition)."""
        name = self.otel_name.replace(".", "_")
        return name + {"s": "_seconds", "By": "_bytes"}.get(self.unit, "")

    @property
    def series(self) -> str:
        """The name queries use: counters with ``_total``, histograms' buckets with ``_bucket``."""
        suffix = {"counter": "_total", "histogram": "_bucket"}.get(self.kind, "")
        return self.prometheus_name + suffix


CALLS = Metric(
    "npu_shadow.calls",
    "{call}",
    "counter",
    ("target", "signature", "primary"),
    "Calls of the wrapped function, sampled or not; by call signature for a coverage-guided target (empty otherwise) "
    "and the side whose result the caller got.",
    evidence=("signature",),
)
COMPARISONS = Metric(
    "npu_shadow.comparisons",
    "{comparison}",
    "counter",
    ("target", "outcome", "signature", "primary"),
    "Compared calls by outcome (match, close, noise, mismatch, error), call signature and the side whose result the "
    "caller got (primary: legacy, or upstream in a canary); sampled = compared + skipped.",
    evidence=("signature", "outcome"),
)
MISMATCHES = Metric(
    "npu_shadow.mismatches",
    "{mismatch}",
    "counter",
    ("target", "reason", "primary"),
    "Reasons found in mismatching or erroring comparisons (one comparison can have several).",
    evidence=("reason",),
)
SKIPPED = Metric(
    "npu_shadow.skipped",
    "{comparison}",
    "counter",
    ("target", "reason", "signature", "primary"),
    "Sampled calls not compared, by reason and call signature (empty where it is not known: the budget's skips, a "
    "call whose signature could not be taken).",
    evidence=("signature", "reason"),
)
PATCH_CALLS = Metric(
    "npu_shadow.patch_calls",
    "{call}",
    "counter",
    ("patch",),
    "The job's calls of each function patch of the release's census (counted at its place in torch, by its dotted "
    "name): which of the release's patches the job calls.",
)
DRILLED = Metric(
    "npu_shadow.drilled",
    "{comparison}",
    "counter",
    ("target", "outcome", "signature", "primary"),
    "Comparisons a fire drill injected its divergence into, by outcome (counted in npu_shadow_comparisons_total "
    "too): the verdict sets exactly these aside once the drill is over.",
)
DRILLED_REASONS = Metric(
    "npu_shadow.drilled_reasons",
    "{mismatch}",
    "counter",
    ("target", "reason", "primary"),
    "The reasons of the drilled comparisons (counted in npu_shadow_mismatches_total too).",
)
EXPORT_ERRORS = Metric(
    "npu_shadow.export_errors",
    "{observation}",
    "counter",
    ("target",),
    "Observations an exporter failed to export (or whose histogram values it had to drop).",
)
SHARED_DIVERGENCES = Metric(
    "npu_shadow.shared_divergences",
    "{comparison}",
    "counter",
    ("target", "reason", "primary"),
    "Comparisons where legacy and upstream agree but both depart from the single-device oracle, by reason.",
    evidence=("reason",),
)
ABS_ERROR = Metric("npu_shadow.abs_error", "1", "histogram", ("target",), "Greatest absolute error per comparison.")
REL_ERROR = Metric("npu_shadow.rel_error", "1", "histogram", ("target",), "Greatest relative error per comparison.")
PRIMARY_TIME = Metric(
    "npu_shadow.primary_run",
    "s",
    "counter",
    ("target",),
    "Time the primary's runs took on sampled calls (the caller's own calls: legacy's, upstream's in a canary).",
)
#: The series the primary's time had before it was named by role (``npu_shadow.legacy``, which held upstream's time
#: in a canary): rules and dashboards read it beside :data:`PRIMARY_TIME` for series written before.
LEGACY_TIME_SERIES = "npu_shadow_legacy_seconds_total"
SHADOW = Metric(
    "npu_shadow.shadow",
    "s",
    "counter",
    ("target",),
    "Time spent on the shadow side: the shadow run, the comparison, and the oracle, A/A, backward and truth runs.",
)
SHADOW_DURATION = Metric(
    "npu_shadow.shadow.duration", "s", "histogram", ("target",), "Shadow side time per sampled call."
)
PRIMARY = Metric(
    "npu_shadow.primary",
    "1",
    "gauge",
    ("target", "side"),
    "1 for the side whose result the caller gets now (legacy, or upstream in a canary), 0 for the other.",
)
ROLLBACKS = Metric(
    "npu_shadow.rollbacks",
    "{rollback}",
    "counter",
    ("target", "source"),
    "Times the rollback switch made legacy the primary, by what threw it (http, file, api).",
)
RESETS = Metric(
    "npu_shadow.resets",
    "{reset}",
    "counter",
    ("target",),
    "A person's resets after a rollback (Monitor.reset_primary): the rollback is honoured until one; the recording "
    "rule npu_shadow:rolled_back:latched keeps it across process restarts until then.",
)
AA_RUNS = Metric(
    "npu_shadow.aa_runs",
    "{run}",
    "counter",
    ("target", "signature", "result"),
    "A/A runs (legacy run again, isolated as upstream is, against its own result), by whether the two differed "
    "(result: same, differs).",
)
NOISE_CHECKS = Metric(
    "npu_shadow.noise_checks",
    "{run}",
    "counter",
    ("target", "primary", "evidence", "pair", "check"),
    "Runs judged against their signature's noise thresholds (fixed by its first A/A runs: shadow.core.judging.noise), "
    "by evidence (forward, gradients), pair (ab: legacy against upstream; aa: legacy against itself) and check "
    "(below: at most the typical A/A error; within: above it, within the thresholds; beyond): the verdict bounds the "
    "rate of A/B exceedances beyond legacy's own A/A rate with them, and a shift inside the thresholds from how "
    "often each lands above the typical error. Absent until counted.",
    evidence=("evidence", "pair", "check"),
    closed={"evidence": CHECKED_EVIDENCE, "pair": CHECKED_PAIRS, "check": CHECK_RESULTS},
)
NOISE_FLOOR = Metric(
    "npu_shadow.noise_floor",
    "1",
    "gauge",
    ("target", "signature", "measure"),
    "The noise floor: the greatest difference between two legacy runs of the same call (A/A), by signature and "
    "measure (abs, rel). A legacy-vs-upstream value difference is outcome noise only within its leaves' thresholds "
    "(6 x the greatest of a signature's first 200 A/A errors: npu_shadow_noise_checks_total).",
    greatest=True,
)
SHADOW_PEAK = Metric(
    "npu_shadow.shadow_peak_added",
    "By",
    "gauge",
    ("target",),
    "The most a sampled call's shadow side raised the accelerator's peak allocated memory, in bytes (the device "
    "memory the job's peak holds beyond its own; 0 on the host).",
    greatest=True,
)
BACKWARD_RUNS = Metric(
    "npu_shadow.backward_runs",
    "{run}",
    "counter",
    ("target", "signature", "primary", "outcome"),
    "Backward comparisons: seeded cotangents pulled back through both sides' graphs, by what they found (match, or "
    "mismatch: the call's outcome is then a mismatch with reason grad). The gradients' own evidence.",
    evidence=("signature", "outcome"),
    closed={"outcome": BACKWARD_OUTCOMES},
)
BACKWARD_SKIPS = Metric(
    "npu_shadow.backward_skips",
    "{call}",
    "counter",
    ("target", "reason", "primary"),
    "Backward comparisons planned for a compared call but not made, by reason (deadline, reentrant, sparse, raised, "
    "no_grad, diverged, failed, hooks, memory) and the side whose result the caller got: what the gradient evidence "
    "is missing (the verdict's non-response of the gradients, but for no_grad and diverged).",
    evidence=("reason",),
)
PROCESS_TIME = Metric(
    "npu_shadow.process",
    "s",
    "counter",
    (),
    "Seconds of process time under the monitor, every process of the run together: the evidence rate's "
    "denominator (clusters per process-hour).",
)
PROCESSES = Metric(
    "npu_shadow.processes",
    "{process}",
    "counter",
    (),
    "Processes whose values these are (each counts 1 as its exporter starts, a forked one too): each begins a 60 s "
    "block of its own, so their clusters are at most their time's blocks and one more each.",
)
CLUSTERS = Metric(
    "npu_shadow.clusters",
    "{cluster}",
    "counter",
    ("target", "primary"),
    "Clusters of comparisons (a process's 60 s blocks, an incident never cut, a distributed job's rank counting "
    "1/WORLD_SIZE of each: shadow.core.calls.record.clusters): the unit the verdict counts evidence in, by the "
    "side whose result the caller got.",
    evidence=(),
)
CALL_BLOCKS = Metric(
    "npu_shadow.call_blocks",
    "{block}",
    "counter",
    ("target", "primary"),
    "The 60 s blocks of process time in which the target was called, compared or not, counted as clusters are (a "
    "rank's share each): the most clusters comparing every call could make, what --gather can add to the evidence.",
    evidence=(),
)
TRUTH_RUNS = Metric(
    "npu_shadow.truth_runs",
    "{run}",
    "counter",
    ("target", "signature", "primary", "nearer"),
    "Float64 CPU truth runs of calls whose two sides differ in value, by the side nearer the truth (legacy, upstream, "
    "tie) and the side whose result the caller got: a difference where upstream is nearer is not a regression.",
    evidence=("signature", "nearer"),
    closed={"nearer": NEARER},
)
ARM_ITERATORS = Metric(
    "npu_shadow.arm_iterators",
    "{iterator}",
    "counter",
    ("target", "arm", "workers"),
    "Iterators built by each arm of a canary A/B (dataloader_init), by whether their workers run on fewer cores than "
    "the process had (workers: bound, unbound).",
)
ARM_FIRST_BATCH = Metric(
    "npu_shadow.arm_first_batch",
    "s",
    "counter",
    ("target", "arm"),
    "Time from each iterator's construction to its first batch, summed by arm (the mean: divided by the iterators "
    "that gave a batch, npu_shadow_arm_first_batches_total).",
)
ARM_FIRST_BATCHES = Metric(
    "npu_shadow.arm_first_batches",
    "{iterator}",
    "counter",
    ("target", "arm"),
    "Iterators of each arm that gave at least one batch.",
)
SAMPLE_RATE = Metric("npu_shadow.sample_rate", "1", "gauge", ("target",), "Configured fraction of calls shadowed.")
DRILL_ACTIVE = Metric(
    "npu_shadow.drill_active", "1", "gauge", (), "1 while a fire drill injects synthetic divergence upstream, else 0."
)
STARTED = Metric(
    "npu_shadow.started_time",
    "s",
    "gauge",
    (),
    "When the processes these values come from began (Unix seconds: their launcher's start). One moment of their "
    "metrics holds what they counted since, nothing of the run before it.",
)
RUN_STARTED = Metric(
    "npu_shadow.run_start_time",
    "s",
    "gauge",
    (),
    "When the run began (Unix seconds: --run-started, or the time a made run id carries; absent where a process "
    "cannot know). Where it is before npu_shadow_started_time_seconds, the run had processes these values never saw.",
)
BUILD_INFO = Metric(
    "npu_shadow.build_info",
    "1",
    "gauge",
    ("version", "torch", "torch_npu", "command", "restart"),
    "Versions, the job's command (a hash of its command line: one run is one job) and the launcher's restart count "
    "(a restarted process's counters start at 0, after whatever it counted before), as labels; always 1.",
)

ALL = (
    CALLS,
    ARM_ITERATORS,
    ARM_FIRST_BATCH,
    ARM_FIRST_BATCHES,
    COMPARISONS,
    CLUSTERS,
    CALL_BLOCKS,
    PROCESS_TIME,
    PROCESSES,
    MISMATCHES,
    DRILLED,
    DRILLED_REASONS,
    PATCH_CALLS,
    SKIPPED,
    EXPORT_ERRORS,
    SHARED_DIVERGENCES,
    ABS_ERROR,
    REL_ERROR,
    PRIMARY_TIME,
    SHADOW,
    SHADOW_DURATION,
    AA_RUNS,
    NOISE_CHECKS,
    NOISE_FLOOR,
    SHADOW_PEAK,
    BACKWARD_RUNS,
    BACKWARD_SKIPS,
    TRUTH_RUNS,
    PRIMARY,
    ROLLBACKS,
    RESETS,
    SAMPLE_RATE,
    DRILL_ACTIVE,
    STARTED,
    RUN_STARTED,
)


#: The series the verdict reads, each with the labels a phase's counts of it are kept by (:attr:`Metric.evidence`).
EVIDENCE = {metric: metric.evidence for metric in ALL if metric.evidence is not None}

#: What can throw the rollback switch (the ``source`` label of npu_shadow_rollbacks_total).
ROLLBACK_SOURCES = ("http", "file", "api")


def rollback_source(by: str) -> str:
    """The bounded label of a rollback's ``by`` ("http:alertmanager ..." -> "http"; anything unknown: "other")."""
    source = by.partition(":")[0]
    return source if source in ROLLBACK_SOURCES else "other"


def zero_series(target: str) -> list[tuple[Metric, dict[str, str]]]:
    """What a target installed shows before its first event: its calls at zero (with ``npu_shadow_sample_rate``,
    that it is monitored). Every other series appears at its first event: a job's series are what it did, not
    every label value it could take (docs/fleet.md: the series budget), and the rules and the verdict read an
    absent series as 0 (:mod:`shadow.analysis.sources.promql`)."""
    return [(CALLS, {"target": target, "signature": "", "primary": LEGACY_SIDE})]


# --------------------------------------------------------------------------- samples

#: One value for one series: (metric, its labels in the metric's order, value).
Sample = tuple[Metric, tuple[str, ...], float]


def _outcome(o: Observation) -> Iterable[Sample]:
    if o.outcome == Outcome.SKIPPED:
        return [(SKIPPED, (o.target, reason, o.signature, o.primary), 1) for reason in o.reasons]
    found: list[Sample] = [(COMPARISONS, (o.target, o.outcome, o.signature, o.primary), 1)]
    if o.cluster_share:
        found.append((CLUSTERS, (o.target, o.primary), o.cluster_share))
    found += [(MISMATCHES, (o.target, reason, o.primary), 1) for reason in o.reasons]
    if o.drill:
        found.append((DRILLED, (o.target, o.outcome, o.signature, o.primary), 1))
        found += [(DRILLED_REASONS, (o.target, reason, o.primary), 1) for reason in o.reasons]
    if o.shared_divergence:
        found.append((SHARED_DIVERGENCES, (o.target, o.shared_divergence, o.primary), 1))
    return found


def _errors(o: Observation) -> Iterable[Sample]:
    if o.outcome in (Outcome.SKIPPED, Outcome.ERROR) or not o.numel:
        return ()
    return (
        (ABS_ERROR, (o.target,), min(o.max_abs_error, ERROR_CAP)),
        (REL_ERROR, (o.target,), min(o.max_rel_error, ERROR_CAP)),
    )


def _aa(o: Observation) -> Iterable[Sample]:
    if not o.aa or o.outcome == Outcome.SKIPPED:
        return ()
    differs = o.aa_abs_error > 0 or o.aa_rel_error > 0
    return (
        (AA_RUNS, (o.target, o.signature, "differs" if differs else "same"), 1),
        (NOISE_FLOOR, (o.target, o.signature, "abs"), min(o.aa_abs_error, ERROR_CAP)),
        (NOISE_FLOOR, (o.target, o.signature, "rel"), min(o.aa_rel_error, ERROR_CAP)),
    )


def _noise(o: Observation) -> Iterable[Sample]:
    return [(NOISE_CHECKS, (o.target, o.primary, *check), 1) for check in o.noise_checks]


def _extra_runs(o: Observation) -> Iterable[Sample]:
    if o.outcome == Outcome.SKIPPED:
        return ()
    found: list[Sample] = []
    if o.backward:
        found.append((BACKWARD_RUNS, (o.target, o.signature, o.primary, o.backward_outcome), 1))
    if o.backward_skip:
        found.append((BACKWARD_SKIPS, (o.target, o.backward_skip, o.primary), 1))
    if o.nearer:
        found.append((TRUTH_RUNS, (o.target, o.signature, o.primary, o.nearer), 1))
    return found


def _memory(o: Observation) -> Iterable[Sample]:
    return ((SHADOW_PEAK, (o.target,), o.shadow_peak_bytes),) if o.shadow_peak_bytes else ()


def _time(o: Observation) -> Iterable[Sample]:
    if o.outcome == Outcome.SKIPPED:
        return ()
    overhead = o.overhead_seconds
    return (
        (PRIMARY_TIME, (o.target,), o.primary_seconds),
        (SHADOW, (o.target,), overhead),
        (SHADOW_DURATION, (o.target,), overhead),
    )


#: What an observation says, by metric: each rule gives its samples (none where it says nothing of them).
OBSERVATION_RULES: list[Callable[[Observation], Iterable[Sample]]] = [
    _outcome, _errors, _aa, _noise, _extra_runs, _memory, _time,
]  # fmt: skip


def observation_samples(observation: Observation) -> list[Sample]:
    """Every sample of one observation, from :data:`OBSERVATION_RULES`."""
    return [sample for rule in OBSERVATION_RULES for sample in rule(observation)]


def call_samples(target: str, calls: int, signature: str, primary: str) -> list[Sample]:
    """Calls that passed since the last report, by the side the caller got."""
    return [(CALLS, (target, signature, primary), calls)]


def skip_samples(target: str, reason: str, count: int, primary: str) -> list[Sample]:
    """Sampled calls skipped in bulk, without an observation each (the overhead budget, the deadline)."""
    return [(SKIPPED, (target, reason, "", primary), count)]


def primary_samples(target: str, side: str) -> list[Sample]:
    """The side whose result the caller of ``target`` gets from now on (at install, and at a switch)."""
    return [(PRIMARY, (target, each), 1 if each == side else 0) for each in (LEGACY_SIDE, "upstream")]


def rollback_samples(target: str, by: str) -> list[Sample]:
    """A rollback, by what threw it."""
    return [(ROLLBACKS, (target, rollback_source(by)), 1)]


def reset_samples(target: str) -> list[Sample]:
    """A person's reset after a rollback."""
    return [(RESETS, (target,), 1)]


def call_block_samples(target: str, primary: str, blocks: float) -> list[Sample]:
    """The target's calls (``primary`` the side the caller got) began a block of process time: ``blocks`` is what
    it counts as (a rank's share; :meth:`shadow.core.calls.record.clusters.Clusters.called`)."""
    return [(CALL_BLOCKS, (target, primary), blocks)] if blocks > 0 else []


def process_samples() -> list[Sample]:
    """A process whose values an exporter carries from now (at its start, and in a forked child)."""
    return [(PROCESSES, (), 1)]


def time_samples(seconds: float) -> list[Sample]:
    """Seconds of this process's time under the monitor since the last report (each second, and at flush): what
    the verdict turns into "how much more running it takes"."""
    return [(PROCESS_TIME, (), seconds)] if seconds > 0 else []


def patch_call_samples(patch: str, calls: int) -> list[Sample]:
    """The job's calls of one function patch (by its dotted name) since the last report
    (:mod:`shadow.core.calls.patch_calls`)."""
    return [(PATCH_CALLS, (patch,), calls)] if calls > 0 else []


def export_error_samples(target: str, exporters: int = 1) -> list[Sample]:
    """``exporters`` that failed to export one of ``target``'s records."""
    return [(EXPORT_ERRORS, (target,), exporters)]


def registered_samples(target: str, sample_rate: float) -> list[Sample]:
    """A target installed: every series of :func:`zero_series` at zero, and its sample rate."""
    found: list[Sample] = [
        (metric, tuple(labels[name] for name in metric.labels), 0) for metric, labels in zero_series(target)
    ]
    found.append((SAMPLE_RATE, (target,), sample_rate))
    return found


def build_info() -> tuple[str, ...]:
    """The labels of ``npu_shadow_build_info`` for this process, in the metric's order."""
    return (*versions().values(), command_id(), str(restarts()))


def start_samples(run: str) -> list[Sample]:
    """When this process's launch began, and when its run did where it can know (an exporter's first samples)."""
    began = run_started(run)
    return [(STARTED, (), started())] + ([(RUN_STARTED, (), began)] if began is not None else [])


def drill_samples(active: bool) -> list[Sample]:
    """Whether a fire drill injects synthetic divergence."""
    return [(DRILL_ACTIVE, (), 1 if active else 0)]


def arm_samples(target: str, arm: str, workers_bound: bool, first_batch_seconds: float | None) -> list[Sample]:
    """One iterator of a canary A/B (:mod:`shadow.core.calls.canary.arms`)."""
    found: list[Sample] = [(ARM_ITERATORS, (target, arm, "bound" if workers_bound else "unbound"), 1)]
    if first_batch_seconds is not None:
        found += [(ARM_FIRST_BATCH, (target, arm), first_batch_seconds), (ARM_FIRST_BATCHES, (target, arm), 1)]
    return found
