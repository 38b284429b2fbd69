"""Clusters of comparisons: the unit the verdict counts evidence in, counted where the comparisons happen.

Comparisons of one process share its steps, batches and state: they are not independent trials. The verdict
(``shadow.analysis.verdict``) scales a phase's comparisons to ``C`` effective ones, C its clusters, as if everything
inside a cluster were one trial (conservative: the design effect of a cluster sample is at most its cluster size,
Kish, *Survey Sampling*, 1965, 5.4). A cluster is a block of :data:`WINDOW_SECONDS` of one process's time, counted
from its first comparison in that phase on the monotonic clock (a wall clock that jumps makes no clusters), and a
block that ends in divergence runs on while the divergence does (an incident is never cut in two).

The count is made here, once, and every exporter carries it (the ``clusters`` of journal count records, the
``npu_shadow_clusters_total`` counter), so that the verdict finds the same clusters in Prometheus, a metrics file
and the journals of one run.
"""

from __future__ import annotations

import time

#: The length of a cluster's block of process time.
WINDOW_SECONDS = 60.0


class Clusters:
    """One process's clusters, by phase (the side whose result the caller got). Not thread-safe: the engine calls
    it under its lock."""

    def __init__(self, window: float = WINDOW_SECONDS) -> None:
        self.window = window
        self.count = 0  # (clusters opened, every phase together)
        self._phases: dict[str, list] = {}  # phase -> [origin, current block, last comparison diverged]

    def opens(self, phase: str, divergent: bool, now: float | None = None) -> bool:
        """Whether a comparison of ``phase`` (``divergent`` or not) made ``now`` (monotonic seconds) opens a new
        cluster."""
        now = time.monotonic() if now is None else now
        state = self._phases.get(phase)
        if state is None:
            self._phases[phase] = [now, 0, divergent]
            self.count += 1
            return True
        origin, block, diverging = state
        here = int((now - origin) // self.window) if self.window > 0 else 0
        opened = here != block and not (diverging and divergent)
        if opened:
            state[1] = here
            self.count += 1
        state[2] = divergent
        return opened

    def clear(self) -> None:
        """Forget every phase (a forked child's comparisons are its own process's)."""
        self._phases.clear()
        self.count = 0
