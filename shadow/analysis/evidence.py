"""The evidence of one target as a source gives it to the verdict: its counts by phase (the side whose result the
caller got), with the rollbacks, resets and process time beside them. Every source (journals, metrics files,
Prometheus and any PromQL store, a monitor's own stats) fills a :class:`TargetCounts`; :mod:`shadow.analysis.verdict`
decides on it."""

from __future__ import annotations

import dataclasses
import fnmatch
import math
from collections.abc import Iterable
from typing import Any

from shadow.core.calls.record import clusters
from shadow.core.model import contract
from shadow.core.model.observation import COMPARED_OUTCOMES, DIVERGENT_OUTCOMES, LEGACY, NONRESPONSE_REASONS

#: How clusters counted by the processes are formed, for the output.
COUNTED_CLUSTERS = "process x 60 s blocks, counted as compared"


def _series(metric: contract.Metric, doc: str) -> property:
    """A phase's counts of one of the verdict's series, as an attribute named for what it holds."""

    def get(self: PhaseCounts) -> dict:
        return self.of(metric)

    def put(self: PhaseCounts, table: dict) -> None:
        self.series[metric] = table

    return property(get, put, doc=doc)


def _scalar(metric: contract.Metric, doc: str) -> property:
    """A phase's count of one of the verdict's series kept by no label."""

    def get(self: PhaseCounts) -> float:
        return sum(self.of(metric).values())

    def put(self: PhaseCounts, value: float) -> None:
        self.series[metric] = {(): value}

    return property(get, put, doc=doc)


def key_of(values: tuple[str, ...]) -> Any:
    """A phase's key for a series' counts: the value of its one evidence label, else the tuple of them."""
    return values[0] if len(values) == 1 else values


@dataclasses.dataclass
class PhaseCounts:
    """The evidence of one phase (the side whose result the caller got): its counts of the verdict's series
    (:data:`shadow.core.model.contract.EVIDENCE`, each by its evidence labels), with what only some sources know
    (clusters of comparisons, divergences whose matches are not known, the truth runs' decades)."""

    #: {metric: {key: count}}: a key is the value of the metric's one evidence label, or the tuple of them in the
    #: order of :attr:`~shadow.core.model.contract.Metric.evidence` (:func:`key_of`).
    series: dict[contract.Metric, dict[Any, float]] = dataclasses.field(default_factory=dict)
    #: (compared, divergent) by cluster, where the source knows them (journals).
    clusters: dict[tuple, list[float]] = dataclasses.field(default_factory=dict)
    #: Divergent comparisons whose matches are not known (lines a process wrote after its last count record,
    #: without every outcome): they raise the upper bound (as comparisons that all diverged), never the lower.
    unmatched: dict[str, float] = dataclasses.field(default_factory=dict)
    #: Where some comparisons came without their clusters counted (an older process, lines after a process's last
    #: count record), so that :attr:`cluster_count` does not cover them all.
    clusters_missing: bool = False
    #: Float64 truth runs of value differences by (signature, decade of upstream's error over legacy's) where both
    #: errors were known (the journal's own).
    truth_decades: dict[tuple[str, int], float] = dataclasses.field(default_factory=dict)
    #: Gradient mismatches whose matches are not known (lines after a process's last count record, without every
    #: outcome).
    backward_unmatched: dict[str, float] = dataclasses.field(default_factory=dict)

    outcomes = _series(contract.COMPARISONS, "Comparisons by (signature, outcome).")
    reasons = _series(contract.MISMATCHES, "Mismatch reasons.")
    shared = _series(contract.SHARED_DIVERGENCES, "Shared divergences by reason.")
    skipped = _series(contract.SKIPPED, "Sampled calls not compared by (signature, reason).")
    calls = _series(contract.CALLS, 'Calls by signature ("" where calls are not by signature).')
    truth = _series(contract.TRUTH_RUNS, "Float64 truth runs of value differences by (signature, side nearer).")
    backward = _series(contract.BACKWARD_RUNS, "Backward comparisons by (signature, what they found).")
    noise = _series(
        contract.NOISE_CHECKS,
        'Runs judged against their signature\'s noise thresholds, by (evidence, pair, check): ("forward", "ab", '
        '"beyond") an A/B exceedance, ("forward", "aa", "beyond") legacy beyond its own threshold.',
    )
    cluster_count = _scalar(
        contract.CLUSTERS,
        "Clusters its processes counted where the comparisons happened (shadow.core.calls.record.clusters).",
    )
    call_blocks = _scalar(
        contract.CALL_BLOCKS,
        "The blocks of process time its calls fell in, counted as clusters are (compared or not): the most clusters "
        "comparing every call could have made (shadow.analysis.sooner); 0 where the source does not say.",
    )

    def of(self, metric: contract.Metric) -> dict[Any, float]:
        """The phase's counts of ``metric``, by key (:func:`key_of`)."""
        return self.series.setdefault(metric, {})

    def add(self, metric: contract.Metric, key: Any, count: float) -> None:
        """Add ``count`` to the phase's count of ``metric`` at ``key``."""
        table = self.of(metric)
        table[key] = table.get(key, 0) + count

    def by_signature(self, outcomes: Iterable[str]) -> dict[str, float]:
        found: dict[str, float] = {}
        for (signature, outcome), value in self.outcomes.items():
            if outcome in outcomes:
                found[signature] = found.get(signature, 0) + value
        return found

    @property
    def compared(self) -> float:
        return sum(v for (_, o), v in self.outcomes.items() if o in COMPARED_OUTCOMES)

    @property
    def divergent(self) -> float:
        return sum(v for (_, o), v in self.outcomes.items() if o in DIVERGENT_OUTCOMES)

    def skipped_by_reason(self) -> dict[str, float]:
        found: dict[str, float] = {}
        for (_, reason), value in self.skipped.items():
            found[reason] = found.get(reason, 0) + value
        return found

    def empty(self) -> bool:
        return not (self.compared or sum(self.calls.values()) or sum(self.skipped.values()) or self.unmatched)


@dataclasses.dataclass
class TargetCounts:
    """What a source knows about one target, by phase (primary side), and its rollbacks."""

    phases: dict[str, PhaseCounts] = dataclasses.field(default_factory=dict)
    #: How the clusters were formed, for the output ("process x 60 s blocks").
    clustering: str = ""
    #: A fire drill injected synthetic divergence into these sources: how many comparisons carry it (journals),
    #: or -1 where only that a drill was active is known (metrics).
    drilled: float = 0
    #: Comparisons of a fire drill that is over (clean comparisons came after it), set aside by its own marks: the
    #: clean evidence decides.
    drill_set_aside: float = 0
    #: Process time behind the evidence, every process together (seconds; 0 where the source does not say): the
    #: evidence rate "how much more running it takes" is said at.
    process_seconds: float = 0.0
    #: The processes behind the evidence, where the source knows them (0: not known: their time caps no clusters).
    processes: int = 0
    #: Rollbacks no person has reset since (who or what threw the switch, and when where known).
    rollbacks: list[str] = dataclasses.field(default_factory=list)
    #: Rollbacks and resets as metrics count them (a counter each, per process): a person reset every rollback
    #: where there are as many resets.
    counted_rollbacks: float = 0.0
    counted_resets: float = 0.0
    #: Resets, and the comparisons from before the last one that were set aside (not evidence any more).
    resets: list[str] = dataclasses.field(default_factory=list)
    set_aside: float = 0
    #: What the source says about its own completeness (unread siblings, processes without a final count).
    notes: list[str] = dataclasses.field(default_factory=list)
    #: The launcher's restart count where the source holds one moment of the run (a metrics file): its processes'
    #: counters began again at 0 after whatever they counted before, a rollback included (0: not restarted, or a
    #: source that holds the run's history).
    restarted: int = 0
    #: Where the source holds one moment of the run (a metrics file) and its processes began after the run did (a
    #: restart no launcher counted): the seconds of the run before them, which it cannot see (0: none, or unknown).
    unseen_before: float = 0.0

    def phase(self, primary: str = LEGACY) -> PhaseCounts:
        return self.phases.setdefault(primary, PhaseCounts())

    def blocks_allowed(self) -> float:
        """The most clusters a phase's evidence can hold: a cluster is a 60 s block of one process's time at least
        (:mod:`shadow.core.calls.record.clusters`), so the processes' time allows ``seconds / 60`` of them and a
        block begun in each process; inf where the source does not say how long its processes ran, or how many they
        were."""
        if self.process_seconds <= 0 or self.processes <= 0:
            return math.inf
        return self.process_seconds / clusters.WINDOW_SECONDS + max(1, self.processes)

    def add(self, metric: contract.Metric, labels: dict[str, str], count: float, primary: str = LEGACY) -> None:
        """One series of the verdict's (:data:`~shadow.core.model.contract.EVIDENCE`) as a source read it: its
        ``count`` in ``primary``'s phase, at the key its evidence labels give (a missing label: "")."""
        keys = contract.EVIDENCE[metric]
        self.phase(primary).add(metric, key_of(tuple(labels.get(name, "") for name in keys)), count)
        if metric is contract.CLUSTERS:
            self.clustering = self.clustering or COUNTED_CLUSTERS

    # (the series by what they hold, for the sources that count lines and the tests)
    def add_outcome(self, signature: str, outcome: str, count: float, primary: str = LEGACY) -> None:
        self.phase(primary).add(contract.COMPARISONS, (signature, outcome), count)

    def add_reason(self, reason: str, count: float, primary: str = LEGACY) -> None:
        self.phase(primary).add(contract.MISMATCHES, reason, count)

    def add_shared(self, reason: str, count: float, primary: str = LEGACY) -> None:
        self.phase(primary).add(contract.SHARED_DIVERGENCES, reason, count)

    def add_skip(self, reason: str, count: float, primary: str = LEGACY, signature: str = "") -> None:
        self.phase(primary).add(contract.SKIPPED, (signature, reason), count)

    def add_truth(self, signature: str, nearer: str, count: float, primary: str = LEGACY) -> None:
        self.phase(primary).add(contract.TRUTH_RUNS, (signature, nearer), count)

    def add_truth_decade(self, signature: str, decade: int, count: float, primary: str = LEGACY) -> None:
        phase = self.phase(primary)
        phase.truth_decades[(signature, decade)] = phase.truth_decades.get((signature, decade), 0) + count

    def add_backward(self, signature: str, found: str, count: float, primary: str = LEGACY) -> None:
        """Backward comparisons of a signature that found ``found`` (match or mismatch)."""
        self.phase(primary).add(contract.BACKWARD_RUNS, (signature, found), count)

    def add_noise(self, evidence: str, pair: str, check: str, count: float, primary: str = LEGACY) -> None:
        """Runs of ``evidence`` (forward, gradients) judged against their noise thresholds: ``pair`` ab or aa,
        ``check`` within or beyond."""
        self.phase(primary).add(contract.NOISE_CHECKS, (evidence, pair, check), count)

    def add_calls(self, signature: str, count: float, primary: str = LEGACY) -> None:
        self.phase(primary).add(contract.CALLS, signature, count)

    def add_clusters(self, count: float, primary: str = LEGACY) -> None:
        """Clusters counted where the comparisons happened (:mod:`shadow.core.calls.record.clusters`)."""
        self.add(contract.CLUSTERS, {}, count, primary)

    def add_call_blocks(self, count: float, primary: str = LEGACY) -> None:
        """Blocks of process time the calls fell in (:meth:`shadow.core.calls.record.clusters.Clusters.called`)."""
        self.phase(primary).add(contract.CALL_BLOCKS, (), count)

    def clusters_not_counted(self, primary: str = LEGACY) -> None:
        """Some of the phase's comparisons came without their clusters counted."""
        self.phase(primary).clusters_missing = True

    def add_to_cluster(self, cluster: tuple, compared: float, divergent: float, primary: str = LEGACY) -> None:
        counts = self.phase(primary).clusters.setdefault(cluster, [0.0, 0.0])
        counts[0] += compared
        counts[1] += divergent

    @property
    def compared(self) -> int:
        return round(sum(p.compared for p in self.phases.values()))

    def empty(self) -> bool:
        """Whether no phase holds evidence (comparisons, calls, skips, gradient comparisons)."""
        return all(p.empty() and not p.backward and not p.backward_unmatched for p in self.phases.values())

    @property
    def divergent(self) -> int:
        return round(sum(p.divergent for p in self.phases.values()))

    def never_called(self, pattern: str) -> bool:
        """Whether the evidence knows that no call of a signature matching ``pattern`` was made: calls are counted
        by signature here (a guided target's) and none of them, compared or skipped, matches."""
        phases = self.phases.values()
        if not any(signature for p in phases for signature in p.calls):
            return False  # (calls not by signature: whether it was called is not known)
        seen = [s for p in phases for s, v in p.calls.items() if v > 0]
        seen += [s for p in phases for (s, _), v in p.outcomes.items() if v > 0]
        seen += [s for p in phases for (s, _), v in p.skipped.items() if v > 0]
        return not any(fnmatch.fnmatchcase(s, pattern) for s in seen)

    def taken_matching(self, pattern: str) -> list[str]:
        """The signatures matching ``pattern`` the evidence saw taken: with calls, comparisons or skips."""
        phases = self.phases.values()
        seen = {s for p in phases for s, v in p.calls.items() if v > 0}
        seen |= {s for p in phases for (s, _), v in p.outcomes.items() if v > 0}
        seen |= {s for p in phases for (s, _), v in p.skipped.items() if v > 0}
        return sorted(s for s in seen if s and fnmatch.fnmatchcase(s, pattern))

    def compared_of(self, signature: str) -> int:
        """Comparisons, in every phase, of ``signature`` itself."""
        return round(
            sum(
                v
                for p in self.phases.values()
                for (s, o), v in p.outcomes.items()
                if s == signature and o in COMPARED_OUTCOMES
            )
        )

    def compared_matching(self, pattern: str) -> int:
        """Comparisons, in every phase, of the signatures matching ``pattern``."""
        return round(
            sum(
                v
                for p in self.phases.values()
                for (s, o), v in p.outcomes.items()
                if o in COMPARED_OUTCOMES and fnmatch.fnmatchcase(s, pattern)
            )
        )


def from_stats(stats: Any, primary: str = LEGACY) -> TargetCounts:
    """A monitor's counts of one target (:class:`~shadow.core.model.observation.TargetStats`) as the verdict reads
    them: its outcomes (one stratum), their reasons and its runs judged against noise thresholds, in ``primary``'s
    phase. (A process's own look at its evidence: without clusters, each comparison one.)"""
    counts = TargetCounts()
    for outcome in COMPARED_OUTCOMES:
        if getattr(stats, outcome):
            counts.add_outcome("", outcome, getattr(stats, outcome), primary)
    for reason, value in stats.by_reason.items():
        if reason not in NONRESPONSE_REASONS and reason != "budget":
            counts.add_reason(reason, value, primary)
    for key, value in stats.noise_checks.items():
        counts.add_noise(*key.split("/"), value, primary)
    return counts
