"""`pytest --npu-shadow`: a suite run with every patched call shadowed, each observation attributed to its test."""

import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ElementTree

import pytest
from commands import npu_shadow

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SUITE = """
import pytest
import torch


@pytest.fixture
def cast_in_setup():
    torch.accelerator.set_device_index(0)
    return torch.ones(2, device="npu:1").type("torch.npu.HalfTensor")  # diverges, in setup


def test_diverges():
    torch.accelerator.set_device_index(0)
    # legacy: onto the current npu (0); upstream: keeps the tensor's own device (1)
    assert torch.ones(2, device="npu:1").type("torch.npu.HalfTensor").dtype == torch.float16


def test_agrees():
    assert torch.arange(4.0).type(torch.float16).dtype == torch.float16


def test_diverges_in_setup(cast_in_setup):
    assert cast_in_setup.dtype == torch.float16


def test_fails_on_its_own():
    assert torch.ones(1).type(torch.int64).item() == 2
"""


def run_pytest(directory, *options):
    """pytest in a fresh process; (exit code, output, {test name: outcome}) from its JUnit XML."""
    report = directory / "report.xml"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", f"--junitxml={report}", *options],
        cwd=directory, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    outcomes = {}
    for case in ElementTree.parse(report).iter("testcase"):
        kinds = {child.tag for child in case}
        outcome = (
            "failed"
            if "failure" in kinds
            else "error"
            if "error" in kinds
            else "skipped"
            if "skipped" in kinds
            else "passed"
        )
        outcomes[f"{case.get('classname')}::{case.get('name')}"] = outcome
    return done.returncode, done.stdout + done.stderr, outcomes


@pytest.fixture
def suite(tmp_path):
    (tmp_path / "test_suite.py").write_text(SUITE)
    return tmp_path


SHADOWED = ["--npu-shadow", "--npu-shadow-emulate-npu", "2", "--npu-shadow-journal", "journal.jsonl"]


def test_every_observation_is_attributed_to_the_test_that_made_the_call(suite):
    _, output, outcomes = run_pytest(suite, *SHADOWED)
    assert outcomes == {
        "test_suite::test_diverges": "passed",
        "test_suite::test_agrees": "passed",
        "test_suite::test_diverges_in_setup": "passed",
        "test_suite::test_fails_on_its_own": "failed",
    }, output
    assert "diverged: test_suite.py::test_diverges (call): tensor_type mismatch (device)" in output
    assert "diverged: test_suite.py::test_diverges_in_setup (setup): tensor_type mismatch (device)" in output
    assert "test_agrees" not in output.split("= npu-shadow =")[1]
    records = [r for r in map(json.loads, (suite / "journal.jsonl").read_text().splitlines()) if "outcome" in r]
    by_test = {}
    for record in records:
        by_test.setdefault((record["test"], record["phase"]), []).append(record["outcome"])
    assert by_test[("test_suite.py::test_diverges", "call")] == ["mismatch"]
    assert by_test[("test_suite.py::test_agrees", "call")] == ["match"]
    assert by_test[("test_suite.py::test_diverges_in_setup", "setup")] == ["mismatch"]
    assert by_test[("test_suite.py::test_fails_on_its_own", "call")] == ["match"]
    verdict = npu_shadow("verdict", "--journal", str(suite / "journal.jsonl"), timeout=120)
    assert verdict.returncode == 1 and "hard mismatches: 2 device" in verdict.stdout, verdict.stdout


def test_strict_mode_fails_exactly_the_tests_that_diverged(suite):
    code, output, outcomes = run_pytest(suite, *SHADOWED, "--npu-shadow-strict")
    assert outcomes == {
        "test_suite::test_diverges": "failed",
        "test_suite::test_agrees": "passed",
        "test_suite::test_diverges_in_setup": "error",  # (its setup diverged)
        "test_suite::test_fails_on_its_own": "failed",  # on its own, as without the plugin
    }, output
    assert "npu-shadow: legacy and upstream diverged in this test" in output
    assert code == 1


LEGACY_FORMAT = """
import torch


def _saved(tmp_path):
    path = tmp_path / "old.pt"
    torch.save({"w": torch.ones(3, device="npu:0")}, path, _use_new_zipfile_serialization=False)
    return path


def test_loads_a_legacy_format_npu_checkpoint(tmp_path):
    assert torch.load(_saved(tmp_path), weights_only=False)["w"].sum().item() == 3


def test_loads_it_weights_only(tmp_path):
    assert torch.load(_saved(tmp_path))["w"].sum().item() == 3
"""


@pytest.mark.parametrize("release, flips", [("2.12.0", True), ("2.14.0", False)])
def test_strict_mode_still_catches_212_loading_a_legacy_format_npu_checkpoint_onto_the_cpu(tmp_path, release, flips):
    """A real difference: torch_npu 2.12.0 loads a checkpoint of the legacy (non-zip) format onto the CPU where no
    map_location is given and weights_only is off, upstream onto the device it was saved from; strict mode fails the
    test that loads it. From 2.13.0 on, torch_npu loads it as upstream does (no flip), and a weights-only load agrees
    in every release."""
    from torch_npu_wheels import wheel

    (tmp_path / "test_legacy_format.py").write_text(LEGACY_FORMAT)
    legacy = [f"--npu-shadow-legacy-from={wheel(release)}", "--npu-shadow-targets=torch_load"]
    _, output, outcomes = run_pytest(tmp_path, *SHADOWED, "--npu-shadow-strict", *legacy)
    assert outcomes == {
        "test_legacy_format::test_loads_a_legacy_format_npu_checkpoint": "failed" if flips else "passed",
        "test_legacy_format::test_loads_it_weights_only": "passed",
    }, output
    assert ("torch_load mismatch (device)" in output) == flips, output


def test_under_xdist_the_workers_evidence_is_merged_and_agrees_with_the_journal(suite):
    """With ``-n 2`` the controller runs no test: its summary is the workers' counts and divergences merged, and
    the same as the journal they all wrote."""
    code, output, outcomes = run_pytest(suite, *SHADOWED, "--npu-shadow-strict", "-n", "2")
    assert outcomes["test_suite::test_diverges"] == "failed" and code == 1, output
    summary = output.split("= npu-shadow =")[1]
    assert "(merged from 2 xdist workers)" in summary and "no divergence" not in summary
    assert "diverged: test_suite.py::test_diverges (call): tensor_type mismatch (device)" in summary
    assert "diverged: test_suite.py::test_diverges_in_setup (setup): tensor_type mismatch (device)" in summary
    records = [r for r in map(json.loads, (suite / "journal.jsonl").read_text().splitlines()) if "outcome" in r]
    row = next(line.split() for line in summary.splitlines() if line.startswith("tensor_type"))
    calls, compared, match, _close, mismatch = map(int, row[1:6])
    assert compared == len(records) == 4 and calls >= compared
    assert (match, mismatch) == (sum(r["outcome"] == "match" for r in records), 2)


def test_without_the_option_the_plugin_does_nothing(suite):
    _, output, outcomes = run_pytest(suite)
    # (no section of the plugin's: a path that holds the word, in a traceback of the suite's own, is no sign of it)
    assert not re.search(r"^[=_-]+ npu-shadow [=_-]+$", output, flags=re.M), output
    assert not (suite / "npu-shadow-tests.jsonl").exists()
    assert outcomes["test_suite::test_fails_on_its_own"] == "failed"


#: The project's own tests that install monitors of their own beside the plugin's session (what the plugin must step
#: aside for): every one of their outcomes the same with the plugin on.
OWN_TESTS = ["tests/test_install.py", "tests/test_oracle.py"]


def test_the_projects_own_tests_have_the_same_outcomes_with_the_plugin(tmp_path):
    def outcomes(*options):
        report = tmp_path / f"report{len(options)}.xml"
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", f"--junitxml={report}",
             *OWN_TESTS, *options],
            cwd=ROOT, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        cases = ElementTree.parse(report).iter("testcase")
        return done, {(c.get("classname"), c.get("name")): sorted(child.tag for child in c) for c in cases}

    _, plain = outcomes()
    shadowed_run, shadowed = outcomes("--npu-shadow", "--npu-shadow-journal", str(tmp_path / "j.jsonl"))
    assert len(plain) >= 30
    assert shadowed == plain, shadowed_run.stdout[-3000:]
    assert "= npu-shadow =" in shadowed_run.stdout
    assert (tmp_path / "j.jsonl").read_text().count("\n") > 0  # the session compared calls


GRADIENT_SUITE = """
import torch
from torch import nn


def test_trains_in_data_parallel():
    torch.manual_seed(0)
    dp = nn.DataParallel(nn.Linear(4, 4).to("npu:0"), device_ids=[0, 1])
    dp(torch.randn(4, 4, device="npu:0")).sum().backward()
"""


def test_gradients_and_float64_truth_runs_are_asked_for_by_option_or_the_launchers_variables(tmp_path):
    (tmp_path / "test_gradients.py").write_text(GRADIENT_SUITE)
    options = [
        "--npu-shadow", "--npu-shadow-emulate-npu=2", "--npu-shadow-journal=journal.jsonl",
        "--npu-shadow-legacy=reference", "--npu-shadow-targets=parallel_apply",
    ]  # fmt: skip

    def backward_runs(*more, env=None):
        environment = {**os.environ, **(env or {})}
        (tmp_path / "journal.jsonl").unlink(missing_ok=True)
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", *options, *more],
            cwd=tmp_path, capture_output=True, text=True, timeout=600, env=environment,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        lines = (tmp_path / "journal.jsonl").read_text().splitlines()
        records = [r for r in map(json.loads, lines) if r.get("target") == "parallel_apply" and "outcome" in r]
        assert [r["outcome"] for r in records] == ["match"]
        return sum(r["backward"] for r in records)

    assert backward_runs() == 0
    assert backward_runs("--npu-shadow-backward-rate=1", "--npu-shadow-truth-rate=1") == 1
    assert backward_runs(env={"NPU_SHADOW_BACKWARD_RATE": "1"}) == 1
    refused = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", *options, "--npu-shadow-truth-rate=2"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert refused.returncode == 4
    assert "--npu-shadow-truth-rate: expected a number in [0, 1], got '2'" in refused.stderr
