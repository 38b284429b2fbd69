"""The suite's own rules: CI says it is CI, and there a skipped test fails (tests/ci_skips.py); the fast tier starts
no program (tests/tiers.py)."""

import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SUITE = """
import pytest

def test_skipped_in_its_body():
    pytest.skip("no thing")

@pytest.mark.skipif(True, reason="never here")
def test_skipped_by_its_mark():
    pass

@pytest.mark.xfail(reason="known")
def test_expected_to_fail():
    assert False

def test_passes():
    pass
"""


def test_a_skip_fails_under_ci_and_is_a_skip_elsewhere(pytester, monkeypatch):
    pytester.makepyfile(SUITE)
    monkeypatch.setenv("CI", "true")
    under_ci = pytester.runpytest_inprocess("-p", "ci_skips")
    under_ci.assert_outcomes(passed=1, failed=1, errors=1, xfailed=1)
    under_ci.stdout.fnmatch_lines(["*skipped under CI, where nothing may be: *no thing*"])
    monkeypatch.delenv("CI")
    elsewhere = pytester.runpytest_inprocess("-p", "ci_skips")
    elsewhere.assert_outcomes(passed=1, skipped=2, xfailed=1)


def test_ci_runs_the_readmes_test_command_saying_it_is_ci():
    with open(os.path.join(ROOT, ".ci", "run")) as run:
        lines = [line.strip() for line in run if line.strip() and not line.startswith("#")]
    assert lines.index("export CI=true") < lines.index("bash scripts/test.sh")
    with open(os.path.join(ROOT, "README.md")) as readme:
        assert "bash scripts/test.sh" in readme.read()


TIERED = """
import os, subprocess, sys

import pytest

def test_starts_a_program_unmarked():
    subprocess.run([sys.executable, "-c", "pass"], check=True)

@pytest.mark.slow
def test_starts_a_program_marked_slow():
    subprocess.run([sys.executable, "-c", "pass"], check=True)

def test_forks_itself():
    child = os.fork()
    if child == 0:
        os._exit(0)
    os.waitpid(child, 0)

def test_starts_nothing():
    pass
"""


@pytest.mark.slow
def test_an_unmarked_test_that_starts_a_program_fails_naming_it(pytester, monkeypatch):
    pytester.makepyfile(TIERED)
    pytester.makeini("[pytest]\nmarkers =\n    slow: starts a program\n")
    monkeypatch.setenv("PYTHONPATH", os.path.join(ROOT, "tests"))
    done = pytester.runpytest_subprocess("-p", "tiers", "-p", "no:cacheprovider")
    done.assert_outcomes(passed=3, failed=1)
    done.stdout.fnmatch_lines(["*test_starts_a_program_unmarked*", "*this test started python* not marked slow*"])
