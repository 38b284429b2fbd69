"""The verdict at its edges, and the command on saved expositions and journals."""

import json
import subprocess
import sys

import journals
import pytest
from commands import npu_shadow, npu_shadow_here
from scipy.stats import beta

from shadow.analysis import bounds, verdict
from shadow.analysis.decisions import overall
from shadow.analysis.evidence import TargetCounts
from shadow.analysis.verdict import INCONCLUSIVE, PROMOTE, ROLLBACK, decide

MAX = 0.001


def counts(match=0, mismatch=0, error=0, reasons=None, signature="dtype/cpu/blocking"):
    c = TargetCounts()
    for outcome, n in (("match", match), ("mismatch", mismatch), ("error", error)):
        if n:
            c.add_outcome(signature, outcome, n)
    for reason, n in (reasons or {}).items():
        c.add_reason(reason, n)
    return c


def test_bounds_are_the_anytime_valid_sequences():
    """(The statistic itself is checked against independent computations in test_verdict_honesty.py.)"""
    prior = bounds.Prior.for_max_rate(MAX)
    # at least the fixed-n Clopper-Pearson bound: validity at every look costs width
    assert bounds.upper_bound(0, 3000, prior) > 1 - 0.05 ** (1 / 3000)
    assert bounds.upper_bound(5, 1000, prior) > beta.ppf(0.95, 6, 995)
    assert bounds.lower_bound(5, 1000) < beta.ppf(0.05, 5, 996)
    assert bounds.lower_bound(0, 10) == 0.0 and bounds.upper_bound(0, 0, prior) == 1.0


def test_zero_samples_is_inconclusive():
    decision = decide("t", counts(), MAX)
    assert decision.decision == INCONCLUSIVE and decision.compared == 0
    assert "about 4,742 comparisons" in decision.why


def test_zero_mismatches_just_below_and_at_the_needed_n():
    needed = verdict.comparisons_needed(MAX)
    prior = bounds.Prior.for_max_rate(MAX)
    assert needed == 4742  # about 4.5 / max rate: the rule of three's 3 / max rate, valid at one look only
    assert bounds.upper_bound(0, needed, prior) < MAX <= bounds.upper_bound(0, needed - 1, prior)
    below = decide("t", counts(match=needed - 1), MAX)
    assert below.decision == INCONCLUSIVE and "about 1 more effective comparisons" in below.why
    assert decide("t", counts(match=needed), MAX).decision == PROMOTE


def test_needed_n_with_some_divergences_is_the_least_that_suffices():
    needed = verdict.comparisons_needed(MAX, k=3)
    prior = bounds.Prior.for_max_rate(MAX)
    assert bounds.upper_bound(3, needed, prior) < MAX <= bounds.upper_bound(3, needed - 1, prior)


def test_one_hard_mismatch_among_millions_of_matches_is_rollback():
    decision = decide("t", counts(match=5_000_000, mismatch=1, reasons={"dtype": 1}), MAX)
    assert decision.decision == ROLLBACK and "1 dtype" in decision.why
    # the same single divergence as a value mismatch is within budget
    assert decide("t", counts(match=5_000_000, mismatch=1, reasons={"value": 1}), MAX).decision == PROMOTE


def test_a_divergence_rate_clearly_above_the_budget_is_rollback():
    decision = decide("t", counts(match=9000, mismatch=100, reasons={"value": 100}), MAX)
    assert decision.decision == ROLLBACK and decision.lower > MAX


def test_a_risky_signature_never_exercised_is_inconclusive():
    plenty = counts(match=100_000, signature="dtype/npu/blocking")
    decision = decide("tensor_type", plenty, MAX, risky=("npu_name/*",), min_per_signature=30)
    assert decision.decision == INCONCLUSIVE
    assert "npu_name/* compared 0 times, needs 30" in decision.why
    plenty.add_outcome("npu_name/npu/blocking", "match", 30)
    assert decide("tensor_type", plenty, MAX, risky=("npu_name/*",), min_per_signature=30).decision == PROMOTE


def test_overall_is_the_worst_target():
    made = [decide("a", counts(match=10_000), MAX), decide("b", counts(), MAX)]
    assert overall(made) == INCONCLUSIVE
    made.append(decide("c", counts(match=1, error=1, reasons={"exception": 1}), MAX))
    assert overall(made) == ROLLBACK
    assert overall([]) == INCONCLUSIVE


EXPOSITION = """# TYPE npu_shadow_comparisons_total counter
npu_shadow_comparisons_total{target="op",outcome="match",signature="call"} 5000
npu_shadow_comparisons_total{target="op",outcome="mismatch",signature="call"} 0
npu_shadow_comparisons_total{target="op",outcome="skipped",signature=""} 7
npu_shadow_comparisons_total{target="tensor_type",outcome="match",signature="dtype/cpu/blocking"} 10
npu_shadow_comparisons_total{target="tensor_type",outcome="mismatch",signature="dtype/cpu/blocking"} 1
# TYPE npu_shadow_mismatches_total counter
npu_shadow_mismatches_total{target="tensor_type",reason="shape"} 1
npu_shadow_mismatches_total{target="op",reason="dtype"} 0
"""


def run_verdict(*args):
    """The command in this process (one test below runs it as a real process)."""
    return npu_shadow_here("verdict", *args)


@pytest.mark.slow
def test_the_installed_command_runs_as_a_process(tmp_path):
    path = tmp_path / "scrape.prom"
    path.write_text(EXPOSITION)
    done = npu_shadow("verdict", "--metrics-file", str(path))
    assert done.returncode == 1 and "overall: rollback" in done.stdout


def test_command_on_a_saved_exposition(tmp_path):
    path = tmp_path / "scrape.prom"
    path.write_text(EXPOSITION)
    done = run_verdict("--metrics-file", str(path), "--format", "json")
    assert done.returncode == 1, done.stderr  # tensor_type has a shape mismatch: rollback
    result = json.loads(done.stdout)
    by_target = {t["target"]: t for t in result["targets"]}
    assert result["decision"] == ROLLBACK
    assert by_target["op"]["decision"] == PROMOTE and by_target["op"]["compared"] == 5000
    assert by_target["tensor_type"]["hard"] == {"shape": 1}

    path.write_text(
        EXPOSITION.replace('reason="shape"} 1', 'reason="shape"} 0').replace(
            'mismatch",signature="dtype/cpu/blocking"} 1', 'mismatch",signature="dtype/cpu/blocking"} 0'
        )
    )
    table = run_verdict("--metrics-file", str(path))
    assert table.returncode == 3  # tensor_type: too few comparisons, and its risky signatures never seen
    assert "inconclusive" in table.stdout and "npu_name/*" in table.stdout and "overall: inconclusive" in table.stdout


def test_command_on_journals(tmp_path):
    """Every outcome of 5,000 processes (5,000 clusters: enough to promote); then an exception mismatch."""
    path = journals.write(tmp_path / "j.jsonl", [journals.line(pid=pid) for pid in range(5000)])
    assert run_verdict("--journal", str(path)).returncode == 0
    with path.open("a") as handle:
        handle.write(json.dumps(journals.line("error", reasons=["exception"], pid=1)))
    assert run_verdict("--journal", str(path)).returncode == 1


@pytest.mark.parametrize(
    "args",
    [
        (),
        ("--metrics-file", "/nonexistent/scrape.prom"),
        ("--metrics-file", "x", "--max-rate", "1.5"),
        ("--metrics-file", "x", "--risky", "nopattern"),
        ("--prometheus", "http://127.0.0.1:9"),
    ],
)
def test_usage_and_source_errors_exit_2(args):
    done = run_verdict(*args)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr


@pytest.mark.slow
def test_a_verdict_piped_into_a_reader_that_left_ends_quietly(tmp_path):
    """`npu-shadow verdict ... | head`: the reader leaves first; no BrokenPipeError traceback, exit 141 (SIGPIPE)."""
    import shlex

    path = tmp_path / "j.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in (journals.header(), *[journals.line()] * 3)) + "\n")
    command = f"{shlex.quote(sys.executable)} -m shadow verdict --journal {shlex.quote(str(path))} | true"
    done = subprocess.run(["bash", "-o", "pipefail", "-c", command], capture_output=True, text=True, timeout=120)
    assert "Traceback" not in done.stderr and "BrokenPipeError" not in done.stderr, done.stderr
    assert done.returncode == 141, done.stderr
