"""Clusters of comparisons: the unit the verdict counts evidence in, counted where the comparisons happen.

Comparisons of one process share its steps, batches and state: they are not independent trials. The verdict
(``shadow.analysis.verdict``) scales a phase's comparisons to ``C`` effective ones, C its clusters, as if everything
inside a cluster were one trial (conservative: the design effect of a cluster sample is at most its cluster size,
Kish, *Survey Sampling*, 1965, 5.4). A cluster is a block of :data:`WINDOW_SECONDS` of one process's time, counted
from its first comparison in that phase on the monotonic clock (a wall clock that jumps makes no clusters), and a
block that ends in divergence runs on while the divergence does (an incident is never cut in two).

The ranks of one distributed job step together over the same steps, often over the same inputs: a block of the
job is one cluster however many ranks compare in it. Each rank's block counts as ``1 / WORLD_SIZE`` of a cluster
(:func:`cluster_share`), so ``W`` ranks in lockstep count the clusters of one rank. This is conservative where the
ranks see different data (their evidence counts as one rank's), never generous where they see the same, and it
comes from the job, not from a setting a person could turn.

The count is made here, once, and every exporter carries it (the ``clusters`` of journal count records, the
``npu_shadow_clusters_total`` counter), so that the verdict finds the same clusters in Prometheus, a metrics file
and the journals of one run.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping

#: The length of a cluster's block of process time.
WINDOW_SECONDS = 60.0
#: The variable torchrun (and torch.distributed's env:// launchers) sets to the job's number of ranks.
WORLD_SIZE_VARIABLE = "WORLD_SIZE"


def cluster_share(environ: Mapping[str, str] = os.environ) -> float:
    """The share of a cluster one block of this process counts as: ``1 / WORLD_SIZE`` (1 outside a distributed
    job). Raises ValueError naming the variable where it is set and is not a whole number of ranks >= 1."""
    text = environ.get(WORLD_SIZE_VARIABLE, "").strip()
    if not text:
        return 1.0
    try:
        ranks = int(text)
    except ValueError:
        ranks = 0
    if ranks < 1:
        raise ValueError(f"{WORLD_SIZE_VARIABLE}={text!r} is not a number of ranks (a whole number >= 1)")
    return 1.0 / ranks


class Clusters:
    """One process's clusters, by phase (the side whose result the caller got). Not thread-safe: the engine calls
    it under its lock."""

    def __init__(self, window: float = WINDOW_SECONDS, share: float = 1.0) -> None:
        self.window = window
        #: What one block of this process counts as (:func:`cluster_share`).
        self.share = share
        self.count = 0.0  # (clusters opened, every phase together, each ``share``)
        self._phases: dict[str, list] = {}  # phase -> [origin, current block, last comparison diverged]

    def opens(self, phase: str, divergent: bool, now: float | None = None) -> bool:
        """Whether a comparison of ``phase`` (``divergent`` or not) made ``now`` (monotonic seconds) opens a new
        cluster."""
        now = time.monotonic() if now is None else now
        state = self._phases.get(phase)
        if state is None:
            self._phases[phase] = [now, 0, divergent]
            self.count += self.share
            return True
        origin, block, diverging = state
        here = int((now - origin) // self.window) if self.window > 0 else 0
        opened = here != block and not (diverging and divergent)
        if opened:
            state[1] = here
            self.count += self.share
        state[2] = divergent
        return opened

    def clear(self) -> None:
        """Forget every phase (a forked child's comparisons are its own process's)."""
        self._phases.clear()
        self.count = 0.0
