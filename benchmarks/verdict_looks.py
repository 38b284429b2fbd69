"""How often the verdict errs when it is read again and again: false promotes at the max rate, and wrong rollbacks
over a week of hourly looks, with its recent windows (the last hour, 15 and 5 minutes).

Every look is decided by ``shadow.analysis.verdict.decide`` itself, on counts as the sources give them (the
whole history and each recent window, its clusters counted as a distributed job's ranks count them).

- **False promotes.** A job of 4 ranks in lockstep (each rank's minute a quarter of a cluster, 10 comparisons),
  its true divergence rate at the max rate, read every 400 minutes up to 8,000 clusters: the share of jobs ever
  promoted (goal: at most 5%, the bound's level). A job at a tenth of the max rate is promoted too, in most runs:
  the check that the simulation can promote at all.
- **Wrong rollbacks.** An honest job (100 processes, one cluster each a minute, one comparison in each: the
  least a cluster scales down) at the max rate, and at half of it, read every hour for a week: the share of weeks
  in which some recent window rolled it back although its rate never exceeded the max; beside it the rule before
  the shorter windows (the last hour alone, at level 0.05).

Run: ``python benchmarks/verdict_looks.py [--quick]``.
"""

from __future__ import annotations

import argparse
import functools
import math

import numpy as np

from shadow.analysis import decisions, evidence, verdict


def _counts(k: int, n: int, clusters: float) -> evidence.TargetCounts:
    found = evidence.TargetCounts()
    found.add_outcome("s", "match", n - k)
    found.add_outcome("s", "mismatch", k)
    found.add_calls("s", n)
    found.add_clusters(clusters)
    return found


def _windows() -> list[int]:
    """The recent windows, in minutes, of ``--recent`` as the verdict takes it by default."""
    return [round(seconds / 60) for seconds in verdict.recent_windows(decisions.RECENT_SECONDS)]


def false_promotes(sequences: int, rate_of_max: float = 1.0, seed: int = 39) -> float:
    """The share of ``sequences`` jobs at ``rate_of_max`` x the max rate that some look promoted."""
    max_rate, ranks, per_rank_minute = 0.01, 4, 10
    look_every, looks = 400, 8_000 // 400  # (minutes: a cluster a minute, 8,000 clusters)
    per_minute = ranks * per_rank_minute
    rng = np.random.default_rng(seed)
    windows = _windows()

    @functools.cache
    def whole(k: int, minutes: int) -> str:
        phase = _counts(k, minutes * per_minute, minutes).phase()
        return verdict.decide_phase("legacy", phase, max_rate, explain=False).decision

    @functools.cache
    def window(k: int, minutes: int) -> str:
        return verdict.decide_slice(verdict.recent_slice(60 * minutes), _counts(k, minutes * per_minute, minutes),
                                    max_rate).decision  # fmt: skip

    promoted = 0
    for _ in range(sequences):
        divergent = rng.binomial(per_minute, rate_of_max * max_rate, size=looks * look_every).cumsum()
        for look in range(1, looks + 1):
            end = look * look_every
            if whole(int(divergent[end - 1]), end) != verdict.PROMOTE:
                continue
            held = False
            for length in windows:
                if length < end:
                    k = int(divergent[end - 1] - divergent[end - 1 - length])
                    held = held or window(k, length) != verdict.PROMOTE
            if not held:
                promoted += 1
                break
    return promoted / sequences


def wrong_rollbacks(weeks: int, rate_of_max: float, before: bool = False, seed: int = 7) -> float:
    """The share of ``weeks`` of hourly looks at an honest job (true rate ``rate_of_max`` x the max rate) in which
    a recent window rolled it back; ``before``: with the rule before the shorter windows (the last hour at 0.05)."""
    max_rate, processes, per_minute, minutes = 0.001, 100, 1, 7 * 24 * 60
    rng = np.random.default_rng(seed)
    windows = [60] if before else _windows()

    @functools.cache
    def rolls_back(k: int, length: int) -> bool:
        counts = _counts(k, length * processes * per_minute, length * processes)
        name = "the hour, at 0.05" if before else verdict.recent_slice(60 * length)  # (a run's level: 0.05)
        return verdict.decide_slice(name, counts, max_rate).decision == verdict.ROLLBACK

    wrong = 0
    for _ in range(weeks):
        divergent = np.concatenate(
            [[0], rng.binomial(processes * per_minute, rate_of_max * max_rate, size=minutes).cumsum()]
        )
        if any(
            rolls_back(int(divergent[end] - divergent[end - length]), length)
            for end in range(60, minutes + 1, 60)
            for length in windows
        ):
            wrong += 1
    return wrong / weeks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer sequences (a coarser figure)")
    args = parser.parse_args()
    sequences, weeks = (300, 100) if args.quick else (2_000, 1_000)
    promotes = false_promotes(sequences)
    error = 3 * math.sqrt(0.05 * 0.95 / sequences)
    print(
        f"false promotes at the max rate, read every 400 minutes up to 8,000 clusters with the recent windows "
        f"{_windows()} min: {promotes:.2%} of {sequences:,} jobs (goal <= 5%, +{error:.1%} Monte Carlo at 3 sigma)"
    )
    print(f"promotes at a tenth of the max rate (the check that it can): {false_promotes(sequences, 0.1):.2%}")
    print(f"promotes at half the max rate: {false_promotes(sequences, 0.5):.2%}")
    for rate_of_max in (1.0, 0.5):
        now, before = wrong_rollbacks(weeks, rate_of_max), wrong_rollbacks(weeks, rate_of_max, before=True)
        print(
            f"wrong rollbacks over a week of hourly looks, honest job at {rate_of_max:g}x the max rate (100 "
            f"processes, a comparison a cluster-minute): {now:.2%} of {weeks:,} weeks (the last hour alone at 0.05: "
            f"{before:.2%})"
        )
    print(f"rollbacks within a week at 3x the max rate (the check that it can): {wrong_rollbacks(weeks, 3.0):.2%}")


if __name__ == "__main__":
    main()
