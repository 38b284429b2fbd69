"""The benchmarks at their smoke size: each runs, and the ratio it exists to show holds within loose bounds (a
busy machine, a tenth of the samples); the goals themselves are checked at full size in ``benchmarks/``."""

import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_quick(script):
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", script), "--quick"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def figure(out: str, label: str) -> float:
    """The number a benchmark printed after ``label``."""
    found = re.search(re.escape(label) + r"\s*([0-9][0-9,]*\.?[0-9]*)", out)
    assert found, f"{label!r} not in:\n{out}"
    return float(found.group(1).replace(",", ""))


def test_core_benchmark_runs_and_reports_both_ratios():
    out = run_quick("bench_core.py")
    assert "shadow wrapper / bare wrapper = " in out and "coverage-guided wrapper / bare wrapper = " in out
    assert "idle: compare_seconds / assert_close = " in out and "cores busy: compare_seconds" in out
    assert "outcome close" in out  # the pair is within tolerance but not bitwise equal
    assert "comparator goals: idle" in out
    for dtype in ("float32", "bfloat16"):  # (on the emulated npu: CI has no other accelerator)
        assert f"comparator on emulated npu, 2 devices (kernel_time=50us), 262,144 {dtype}, one fused pass: " in out
        assert f"{dtype}, torch's eager kernels: compare / assert_close = " in out
    assert "; one pass: the emulated npu's kernel)" in out and "; torch's eager kernels: " in out
    # (nanoseconds a call at the smoke size: a busy machine's other core moved these up to 5x; the unsampled path
    # doing a sampled call's work would be 100x)
    assert figure(out, "unsampled .type(): shadow wrapper / bare wrapper =") <= 10.0, out
    assert figure(out, "unsampled .type(): coverage-guided wrapper / bare wrapper =") <= 10.0, out
    for dtype in ("float32", "bfloat16"):  # (one fused pass beats torch's eager kernels on the same leaf)
        fused = figure(out, f"262,144 {dtype}, one fused pass: compare / assert_close =")
        eager = figure(out, f"262,144 {dtype}, torch's eager kernels: compare / assert_close =")
        assert fused < eager, out


@pytest.mark.filterwarnings("ignore")
def test_exporter_benchmark_runs():
    out = run_quick("bench_exporters.py")
    assert "exporters together, match" in out and "exporters together, mismatch" in out
    assert out.count("JsonlExporter") == 2
    delivered = figure(out, "exporters together, mismatch (journal writes it):")
    assert delivered < 200, out  # (us per observation)
    queued = float(re.search(r"mismatch \(journal writes it\).*?, ([0-9.]+) us of it queued", out).group(1))
    assert queued < delivered / 3, out  # (the caller's thread queues; the exporters run at delivery)


def test_step_benchmark_runs_on_the_emulated_npu_and_reports_every_ratio():
    out = run_quick("bench_step.py")
    assert "step time, rate 0.01 / unwrapped = " in out and "coverage-guided after its first 30" in out
    assert "step time, rate 1.0 / unwrapped = " in out
    assert "peak RSS of a step, rate 1.0 / unwrapped = " in out or "peak RSS: unavailable" in out
    assert figure(out, "step time, rate 0.01 / unwrapped =") <= 1.5, out
    assert figure(out, "step time, rate 1.0 / unwrapped =") <= 5.0, out
    assert figure(out, "coverage-guided after its first 30 calls per signature / unwrapped =") <= 1.5, out


def test_coverage_benchmark_runs_and_reports_the_ratio():
    out = run_quick("bench_coverage.py")
    assert "guided: " in out and "uniform: " in out and "uniform / guided comparisons = " in out
    # (a count of comparisons, not a time: at the smoke size's 3 seeds, well short of the full size's 10x)
    assert figure(out, "uniform / guided comparisons =") >= 2.0, out
    assert figure(out, "uniform / keyed =") >= 10.0, out


def test_budget_benchmark_runs_and_reports_every_figure():
    out = run_quick("bench_budget.py")
    assert "signature function, worst 3 s window: " in out and "compared (goal <= 51)" in out
    assert "deadline 0.3 s: the caller waited 0.3" in out
    assert figure(out, "signature function, worst 3 s window:") <= 0.15, out
    assert figure(out, "100 calls of 20 ms in 5 s:") <= 51, out  # (compared)


def test_resnet_benchmark_runs_and_reports_every_figure():
    out = run_quick("bench_resnet.py")
    assert "first comparisons, launcher defaults: " in out and "budget, launcher defaults over " in out
    assert "step time, launcher defaults (rate 0.01) after its first comparisons / unwrapped = " in out
    assert "step time, rate 1.0 (every call compared) / unwrapped = " in out
    assert "peak RSS of a step, rate 1.0 / unwrapped = " in out or "peak RSS: unavailable" in out
    assert figure(out, "the worst 10 s window spent") <= 0.5, out  # (of it on the shadow side; goal 0.25)
    assert figure(out, "after its first comparisons / unwrapped =") <= 2.0, out
    assert figure(out, "rate 1.0 (every call compared) / unwrapped =") <= 5.0, out


def test_the_attack_round_holds_every_attack_it_tries():
    out = run_quick("attack.py")
    *surfaces, total = [line.rsplit(None, 4) for line in out.strip().splitlines()[-19:]]
    assert [s[0] for s in surfaces] == [
        "threads", "gil", "forks", "limits", "connections", "hostile files", "torch_load", "module_to", "census",
        "linger", "verdict inputs", "counted 2.13.0", "counted 2.14.0", "env saves", "setting threads",
        "pickled once", "append streams", "census cache",
    ], out  # fmt: skip
    assert all(int(s[2]) > 0 for s in surfaces), out
    assert total[0] == "all" and int(total[2]) > 100 and total[2] == total[4], out


def test_patch_call_benchmark_runs_and_reports_each_place():
    out = run_quick("bench_patch_calls.py")
    for place in ("torch.nn.Module.__call__", "torch.Tensor.__repr__", "torch.serialization._save"):
        assert f"counted / bare call of {place}: " in out
    for target in ("tensor_repr", "torch_save", "storage_cpu"):
        assert figure(out, f"unsampled / bare call of target {target}:") <= 10.0, out  # (as the core's wrapper)


def test_the_noise_benchmark_decides_each_cell_and_checks_its_goals():
    """At its smoke size: an honest run at sigma 0.5 with an A/A run on every call promotes, a real divergence of
    1,000x on 5% of calls at sigma 1.5 rolls back, 20x at the defaults never promotes, and every goal holds."""
    out = run_quick("bench_noise.py")
    rows = {" ".join(line.split()[:5]): line.split() for line in out.splitlines() if line[:1].isdigit()}
    assert rows["0.5 1.0 honest (0%) 100%"], out  # (promoted, every run)
    assert rows["1.5 1.0 5.0% x 1000"][5:7] == ["0%", "100%"], out  # (never promoted, rolled back)
    assert rows["1.5 0.05 5.0% x 20"][5] == "0%", out  # (never promoted)
    goals = [line for line in out.splitlines() if line.startswith("(")]
    assert len(goals) == 5 and all(line.endswith(": met") for line in goals), out


@pytest.mark.e2e
def test_the_fleet_benchmark_decides_alike_from_prometheus_and_victoria_metrics(tmp_path):
    """benchmarks/bench_fleet.py at a small fleet: both stores hold every series of every job, a job's series within
    its budget, every decision alike from both, and the jobs' decisions what their evidence says (a clean job of 2
    hours promotes at 0.01, one diverging at 5% rolls back, one of 15 minutes cannot decide yet)."""
    import json

    figures_path = tmp_path / "fleet.json"
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "bench_fleet.py"), "--jobs", "11", "--runs-read", "11",
         "--json", str(figures_path)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    figures = json.loads(figures_path.read_text())
    assert figures["jobs"] == 11 and figures["series"] == figures["victoriametrics_series"]
    assert figures["series_per_job"] <= 250 and figures["same_decisions"] is True
    # (job 3 diverges; job 5 is 15 minutes old; the other 9 are clean)
    assert figures["run_decisions"] == {"inconclusive": 1, "promote": 9, "rollback": 1}
    assert figures["fleet_decision"] == "rollback"
    for store in ("prometheus", "victoriametrics"):
        assert figures[f"{store}_verdict_seconds"] > 0 and figures[f"{store}_bytes_per_series"] > 0
