"""Each test's outcome as it happens, for ``npu-shadow ab`` (``--npu-shadow-outcomes``): no torch imported."""

from __future__ import annotations

import json
from typing import Any

import pytest

from shadow.core.model.observation import bounded


class OutcomeRecorder:
    """Each test's outcome by node id (``failed`` in its call, ``error`` in setup or teardown, ``skipped``,
    ``passed``) with the first lines of its failure, written as it happens: a JSON line ``started`` when a test
    starts and one with its outcome when it ends, so a test that kills the interpreter is on record as started and
    never ended (``npu-shadow ab`` reads it as ``crashed``). Registered on the controller only under pytest-xdist
    (it receives every worker's reports). ``resume``: keep the file's lines and deselect the tests it holds (ab's
    run of the rest of a world after a crash)."""

    def __init__(self, path: str, resume: bool = False) -> None:
        self.path = path
        self.outcomes: dict[str, dict[str, str]] = {}
        self.done = recorded_outcomes(path) if resume else {}
        self._handle = open(path, "a" if resume else "w", encoding="utf-8")  # noqa: SIM115  (closed at unconfigure)

    def _write(self, test: str, outcome: str, text: str = "") -> None:
        self._handle.write(json.dumps({"test": test, "outcome": outcome, "text": text}) + "\n")
        self._handle.flush()

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        if not self.done:
            return
        done = [item for item in items if item.nodeid in self.done]
        if done:
            items[:] = [item for item in items if item.nodeid not in self.done]
            config.hook.pytest_deselected(items=done)

    def pytest_runtest_logstart(self, nodeid: str, location: Any) -> None:
        self._write(nodeid, STARTED)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        found = self.outcomes.setdefault(report.nodeid, {"outcome": "passed", "text": ""})
        if report.failed:
            outcome = "failed" if report.when == "call" else "error"
        elif report.skipped and found["outcome"] == "passed":
            outcome = "skipped"
        else:
            return
        if found["outcome"] in ("passed", "skipped"):
            found["outcome"] = outcome
            crash = getattr(getattr(report.longrepr, "reprcrash", None), "message", None)
            lines = report.longreprtext.strip().splitlines() if report.longreprtext else [""]
            found["text"] = bounded(crash or lines[-1], 300)

    def pytest_runtest_logfinish(self, nodeid: str, location: Any) -> None:
        found = self.outcomes.get(nodeid, {"outcome": "passed", "text": ""})
        self._write(nodeid, found["outcome"], found["text"])

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        """The session's end, on record: a crash after it (an abort at exit) loses no test's outcome."""
        self._handle.write(json.dumps({"session": "finished", "exitstatus": int(exitstatus)}) + "\n")
        self._handle.flush()

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        self._handle.close()


#: The outcome a test has while it runs; one still ``started`` at the end of a world never ended.
STARTED = "started"


def _records(path: str) -> list[dict[str, Any]]:
    """The JSON objects of an OutcomeRecorder file, in order; a line that is not one (a torn last line) is left
    out, and a file that is not there has none."""
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            lines = handle.readlines()
    except FileNotFoundError:
        return []
    records = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def recorded_outcomes(path: str) -> dict[str, dict[str, str]]:
    """{test node id: {"outcome", "text"}}: the last line of each test in an OutcomeRecorder file (``started``
    for one that never ended)."""
    return {
        record["test"]: {"outcome": str(record.get("outcome", "")), "text": str(record.get("text", ""))}
        for record in _records(path)
        if isinstance(record.get("test"), str)
    }


def session_exit_status(path: str) -> int | None:
    """The exit status pytest's session finished with, as the last run of an OutcomeRecorder file recorded it
    (None where its session never finished: the interpreter died before)."""
    status = None
    for record in _records(path):
        if record.get("test") is not None:
            status = None  # (a test after a finished session: a resumed run, not finished yet)
        elif record.get("session") == "finished":
            status = record.get("exitstatus") if isinstance(record.get("exitstatus"), int) else None
    return status
