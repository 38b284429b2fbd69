"""Gathering evidence on purpose (issue 56, point 4): ``npu-shadow run --gather`` compares every DataParallel call
within its stated budget, and the verdict says which settings would reach a decision sooner, and by how much."""

from __future__ import annotations

import math
import os
import random
import sys

import numpy as np
import pytest
from commands import npu_shadow
from prometheus_client.parser import text_string_to_metric_families
from torch_npu_wheels import wheel

from shadow.analysis import evidence, sooner, verdict
from shadow.core.calls.record import clusters
from shadow.core.model import contract
from shadow.launcher import config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_gather_sets_its_rates_and_budget_and_an_option_given_overrides_its_part() -> None:
    gathering = config.from_sources({}, {"gather": "1"})
    assert gathering.sample_rate == {"parallel_apply": 1.0, "data_parallel": 1.0} and gathering.budget == 0.5
    assert config.from_sources({"NPU_SHADOW_GATHER": "yes"}).budget == 0.5
    given = config.from_sources({"NPU_SHADOW_BUDGET": "0.3"}, {"gather": "1", "sample_rate": "0.2"})
    assert (given.sample_rate, given.budget) == (0.2, 0.3)
    assert config.from_sources({}, {}).budget == 0.2  # (not asked for: the defaults)


def test_the_blocks_a_stream_of_calls_reaches_match_a_simulation() -> None:
    """The share of 60 s blocks holding a call, for a Poisson stream of calls, against one drawn (1,000 hours)."""
    draw = random.Random(5)
    for per_hour in (3.0, 30.0, 120.0, 600.0):
        hours, occupied, at = 1000, set(), 0.0
        while True:
            at += draw.expovariate(per_hour / 3600)
            if at >= hours * 3600:
                break
            occupied.add(int(at // clusters.WINDOW_SECONDS))
        assert sooner.blocks_per_hour(per_hour) == pytest.approx(len(occupied) / hours, rel=0.03), per_hour


def test_a_job_whose_blocks_go_without_comparisons_is_told_that_comparing_every_call_is_sooner_and_by_how_much():
    """A slow job: 600 calls a process-hour (one every 6 s), 6 clusters in 10 process-hours (sampled at 0.01)."""
    said = sooner.sooner("parallel_apply", 4000, cluster_count=60, calls=6000, process_seconds=36000)
    reachable = 60 * (1 - math.exp(-10))
    assert f"fills up to {reachable:.3g} of the 60 s blocks" in said and "(6 now)" in said
    assert f"about {4000 / reachable:.3g} more process-hours instead of {4000 / 6:.3g}" in said
    assert "--gather" in said and "--sample-rate parallel_apply=1" in said


def test_a_job_whose_blocks_are_all_compared_is_told_no_setting_is_sooner():
    said = sooner.sooner("tensor_type", 4000, cluster_count=60, calls=100_000, process_seconds=3600)
    assert said.startswith("sooner: no setting; its comparisons already fill the 60 s blocks its calls reach (60 of 60")


def test_the_verdict_says_what_is_sooner_under_an_inconclusive_phase() -> None:
    counts = evidence.TargetCounts(process_seconds=36000)
    counts.add_outcome("s", "match", 60)
    counts.add_calls("s", 6000)
    counts.add_clusters(6)
    (decision,) = verdict.decide_all({"parallel_apply": counts}, 0.001, {}, 0)
    (phase,) = decision.phases
    assert decision.decision == verdict.INCONCLUSIVE
    assert phase.sooner.startswith("sooner: comparing every call of parallel_apply (npu-shadow run --gather")


@pytest.mark.slow
def test_gather_compares_every_dataparallel_call_of_the_example_job(tmp_path):
    """The example job over 4 epochs makes 48 parallel_apply calls, more than the first 30 of a signature that the
    defaults compare whatever the rate (bench_gather: 30 of 96 over 8 epochs); with --gather every one is compared.
    The preset's budget (half the job's wall time, checked above) charges the shadow side's wall time, so what it
    refuses depends on the machine's load (CI refused 1 of 48; with both cores kept busy, 18): off here, so that the
    count is exact on any machine."""
    textfile = tmp_path / "metrics.prom"
    done = npu_shadow(
        "run",
        "--emulate-npu",
        "2",
        "--legacy-from",
        wheel("2.12.0"),
        "--gather",
        "--budget",
        "off",
        "--textfile",
        str(textfile),
        "--",
        sys.executable,
        os.path.join(ROOT, "examples", "train_dataparallel.py"),
        "--epochs",
        "4",
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    calls: dict[str, float] = {}
    compared: dict[str, float] = {}
    skipped = 0.0
    for family in text_string_to_metric_families(textfile.read_text()):
        for sample in family.samples:
            target = sample.labels.get("target")
            if sample.name == contract.CALLS.series:
                calls[target] = calls.get(target, 0) + sample.value
            elif sample.name == contract.COMPARISONS.series:
                compared[target] = compared.get(target, 0) + sample.value
            elif sample.name == contract.SKIPPED.series and target in ("parallel_apply", "data_parallel"):
                skipped += sample.value
    assert calls["parallel_apply"] == compared["parallel_apply"] == 48
    assert calls["data_parallel"] == compared["data_parallel"] == 16
    assert skipped == 0


# --------------------------------------------------------------------------- the gain, from the calls' own blocks


def _simulated(call_times: list[list[float]], rate: float, seed: int) -> tuple[float, float, float]:
    """(clusters seen sampling ``rate`` of the calls, the call blocks the processes counted, clusters with every call
    compared) for ranks calling at ``call_times`` (one list each; a rank counts 1/W of a block), the blocks counted
    as the engine counts them: a comparison opens a cluster, calls mark their block at each comparison and at each
    second's report."""
    from shadow.core.calls.record.clusters import Clusters

    rng = np.random.default_rng(seed)
    seen = blocks = every = 0.0
    for times in call_times:
        share = 1 / len(call_times)
        sampled, counted, full = Clusters(share=share), Clusters(share=share), Clusters(share=share)
        reported = -1
        for t, drawn in zip(times, rng.random(len(times)) < rate):
            every += share * full.opens("legacy", False, t)
            if drawn:
                seen += share * sampled.opens("legacy", False, t)
                blocks += counted.called("legacy", t)
            elif int(t) != reported:  # (the reporter, each second)
                reported = int(t)
                blocks += counted.called("legacy", reported + 1.0)
    return seen, blocks, every


def _lockstep(rng) -> list[list[float]]:  # 8 ranks, a call a second each, 10 hours: every block compared at 20%
    times = list(np.arange(36_000, dtype=float) + 0.5)
    return [times] * 8


def _bursts(rng) -> list[list[float]]:  # a burst of 600 calls in 5 minutes each hour, 40 hours
    return [sorted(float(h * 3600 + x) for h in range(40) for x in rng.uniform(0, 300, 600))]


def _poisson(rng) -> list[list[float]]:  # 30 calls a process-hour, spread at random, 40 hours
    return [sorted(rng.uniform(0, 40 * 3600, 1_200).tolist())]


@pytest.mark.parametrize(
    "stream, rate", [(_lockstep, 0.2), (_bursts, 0.005), (_poisson, 0.1)], ids=["lockstep", "bursts", "poisson"]
)
def test_the_gain_said_is_within_1_5x_of_what_comparing_every_call_brings(stream, rate):
    """sooner: took the gain for a Poisson stream of the calls: 8 ranks in lockstep whose every block is compared
    were told 8x (true: 1), hourly bursts 24x. The gain is the blocks the calls fell in over the clusters, both
    counted by the processes with their rank shares; checked against a simulation comparing every call."""
    seen, blocks, every = _simulated(stream(np.random.default_rng(7)), rate, seed=8)
    hours = 40.0 if stream is not _lockstep else 8 * 10.0  # (process-hours: every rank's)
    said = sooner.reachable_per_hour(seen, calls=1.0, hours=hours, call_blocks=blocks) / (seen / hours)
    true = every / seen
    assert true / 1.5 <= said <= true * 1.5, (said, true)
    line = sooner.sooner("op", 500, cluster_count=seen, calls=10_000, process_seconds=hours * 3600, call_blocks=blocks)
    assert ("no setting" in line) == (said < sooner.WORTH), line
