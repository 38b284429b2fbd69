"""CI's own rules: it says it is CI, and there a skipped test fails (tests/ci_skips.py)."""

import os

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
