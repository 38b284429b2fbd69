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
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

from exporters.journal import JsonlExporter
from shadow.core.observation import Observation, Outcome, bounded

TARGET = "suite_ab"
WORLDS = ("legacy", "upstream")


@dataclasses.dataclass(frozen=True)
class TestOutcome:
    outcome: str  # passed, failed, error, skipped
    text: str = ""  # the failure's message, first lines


def _outcomes(path: str) -> dict[str, TestOutcome]:
    """{test node id: outcome} as the plugin wrote them (``--npu-shadow-outcomes``)."""
    with open(path) as handle:
        data = json.load(handle)
    return {str(test): TestOutcome(str(o.get("outcome", "")), str(o.get("text", ""))) for test, o in data.items()}


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


def _run(world: str, pytest_args: Sequence[str], journal: str, report: str) -> int:
    # (options as one token each: pytest takes a bare value for a path when it looks for the rootdir, and the two
    # worlds must see the same tests by the same ids)
    options = ["--npu-shadow", f"--npu-shadow-journal={journal}", f"--npu-shadow-outcomes={report}"]
    options += ["-p", "no:cacheprovider", f"--npu-shadow-world={world}"]
    pytest_args = joined(pytest_args)
    print(f"npu-shadow ab: the {world} world: pytest {' '.join(pytest_args)}", file=sys.stderr, flush=True)
    return subprocess.run([sys.executable, "-m", "pytest", *options, *pytest_args]).returncode


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
    """Run the A/B; 0 when no test changes its outcome, 1 when some do, 2 when pytest could not run a world."""
    with tempfile.TemporaryDirectory(prefix="npu-shadow-ab-") as scratch:
        outcomes = {}
        for world in WORLDS:
            report = os.path.join(scratch, f"{world}.json")
            code = _run(world, pytest_args, journal, report)
            if code not in (0, 1) or not os.path.exists(report):  # (1: tests failed, which is data here)
                print(f"npu-shadow ab: pytest could not run the {world} world (exit {code})", file=sys.stderr)
                return 2
            outcomes[world] = _outcomes(report)
    compared = compare_outcomes(outcomes["legacy"], outcomes["upstream"])
    where = {"test": "", "phase": "suite A/B"}
    exporter = JsonlExporter(journal, all_outcomes=True, annotate=lambda: where)
    try:
        for test, observation in compared:
            where["test"] = test
            exporter.export(observation)
    finally:
        exporter.close()
    changed = [(t, o) for t, o in compared if o.outcome != Outcome.MATCH]
    print(f"npu-shadow ab: {len(compared)} tests, {len(changed)} changed their outcome without the patches")
    for test, observation in changed:
        print(f"  {test}: {observation.detail}")
    print(f"journal: {journal} (target {TARGET}; `npu-shadow verdict --journal {journal}` weighs it)")
    return 1 if changed else 0
