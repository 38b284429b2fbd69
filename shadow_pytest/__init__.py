"""pytest plugin: run any test suite with torch_npu's patches shadowed, ``pytest --npu-shadow``.

Registered through the ``pytest11`` entry point and inert unless ``--npu-shadow`` is given: this module imports
neither torch nor npu-shadow, so a suite that does not ask pays nothing. With the option, the session (in
:mod:`shadow_pytest.session`) installs the monitor at sample rate 1.0 before test modules are imported and
attributes every observation to the test that made the call.
"""

from __future__ import annotations

import itertools
import os
from typing import Any

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("npu-shadow", "shadow torch_npu's patches against upstream (npu-shadow)")
    group.addoption("--npu-shadow", action="store_true", help="shadow every call of the patched functions")
    group.addoption("--npu-shadow-strict", action="store_true", help="a divergence fails the test that made the call")
    group.addoption(
        "--npu-shadow-legacy",
        choices=("auto", "torch_npu", "reference"),
        default="auto",
        help="the legacy side: torch_npu imported, or shadow.npu.reference (auto: torch_npu where it is installed)",
    )
    group.addoption(
        "--npu-shadow-legacy-from",
        metavar="PATH",
        help="torch_npu's own legacy, from a wheel, a directory holding torch_npu, or 'installed'",
    )
    group.addoption(
        "--npu-shadow-emulate-npu", type=int, default=0, metavar="N", help="N emulated npu devices (0: none)"
    )
    group.addoption(
        "--npu-shadow-targets", metavar="NAMES", help="comma list of built-in targets (default: all active)"
    )
    group.addoption(
        "--npu-shadow-pure-hooks",
        action="store_true",
        help="the suite's module hooks have no side effects: compare calls that run them (default: skip, reason hooks)",
    )
    group.addoption(
        "--npu-shadow-trusted-checkpoints",
        action="store_true",
        help="the suite's checkpoints are safe to unpickle twice: torch_load compares loads that run their code "
        "(default: skip, reason ineligible)",
    )
    group.addoption(
        "--npu-shadow-backward-rate",
        metavar="RATE",
        help="a fraction in [0, 1] of compared DataParallel calls whose gradients are compared too (reason grad; "
        "default: NPU_SHADOW_BACKWARD_RATE, else 0)",
    )
    group.addoption(
        "--npu-shadow-truth-rate",
        metavar="RATE",
        help="a fraction in [0, 1] of calls whose sides differ in value that run again in float64, to tell which "
        "side is nearer the truth (default: NPU_SHADOW_TRUTH_RATE, else 0)",
    )
    group.addoption(
        "--npu-shadow-world",
        choices=("legacy", "upstream"),
        default="legacy",
        help="legacy: the patches installed and every call shadowed (default); upstream: the patches removed, "
        "nothing shadowed (the second run of `npu-shadow ab`, a suite A/B)",
    )
    group.addoption(
        "--npu-shadow-outcomes",
        metavar="PATH",
        help="write each test's outcome (and failure text) to this JSON file (what `npu-shadow ab` compares)",
    )
    group.addoption(
        "--npu-shadow-resume",
        action="store_true",
        help="with --npu-shadow-outcomes: keep the file's outcomes and run only the tests it does not hold "
        "(how `npu-shadow ab` runs the rest of a world after a test crashed the interpreter)",
    )
    group.addoption(
        "--npu-shadow-journal",
        default="npu-shadow-tests.jsonl",
        metavar="PATH",
        help="the journal of every comparison, with its test (default npu-shadow-tests.jsonl)",
    )


#: The plugin's options that take a value: pytest finds its rootdir before it knows them, so a value given as
#: the next argument (``--npu-shadow-legacy-from PATH``) is taken for a test path there.
VALUE_OPTIONS = (
    "--npu-shadow-legacy",
    "--npu-shadow-legacy-from",
    "--npu-shadow-emulate-npu",
    "--npu-shadow-targets",
    "--npu-shadow-backward-rate",
    "--npu-shadow-truth-rate",
    "--npu-shadow-world",
    "--npu-shadow-outcomes",
    "--npu-shadow-journal",
)


def values_apart(args: list[str]) -> list[tuple[str, str]]:
    """(option, value) for each of the plugin's options given with its value as the next argument, where that
    value names an existing file or directory (which pytest took for a test path when finding its rootdir)."""
    found = []
    for option, value in itertools.pairwise(args):
        if option == "--":
            break
        if option in VALUE_OPTIONS and os.path.exists(value):
            found.append((option, value))
    return found


@pytest.hookimpl(trylast=True)  # after conftest.py files have configured (an emulated npu, say)
def pytest_configure(config: pytest.Config) -> None:
    apart = values_apart(list(config.invocation_params.args))
    if apart:
        option, value = apart[0]
        raise pytest.UsageError(
            f"{option} {value}: pytest took {value!r} for a test path when it chose its rootdir ({config.rootpath}) "
            f"and config file, before this plugin's options were known; write {option}={value}"
        )
    if not config.getoption("npu_shadow"):
        return
    from shadow_pytest.session import ShadowSession, UpstreamWorld

    world = UpstreamWorld if config.getoption("npu_shadow_world") == "upstream" else ShadowSession
    config.pluginmanager.register(world(config), "npu-shadow-session")
    # (an xdist worker's reports reach the controller, which records them all)
    if config.getoption("npu_shadow_outcomes") and not hasattr(config, "workerinput"):
        from shadow_pytest.outcomes import OutcomeRecorder

        recorder = OutcomeRecorder(config.getoption("npu_shadow_outcomes"), config.getoption("npu_shadow_resume"))
        config.pluginmanager.register(recorder, "npu-shadow-outcomes")


def pytest_report_header(config: pytest.Config) -> Any:
    if config.getoption("npu_shadow"):
        session = config.pluginmanager.get_plugin("npu-shadow-session")
        return session.header() if session is not None else None
    return None
