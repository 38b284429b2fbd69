"""What one installed target counted: the one record a forked child starts again, whole."""

from __future__ import annotations

import collections
import dataclasses

from shadow.core.calls.record import clusters as clustering
from shadow.core.model.observation import DIVERGENT_OUTCOMES, Observation, Outcome


def _counter() -> collections.Counter[str]:
    return collections.Counter()


@dataclasses.dataclass
class Tally:
    """One target's counts (read and written under its experiment's lock).

    Attributes:
        outcomes: observations published, by outcome (skips included).
        reasons: their reasons (a comparison may have several; skips' reasons too).
        shared: divergences legacy and upstream share (the single-device oracle's finding), by reason.
        oracle_runs, backward_runs, backward_skips, truth_runs: the extra runs made (and the backward comparisons
            that could not be made, by reason; the truth runs by which side was nearer).
        clusters: the process's clusters of comparisons (:mod:`shadow.core.calls.record.clusters`).
        drilled: comparisons a fire drill corrupted.
        signatures_over_cap: calls whose signature counted as "other" (past the cap).
        export_errors: exporters that failed to export an observation.
        settings_failures: torch's global settings that could not be taken or put back.
        skips_unreported: sampled calls skipped in bulk (budget, deadline) since the last report.
        calls_reported: the calls reported to the exporters so far, by signature (under "" where not guided).
    """

    cluster_share: float = 1.0
    outcomes: collections.Counter[str] = dataclasses.field(default_factory=_counter)
    reasons: collections.Counter[str] = dataclasses.field(default_factory=_counter)
    shared: collections.Counter[str] = dataclasses.field(default_factory=_counter)
    oracle_runs: int = 0
    backward_runs: int = 0
    backward_skips: collections.Counter[str] = dataclasses.field(default_factory=_counter)
    truth_runs: collections.Counter[str] = dataclasses.field(default_factory=_counter)
    clusters: clustering.Clusters = dataclasses.field(init=False)
    drilled: int = 0
    signatures_over_cap: int = 0
    export_errors: int = 0
    settings_failures: int = 0
    skips_unreported: collections.Counter[str] = dataclasses.field(default_factory=_counter)
    calls_reported: dict[str, int] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        # (the window as it is now, not as it was at import: a test sets it)
        self.clusters = clustering.Clusters(clustering.WINDOW_SECONDS, self.cluster_share)

    def fresh(self) -> Tally:
        """A tally at zero with the same cluster share (a forked child's)."""
        return Tally(self.cluster_share)

    def count(self, observation: Observation) -> Observation:
        """Count a published observation; returned with its cluster share where it opens a cluster."""
        if observation.outcome != Outcome.SKIPPED.value and self.clusters.opens(
            observation.primary, observation.outcome in DIVERGENT_OUTCOMES
        ):
            observation = dataclasses.replace(observation, cluster_share=self.clusters.share)
        self.drilled += observation.drill
        self.outcomes[observation.outcome] += 1
        self.reasons.update(observation.reasons)
        if observation.shared_divergence:
            self.shared[observation.shared_divergence] += 1
        self.backward_runs += observation.backward
        if observation.backward_skip:
            self.backward_skips[observation.backward_skip] += 1
        if observation.nearer:
            self.truth_runs[observation.nearer] += 1
        return observation

    def skip_in_bulk(self, reason: str) -> None:
        """A sampled call skipped without an observation of its own (reported with the next report)."""
        self.outcomes[Outcome.SKIPPED.value] += 1
        self.reasons[reason] += 1
        self.skips_unreported[reason] += 1

    def take_unreported_skips(self) -> collections.Counter[str]:
        """The skips in bulk since the last report, and none from now."""
        skipped, self.skips_unreported = self.skips_unreported, collections.Counter()
        return skipped
