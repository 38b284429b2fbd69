"""What would reach a decision sooner: which settings add evidence to an inconclusive phase, and by how much.

The verdict counts a phase's evidence in clusters: a process's blocks of
:data:`~shadow.core.calls.record.clusters.WINDOW_SECONDS` (60 s), one cluster however many comparisons a block holds.
A phase's evidence therefore grows at most 60 clusters per process-hour, and sampling more of a target's calls adds
evidence only where some blocks now go without a comparison. With its calls spread over process time at ``c`` per
process-hour (a Poisson stream: the share of 60 s blocks holding at least one is ``1 - exp(-c / 60)``), comparing
every call fills at most ``60 (1 - exp(-c / 60))`` blocks an hour. Where that is well above the clusters seen per
process-hour, comparing more of the calls (``npu-shadow run --gather``, or ``--sample-rate TARGET=1`` with a budget
that lets them run) is sooner by their ratio; where it is not, only more process time adds evidence (more ranks or
jobs in parallel shorten the wall time, not the process-hours).
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


def sooner(target: str, more: float, cluster_count: float, calls: float, process_seconds: float) -> str:
    """The line that says what would bring ``more`` clusters sooner, for a phase with ``cluster_count`` clusters over
    ``calls`` calls in ``process_seconds`` of process time; "" where the source does not say how long its evidence
    took."""
    if not (math.isfinite(more) and more > 0 and cluster_count > 0 and calls > 0 and process_seconds > 0):
        return ""
    hours = max(process_seconds, cluster_count * clusters.WINDOW_SECONDS) / 3600
    now, reachable = cluster_count / hours, blocks_per_hour(calls / hours)
    if reachable >= WORTH * now:
        return (
            f"sooner: comparing every call of {target} (npu-shadow run --gather, or --sample-rate {target}=1) fills "
            f"up to {reachable:,.3g} of the 60 s blocks a process-hour that count as evidence ({now:,.3g} now): about "
            f"{more / reachable:,.3g} more process-hours instead of {more / now:,.3g}"
        )
    return (
        f"sooner: no setting; its comparisons already fill the 60 s blocks its calls reach ({now:,.3g} a "
        "process-hour, and a block counts once however many comparisons it holds): only more process time adds "
        "evidence (more ranks or jobs in parallel shorten the wait, not the process-hours)"
    )
