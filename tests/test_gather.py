"""Gathering evidence on purpose (issue 56, point 4): ``npu-shadow run --gather`` compares every DataParallel call
within its stated budget, and the verdict says which settings would reach a decision sooner, and by how much."""

from __future__ import annotations

import math
import os
import random
import subprocess
import sys

import pytest
from prometheus_client.parser import text_string_to_metric_families
from torch_npu_wheels import wheel

from exporters import contract
from shadow.analysis import sooner, verdict
from shadow.core.calls.record import clusters
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
    assert said.startswith("sooner: no setting; its comparisons already fill the 60 s blocks its calls reach (60 a ")


def test_the_verdict_says_what_is_sooner_under_an_inconclusive_phase() -> None:
    counts = verdict.TargetCounts(process_seconds=36000)
    counts.add_outcome("s", "match", 60)
    counts.add_calls("s", 6000)
    counts.add_clusters(6)
    (decision,) = verdict.decide_all({"parallel_apply": counts}, 0.001, {}, 0)
    (phase,) = decision.phases
    assert decision.decision == verdict.INCONCLUSIVE
    assert phase.sooner.startswith("sooner: comparing every call of parallel_apply (npu-shadow run --gather")


@pytest.mark.slow
def test_gather_compares_every_dataparallel_call_of_the_example_job_within_its_budget(tmp_path):
    """The example job over 4 epochs makes 48 parallel_apply calls, more than the first 30 of a signature that the
    defaults compare whatever the rate (bench_gather: 30 of 96 over 8 epochs); with --gather every one is compared,
    none skipped for the budget."""
    textfile = tmp_path / "metrics.prom"
    done = subprocess.run(
        [sys.executable, "-m", "shadow", "run", "--emulate-npu", "2", "--legacy-from", wheel("2.12.0"), "--gather",
         "--textfile", str(textfile), "--", sys.executable, os.path.join(ROOT, "examples", "train_dataparallel.py"),
         "--epochs", "4"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
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
