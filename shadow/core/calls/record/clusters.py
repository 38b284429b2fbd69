"""Clusters of comparisons: the unit the verdict counts evidence in, counted where the comparisons happen.

Comparisons of one process share its steps, batches and state: they are not independent trials. The verdict
(``shadow.analysis.verdict``) scales a phase's comparisons to ``C`` effective ones, C its clusters, as if everything
inside a cluster were one trial (conservative: the design effect of a cluster sample is at most its cluster size,
Kish, *Survey Sampling*, 1965, 5.4). A cluster is a block of :data:`WINDOW_SECONDS` of one process's time, counted
from its first comparison in that phase on the monotonic clock (a wall clock that jumps makes no clusters), and a
block that ends in divergence runs on while the divergence does (an incident is never cut in two).

The ranks of one distributed job step together over the same steps, often over the same inputs: a block of the
job is one cluster however many ranks compare in it. Each rank's block counts as ``1 / W`` of a cluster
(:func:`cluster_share`), ``W`` the job's number of ranks, so ``W`` ranks in lockstep count the clusters of one rank.
This is conservative where the ranks see different data (their evidence counts as one rank's), never generous where
they see the same, and it comes from the job, not from a setting a person could turn. ``W`` is read from whichever
launcher started the job (:data:`WORLD_SIZE_VARIABLES`: torchrun, Slurm's srun, Open MPI, MPICH and Intel MPI,
MVAPICH) and, where none says (``torch.multiprocessing.spawn`` sets nothing), from ``torch.distributed`` once the
job has started its process group (:func:`distributed_share`, asked as each cluster opens).

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
#: The variables a launcher sets to the job's number of ranks, in the order they are read: torchrun's (and
#: torch.distributed's env:// launchers'), Slurm's srun, Open MPI's mpirun, MPICH's and Intel MPI's (PMI), MVAPICH's.
WORLD_SIZE_VARIABLES = ("WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE")


def cluster_share(environ: Mapping[str, str] = os.environ) -> float | None:
    """The share of a cluster one block of this process counts as: ``1 / W`` for the first of
    :data:`WORLD_SIZE_VARIABLES` set; None where none is (then :func:`distributed_share` decides). Raises ValueError
    naming the variable where it is set and is not a whole number of ranks >= 1."""
    for variable in WORLD_SIZE_VARIABLES:
        text = environ.get(variable, "").strip()
        if not text:
            continue
        try:
            ranks = int(text)
        except ValueError:
            ranks = 0
        if ranks < 1:
            raise ValueError(f"{variable}={text!r} is not a number of ranks (a whole number >= 1)")
        return 1.0 / ranks
    return None


def distributed_share() -> float:
    """``1 / W`` where this process belongs to an initialized ``torch.distributed`` process group of ``W`` ranks
    (``torch.multiprocessing.spawn`` and launchers that set no variable), else 1. Never imports torch."""
    import sys

    distributed = sys.modules.get("torch.distributed")
    try:
        if distributed is not None and distributed.is_available() and distributed.is_initialized():
            return 1.0 / max(int(distributed.get_world_size()), 1)
    except Exception:  # (a group being torn down: counted as a process of its own)
        return 1.0
    return 1.0


class Clusters:
    """One process's clusters, by phase (the side whose result the caller got). Not thread-safe: the engine calls
    it under its lock."""

    def __init__(self, window: float = WINDOW_SECONDS, share: float | None = 1.0) -> None:
        self.window = window
        #: What one block of this process counts as, where a launcher's variable says (:func:`cluster_share`);
        #: None: asked of torch.distributed as each cluster opens (:attr:`share`).
        self.fixed_share = share
        #: What the cluster opened last counted as.
        self.opened_share = 1.0
        self.count = 0.0  # (clusters opened, every phase together, each ``share``)
        self._phases: dict[str, list] = {}  # phase -> [origin, current block, last comparison diverged]
        self._called: dict[str, list] = {}  # phase -> [origin, current block] of the blocks its calls fell in
        #: What the last comparison counted as among the blocks of its phase's calls (:meth:`called`), else 0.
        self.call_block_opened = 0.0

    @property
    def share(self) -> float:
        """What a block of this process counts as now."""
        return self.fixed_share if self.fixed_share is not None else distributed_share()

    def opens(self, phase: str, divergent: bool, now: float | None = None) -> bool:
        """Whether a comparison of ``phase`` (``divergent`` or not) made ``now`` (monotonic seconds) opens a new
        cluster."""
        now = time.monotonic() if now is None else now
        self.call_block_opened = self.called(phase, now)  # (a comparison is a call: its block is one the calls fell in)
        state = self._phases.get(phase)
        if state is None:
            self._phases[phase] = [now, 0, divergent]
            self.opened_share = self.share
            self.count += self.opened_share
            return True
        origin, block, diverging = state
        here = int((now - origin) // self.window) if self.window > 0 else 0
        opened = here != block and not (diverging and divergent)
        if opened:
            state[1] = here
            self.opened_share = self.share
            self.count += self.opened_share
        state[2] = divergent
        return opened

    def called(self, phase: str, now: float | None = None) -> float:
        """Calls of ``phase`` were made by ``now`` (monotonic seconds; reported each second and at each comparison):
        the share of a block this counts as where it is the first of a block of the phase's calls, else 0. The
        blocks the target's calls fell in are the most clusters comparing every call could make (rank shares
        included): what ``--gather`` can add to the evidence (:mod:`shadow.analysis.sooner`)."""
        now = time.monotonic() if now is None else now
        state = self._called.get(phase)
        if state is None:
            self._called[phase] = [now, 0]
            return self.share
        here = int((now - state[0]) // self.window) if self.window > 0 else 0
        if here == state[1]:
            return 0.0
        state[1] = here
        return self.share

    def clear(self) -> None:
        """Forget every phase (a forked child's comparisons are its own process's)."""
        self._phases.clear()
        self._called.clear()
        self.count = 0.0
