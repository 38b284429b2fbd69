"""What would reach a decision sooner: which settings add evidence to an inconclusive phase, and by how much.

The verdict counts a phase's evidence in clusters: a process's blocks of
:data:`~shadow.core.calls.record.clusters.WINDOW_SECONDS` (60 s), one cluster however many comparisons a block holds,
a distributed job's rank counting ``1 / W`` of each (ranks in lockstep are one rank's evidence). Sampling more of a
target's calls adds evidence only where some blocks its calls fell in now go without a comparison. The processes
count those blocks too, alike (``npu_shadow_call_blocks_total``, a count record's ``call_blocks``: the blocks of
process time in which the target was called, compared or not, each a rank's share), so comparing every call
(``npu-shadow run --gather``, or ``--sample-rate TARGET=1`` with a budget that lets them run) would bring the
evidence at most ``call_blocks / clusters`` times as fast: exact for the evidence's own calls, however they fall
(8 ranks in lockstep that compare in every block they call in: 1; calls in hourly bursts: the blocks the bursts
fill; a Poisson stream: the share of blocks it reaches). Where the sources do not count call blocks (evidence from
before they were counted), the gain is estimated as for a Poisson stream of the calls over the process time: at
``c`` calls per process-hour, ``60 (1 - exp(-c / 60))`` blocks an hour hold one. Where the gain is small, only more
process time adds evidence (more ranks or jobs in parallel shorten the wall time, not the process-hours).
"""

from __future__ import annotations

import math

from shadow.core.calls.record import clusters

#: Say a setting is sooner only where it would be at least this much faster.
WORTH = 1.2


def blocks_per_hour(calls_per_hour: float) -> float:
    """The 60 s blocks per process-hour that hold at least one of ``calls_per_hour`` calls (a Poisson stream)."""
    blocks = 3600 / clusters.WINDOW_SECONDS
    return blocks * -math.expm1(-calls_per_hour / blocks)


def sooner(
    target: str, more: float, cluster_count: float, calls: float, process_seconds: float, call_blocks: float = 0.0
) -> str:
    """The line that says what would bring ``more`` clusters sooner, for a phase with ``cluster_count`` clusters over
    ``calls`` calls in ``process_seconds`` of process time, its calls in ``call_blocks`` blocks (0: not counted by
    the source); "" where the source does not say how long its evidence took."""
    if not (math.isfinite(more) and more > 0 and cluster_count > 0 and calls > 0 and process_seconds > 0):
        return ""
    hours = max(process_seconds, cluster_count * clusters.WINDOW_SECONDS) / 3600
    now = cluster_count / hours
    reachable = reachable_per_hour(cluster_count, calls, hours, call_blocks)
    how = "" if call_blocks > 0 else " (estimated as for calls spread evenly: these sources do not count call blocks)"
    if reachable >= WORTH * now:
        return (
            f"sooner: comparing every call of {target} (npu-shadow run --gather, or --sample-rate {target}=1) fills "
            f"up to {reachable:,.3g} of the 60 s blocks a process-hour that count as evidence ({now:,.3g} now){how}: "
            f"about {more / reachable:,.3g} more process-hours instead of {more / now:,.3g}"
        )
    return (
        f"sooner: no setting; its comparisons already fill the 60 s blocks its calls reach ({now:,.3g} of "
        f"{reachable:,.3g} a process-hour{how}, and a block counts once however many comparisons it holds): only more "
        "process time adds evidence (more ranks or jobs in parallel shorten the wait, not the process-hours)"
    )


def reachable_per_hour(cluster_count: float, calls: float, hours: float, call_blocks: float = 0.0) -> float:
    """The clusters a process-hour could bring with every call compared: the blocks the calls fell in, where the
    source counts them (``call_blocks``), else a Poisson stream's estimate (:func:`blocks_per_hour`); never fewer
    than the clusters seen."""
    if call_blocks > 0:
        return max(call_blocks, cluster_count) / hours
    return max(blocks_per_hour(calls / hours), cluster_count / hours)
