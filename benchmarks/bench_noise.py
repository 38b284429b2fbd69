"""What the verdict decides under a device's noise: how often it promotes, rolls back or stays inconclusive, and the
detection limit it states, where both sides of every comparison jitter with a heavy tail and upstream is really
wrong on a fraction of the calls.

Each comparison's error is a draw of the jitter: lognormal(0, sigma) times 1e-4 (the A/A runs' and the honest A/B
calls' alike, both sides jittering); on a wrong call upstream's error is ``size`` times its draw. Every call is judged
by the tool's own noise floor (``shadow.core.judging.noise.NoiseFloor``: the burn-in, an A/A run on every call until
it ends, its thresholds, the checks); the calls before a signature's burn-in ends are held (up to
``record.held.MAX_PENDING``, the rest skipped as ``noise_pending``, as the engine does) and judged when it ends; and
every look is decided by ``shadow.analysis.verdict.decide_phase`` itself, each comparison its own cluster. A run
ends at its first decisive look (promote or rollback: the decision a rollout acts on), looking every 500 calls up to
20,000.

Columns: sigma, A/A rate (the launcher's default 0.05, or 1), the real divergence (rate and size; 0: honest), then
the share of runs promoted, rolled back, inconclusive at the end, the median detection limit stated at the end, and
whether the divergence is above the limit the tool states (its size at least the stated size limit: the threshold
over the median A/A error, and its rate at least twice the max rate and above the stated detection limit).

Goals: (a) wherever a divergence is above the stated limit, promotes <= 5%; (b) at sigma 1.5 and the defaults, 20x on
1% and 5% of calls never promoted; (c) honest runs roll back <= 5%; (d) honest runs promote >= 80% wherever the
stated limit is below the max rate (at sigma 0.5 with --aa-rate 1 it is).

Run: ``python benchmarks/bench_noise.py [--quick] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shadow.analysis import decisions, evidence, verdict
from shadow.core.calls.record.held import MAX_PENDING
from shadow.core.judging import noise

MAX_RATE = decisions.DEFAULT_MAX_RATE
SIGMAS = (0.5, 1.0, 1.5)
AA_RATES = (0.05, 1.0)
RATES = (0.001, 0.01, 0.05)
SIZES = (2.0, 20.0, 1000.0)
LOOK_EVERY, CALLS = 500, 20_000
SCALE = 1e-4


def _phase(counts: dict[str, float]) -> evidence.PhaseCounts:
    """The phase's counts as a source gives them: one signature, each comparison its own cluster."""
    phase = evidence.PhaseCounts()
    compared = counts["match"] + counts["noise"] + counts["mismatch"]
    phase.outcomes = {("call", "match"): counts["match"], ("call", "noise"): counts["noise"],
                      ("call", "mismatch"): counts["mismatch"]}  # fmt: skip
    phase.reasons = {"value": counts["mismatch"]}
    phase.skipped = {("call", "noise_pending"): counts["skipped"]} if counts["skipped"] else {}
    phase.calls = {"call": counts["calls"]}
    phase.cluster_count = compared
    phase.noise = {key: counts[key] for key in _NOISE_KEYS if counts[key]}
    return phase


_NOISE_KEYS = [("forward", pair, check) for pair in noise.PAIRS for check in noise.CHECKS]


def one_run(sigma: float, aa_rate: float, rate: float, size: float, seed: int) -> tuple[str, float, float, int]:
    """(the first decisive decision, or inconclusive; the detection limit stated at that look; the stated size limit
    in times the jitter's median; the look it came at, in calls)."""
    rng = np.random.default_rng(seed)
    floor = noise.NoiseFloor()
    counts: dict = {"match": 0.0, "noise": 0.0, "mismatch": 0.0, "skipped": 0.0, "calls": 0.0}
    counts.update({key: 0.0 for key in _NOISE_KEYS})
    held: list[float] = []
    jitter = SCALE * rng.lognormal(0.0, sigma, size=(CALLS, 2))
    wrong = rng.random(CALLS) < rate
    aa_drawn = rng.random(CALLS) < aa_rate
    errors = np.where(wrong, size * jitter[:, 0], jitter[:, 0])
    decision, limit = verdict.INCONCLUSIVE, math.inf

    def judge(error: float) -> None:
        check, _ = floor.judge("call", [("", error)])
        if check == noise.BEYOND:
            counts["mismatch"] += 1
        else:
            counts["noise" if error > 0 else "match"] += 1
        if check in noise.CHECKS:
            counts[("forward", "ab", check)] += 1

    for call in range(CALLS):
        counts["calls"] += 1
        if aa_drawn[call] or floor.burning("call"):  # (as the engine draws it: every call until the burn-in ends)
            check = floor.add_aa("call", [("", float(jitter[call, 1]))], 0.0, True)
            if check:
                counts[("forward", "aa", check)] += 1
            if held and floor.judge("call", [("", 1.0)])[0] != noise.PENDING:
                for error in held:
                    judge(error)
                held.clear()
        error = float(errors[call])
        if floor.judge("call", [("", error)])[0] == noise.PENDING:
            if len(held) < MAX_PENDING:
                held.append(error)
            else:
                counts["skipped"] += 1
        else:
            judge(error)
        if (call + 1) % LOOK_EVERY == 0:
            now = dict(counts)
            now["skipped"] += len(held)  # (still held: neither agreement nor divergence yet)
            decided = verdict.decide_phase("legacy", _phase(now), MAX_RATE, explain=False)
            limit = decided.detection_limit if decided.size_limit else math.inf
            if decided.decision != verdict.INCONCLUSIVE:
                return decided.decision, limit, _size_limit(floor, sigma), call + 1
    return decision, limit, _size_limit(floor, sigma), CALLS


def _size_limit(floor: noise.NoiseFloor, sigma: float) -> float:
    """The stated size limit, in times the jitter's median (the threshold over the median A/A error)."""
    threshold = floor.thresholds("call").get("", math.inf)
    return threshold / SCALE  # (the jitter's median is SCALE: lognormal(0, sigma) has median 1)


def cell(sigma: float, aa_rate: float, rate: float, size: float, runs: int) -> dict:
    found = [one_run(sigma, aa_rate, rate, size, seed) for seed in range(runs)]
    decisions = [f[0] for f in found]
    limits = [f[1] for f in found]
    sizes = [f[2] for f in found]
    limit = statistics.median(limits)
    stated_size = statistics.median(sizes)
    above = rate > 0 and size >= stated_size and rate >= 2 * MAX_RATE and rate > limit
    return {
        "sigma": sigma, "aa_rate": aa_rate, "rate": rate, "size": size, "runs": runs,
        "promote": decisions.count(verdict.PROMOTE) / runs, "rollback": decisions.count(verdict.ROLLBACK) / runs,
        "inconclusive": decisions.count(verdict.INCONCLUSIVE) / runs, "detection_limit": limit,
        "size_limit": stated_size, "above_limit": above,
    }  # fmt: skip


def goals(cells: list[dict]) -> dict[str, bool]:
    """The goals (module docstring), each checked over the cells it is about."""
    above = [c for c in cells if c["above_limit"]]
    hidden = [c for c in cells if c["sigma"] == 1.5 and c["aa_rate"] == 0.05 and c["size"] == 20 and
              c["rate"] in (0.01, 0.05)]  # fmt: skip
    honest = [c for c in cells if c["rate"] == 0]
    certifiable = [c for c in honest if c["detection_limit"] < MAX_RATE]
    return {
        "(a) wrong promotes <= 5% above the stated limit": all(c["promote"] <= 0.05 for c in above),
        "(b) sigma 1.5, defaults, 20x on 1% and 5%: never promoted": all(c["promote"] == 0 for c in hidden),
        "(c) honest runs roll back <= 5%": all(c["rollback"] <= 0.05 for c in honest),
        "(d) honest runs promote >= 80% where the limit is below the max rate": all(
            c["promote"] >= 0.8 for c in certifiable
        ),
        "(d) sigma 0.5 at --aa-rate 1: the limit below the max rate": any(
            c["sigma"] == 0.5 and c["aa_rate"] == 1.0 for c in certifiable
        ),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few runs of a few cells (the test suite's run)")
    parser.add_argument("--runs", type=int, default=20, help="runs per cell")
    parser.add_argument("--json", type=Path, help="write the table here too")
    args = parser.parse_args()
    started = time.monotonic()
    if args.quick:
        plan = [(0.5, 1.0, 0.0, 1.0), (1.5, 0.05, 0.05, 20.0), (1.5, 1.0, 0.05, 1000.0), (1.5, 0.05, 0.0, 1.0)]
        runs = 3
    else:
        plan = [(s, a, r, k) for s in SIGMAS for a in AA_RATES for r in RATES for k in SIZES]
        plan += [(s, a, 0.0, 1.0) for s in SIGMAS for a in AA_RATES]
        runs = args.runs
    cells = [cell(*each, runs) for each in plan]
    print("sigma  aa-rate  divergence     promote rollback inconcl.  detection-limit  size-limit  above-limit")
    for c in cells:
        what = "honest (0%)" if c["rate"] == 0 else f"{c['rate']:.1%} x {c['size']:g}"
        print(f"{c['sigma']:<6} {c['aa_rate']:<8} {what:<14} {c['promote']:>7.0%} {c['rollback']:>8.0%} "
              f"{c['inconclusive']:>8.0%}  {c['detection_limit']:>15.3g}  {c['size_limit']:>9.3g}x  "
              f"{'yes' if c['above_limit'] else 'no'}")  # fmt: skip
    met = goals(cells)
    for goal, held in met.items():
        print(f"{goal}: {'met' if held else 'NOT met'}")
    print(f"{len(cells)} cells of {runs} runs in {time.monotonic() - started:.0f} s")
    if args.json:
        args.json.write_text(json.dumps({"cells": cells, "goals": met}, indent=1, default=str))
    return 0 if args.quick or all(met.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
