"""Under CI (``CI=true``: ``.ci/run`` says so, whatever runs it) a skip is a failure: CI installs everything the
suite needs, so a skipped test is a check that did not run, never a green one."""

import os

import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A skip reported as a failure under CI (an expected failure stays one)."""
    outcome = yield
    report = outcome.get_result()
    if os.environ.get("CI") == "true" and report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped under CI, where nothing may be: {reason}"
