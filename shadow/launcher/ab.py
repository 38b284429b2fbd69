"""``npu-shadow ab -- PYTEST_ARGS``: a suite A/B, for what call-level shadowing cannot see.

Compiled code traces the legacy patch into its graph, so no call reaches the shadow wrapper (such calls are counted
as skipped, reason ``compiling``, when they happen at all). The suite A/B runs a pytest suite twice in fresh
processes: once in the legacy world (the patches installed, every call shadowed: ``--npu-shadow``), once in the
upstream world (the patches removed: ``--npu-shadow-world upstream``), and compares each test's outcome. Each test
becomes one comparison of target ``suite_ab`` in the same journal as the call-level comparisons: ``match`` where
both worlds agree, ``mismatch`` with reason ``exception`` where the outcome changes (both outcomes and the failure
text in the detail), so ``npu-shadow verdict`` and ``report`` weigh it with the rest.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from exporters.journal import JsonlExporter
from shadow.core.model import contract
from shadow.core.model.observation import Observation, Outcome, bounded
from shadow.core.model.run_ids import COMMAND_ID_VARIABLE, command_id, run_id
from shadow_pytest.outcomes import STARTED, recorded_outcomes, session_exit_status

TARGET = "suite_ab"
WORLDS = ("legacy", "upstream")


#: Options of the suite's that ab sets itself (each world, its outcomes and the journal) or that would run no test.
REFUSED_OPTIONS = {
    "--npu-shadow-world": "ab runs the suite in both worlds itself",
    "--npu-shadow-outcomes": "ab records each world's outcomes itself",
    "--npu-shadow-resume": "ab resumes a world itself after a crash",
    "--npu-shadow-journal": "give the journal as ab's own --journal",
    "--co": "a collection runs no test, so nothing would be compared",
    "--collect-only": "a collection runs no test, so nothing would be compared",
    "--collectonly": "a collection runs no test, so nothing would be compared",
    "--setup-plan": "a setup plan runs no test, so nothing would be compared",
    "--setup-only": "setting up fixtures alone runs no test, so nothing would be compared",
    "--fixtures": "listing fixtures runs no test, so nothing would be compared",
    "--funcargs": "listing fixtures runs no test, so nothing would be compared",
    "--fixtures-per-test": "listing fixtures runs no test, so nothing would be compared",
    "--markers": "listing markers runs no test, so nothing would be compared",
    "--version": "pytest's version runs no test, so nothing would be compared",
    "-V": "pytest's version runs no test, so nothing would be compared",
    "--help": "pytest's help runs no test, so nothing would be compared",
    "-h": "pytest's help runs no test, so nothing would be compared",
}

#: The signals ab passes on to the running world's pytest (then stops): a terminal's hang-up, a quit, a user's.
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)

#: A world whose tests crash the interpreter is run again for the rest of its tests at most this many times.
MAX_CRASHES = 50

#: The outcome of a test that started and never ended: it took the interpreter down.
CRASHED = "crashed"


class Stopped(Exception):
    """ab itself was interrupted or terminated: the running world's pytest was stopped with it."""


@dataclasses.dataclass(frozen=True)
class TestOutcome:
    outcome: str  # passed, failed, error, skipped, crashed
    text: str = ""  # the failure's message, first lines


def refused_argument(pytest_args: Sequence[str]) -> str | None:
    """Why one of the suite's arguments cannot be given to ab (an option ab sets itself, or a collection only), or
    None."""
    for arg in pytest_args:
        if arg == "--":
            return None
        option = arg.split("=", 1)[0]
        if option in REFUSED_OPTIONS:
            return f"{option}: {REFUSED_OPTIONS[option]}"
    return None


def journal_problem(journal: str) -> str | None:
    """Why ab cannot write its journal there (the rule of the launcher's --journal), or None."""
    from shadow.launcher.config import SETTINGS
    from shadow.launcher.setting_values import Invalid

    try:
        SETTINGS["journal"].parse(journal)
    except Invalid as exc:
        return exc.why or "not valid"
    return None


def _outcomes(path: str, exit_code: int) -> dict[str, TestOutcome]:
    """{test node id: outcome} as the plugin recorded them; a test that started and never ended crashed."""
    found = {}
    for test, record in recorded_outcomes(path).items():
        if record["outcome"] == STARTED:
            found[test] = TestOutcome(CRASHED, f"the interpreter died in this test ({_exit_text(exit_code)})")
        else:
            found[test] = TestOutcome(record["outcome"], record["text"])
    return found


def _exit_text(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit {code}"


def joined(pytest_args: Sequence[str]) -> list[str]:
    """The suite's arguments with each of the plugin's options and its value as one token (``--opt=value``)."""
    from shadow_pytest import VALUE_OPTIONS

    out: list[str] = []
    args = iter(pytest_args)
    for arg in args:
        if arg == "--":
            out += [arg, *args]
            break
        value = next(args, None) if arg in VALUE_OPTIONS else None
        out.append(arg if value is None else f"{arg}={value}")
    return out


def _run(world: str, pytest_args: Sequence[str], journal: str, report: str, resume: bool) -> int:
    """One world's pytest, to its end; SIGTERM or an interrupt to ab stops it too (raises Stopped)."""
    # (options as one token each: pytest takes a bare value for a path when it looks for the rootdir, and the two
    # worlds must see the same tests by the same ids)
    options = ["--npu-shadow", f"--npu-shadow-journal={journal}", f"--npu-shadow-outcomes={report}"]
    options += ["-p", "no:cacheprovider", f"--npu-shadow-world={world}"] + ["--npu-shadow-resume"] * resume
    pytest_args = joined(pytest_args)
    again = " (the rest of its tests, after a crash)" if resume else ""
    print(f"npu-shadow ab: the {world} world{again}: pytest {' '.join(pytest_args)}", file=sys.stderr, flush=True)
    stopped: list[int] = []
    started: list[subprocess.Popen] = []

    def forward(signum: int, frame: Any) -> None:
        stopped.append(signum)
        for child in started:
            child.send_signal(signum)

    # Caught before the world's pytest starts (no moment where a signal ends ab alone), so that pytest starts with
    # each at its default (an exec resets caught signals); one ab was started ignoring (nohup: SIGHUP; a shell's
    # background job: SIGQUIT) stays ignored, by ab and by its pytest.
    previous = {
        signum: signal.signal(signum, forward)
        for signum in FORWARDED_SIGNALS
        if signal.getsignal(signum) is not signal.SIG_IGN
    }
    try:
        child = subprocess.Popen([sys.executable, "-m", "pytest", *options, *pytest_args])
        started.append(child)
        if stopped:  # (a signal before it started)
            child.send_signal(stopped[0])
        while True:
            try:
                code = child.wait()
                break
            except KeyboardInterrupt:
                forward(signal.SIGINT, None)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if stopped:
        raise Stopped(f"{signal.Signals(stopped[0]).name}: the {world} world's pytest was stopped (exit {code})")
    return code


def _run_world(world: str, pytest_args: Sequence[str], journal: str, report: str) -> dict[str, TestOutcome] | None:
    """Each test's outcome in one world, or None when pytest could not run it. A test that crashes the
    interpreter is a finding (``crashed``): the world goes on with the tests after it, in a fresh pytest."""
    code = _run(world, pytest_args, journal, report, resume=False)
    outcomes = _outcomes(report, code) if os.path.exists(report) else {}
    for _ in range(MAX_CRASHES):
        crashed = [test for test, outcome in outcomes.items() if outcome.outcome == CRASHED]
        if code in (0, 1) or not crashed:  # (1: tests failed, which is data here)
            break
        print(f"npu-shadow ab: {crashed[-1]} crashed the {world} world ({_exit_text(code)})", file=sys.stderr)
        code = _run(world, pytest_args, journal, report, resume=True)
        # (a crash is said with the exit of the pytest it ended; the file holds its ``started`` line still)
        crashes = {test: outcome for test, outcome in outcomes.items() if outcome.outcome == CRASHED}
        outcomes = {**_outcomes(report, code), **crashes}
    finished = session_exit_status(report)
    if code not in (0, 1) and finished in (0, 1) and not any(o.outcome == CRASHED for o in outcomes.values()):
        print(
            f"npu-shadow ab: the {world} world's pytest ended with {_exit_text(code)} after its session finished; "
            "every test's outcome is on record",
            file=sys.stderr,
        )
        return outcomes
    if code not in (0, 1) and not any(o.outcome == CRASHED for o in outcomes.values()):
        print(f"npu-shadow ab: pytest could not run the {world} world ({_exit_text(code)})", file=sys.stderr)
        return None
    if code not in (0, 1):
        print(f"npu-shadow ab: the {world} world crashed {MAX_CRASHES + 1} times; the rest not run", file=sys.stderr)
    return outcomes


def compare_outcomes(legacy: dict[str, TestOutcome], upstream: dict[str, TestOutcome]) -> list[tuple[str, Observation]]:
    """One observation per test that ran in either world."""
    now = time.time()
    found = []
    for test in sorted(set(legacy) | set(upstream)):
        a = legacy.get(test, TestOutcome("not run"))
        b = upstream.get(test, TestOutcome("not run"))
        if a.outcome == b.outcome:
            observation = Observation(TARGET, Outcome.MATCH, signature=f"test/{a.outcome}", timestamp=now)
        else:
            detail = f"legacy world: {a.outcome}" + (f" ({a.text})" if a.text else "")
            detail = (
                bounded(detail, 290)
                + "; "
                + bounded(f"upstream world: {b.outcome}" + (f" ({b.text})" if b.text else ""), 290)
            )
            observation = Observation(
                TARGET, Outcome.MISMATCH, ("exception",), signature=f"test/{a.outcome}->{b.outcome}", detail=detail,
                timestamp=now,
            )  # fmt: skip
        found.append((test, observation))
    return found


def main(pytest_args: Sequence[str], journal: str) -> int:
    """Run the A/B; 0 when no test changes its outcome, 1 when some do (a test that crashes one world's
    interpreter included), 2 when ab's arguments are refused, pytest could not run a world, or ab was stopped."""
    refused = refused_argument(pytest_args)
    problem = journal_problem(journal)
    if refused is not None or problem is not None:
        why = refused if refused is not None else f"--journal {journal}: {problem}"
        print(f"npu-shadow ab: {why}", file=sys.stderr)
        return 2
    # (both worlds and the A/B's own comparisons are one run of one job: they share its run id, made here where
    # none is named, and report the A/B's command)
    run_id()
    os.environ.setdefault(COMMAND_ID_VARIABLE, command_id(["npu-shadow", "ab", *pytest_args]))
    with tempfile.TemporaryDirectory(prefix="npu-shadow-ab-") as scratch:
        outcomes = {}
        for world in WORLDS:
            try:
                found = _run_world(world, pytest_args, journal, os.path.join(scratch, f"{world}.jsonl"))
            except Stopped as exc:
                print(f"npu-shadow ab: stopped by {exc}; nothing compared", file=sys.stderr)
                return 2
            if found is None:
                return 2
            outcomes[world] = found
    compared = compare_outcomes(outcomes["legacy"], outcomes["upstream"])
    where = {"test": "", "phase": "suite A/B"}
    exporter = JsonlExporter(journal, all_outcomes=True, annotate=lambda: where)
    try:
        for test, observation in compared:
            where["test"] = test
            exporter.record(contract.observation_samples(observation))  # (its counts, then its line; errors raised)
            exporter.export(observation)
    finally:
        exporter.close()
    changed = [(t, o) for t, o in compared if o.outcome != Outcome.MATCH]
    print(f"npu-shadow ab: {len(compared)} tests, {len(changed)} changed their outcome without the patches")
    for test, observation in changed:
        print(f"  {test}: {observation.detail}")
    print(f"journal: {journal} (target {TARGET}; `npu-shadow verdict --journal {journal}` weighs it)")
    return 1 if changed else 0
