"""``npu-shadow ab``: a pytest suite in the legacy and the upstream world, each test's outcome compared."""

from __future__ import annotations

import argparse
from typing import Any

from shadow.launcher.commands.options import Defaults


def add(commands: Any) -> None:
    """``npu-shadow ab``."""
    ab = commands.add_parser(
        "ab",
        help="run a pytest suite with and without torch_npu's patches and compare each test's outcome (exit 0, 1)",
        description="A suite A/B, for what call-level shadowing cannot see (compiled code): the suite runs in the "
        "legacy world (--npu-shadow) and in the upstream world (--npu-shadow-world upstream); each test is one "
        "comparison of target suite_ab in the journal; a test that crashes a world's interpreter is 'crashed' there, "
        "and the world goes on with the tests after it. Exit code: 0 no test changed, 1 some did, 2 refused "
        "arguments (the --npu-shadow-world, -outcomes, -resume and -journal options, --co), a world that could not "
        "run, or ab stopped (SIGTERM, Ctrl-C: the running pytest is stopped with it).",
        formatter_class=Defaults,
    )
    ab.add_argument("--journal", default="npu-shadow-tests.jsonl", metavar="PATH", help="the journal both write to")
    ab.add_argument("pytest_args", nargs=argparse.REMAINDER, help="-- PYTEST_ARGS (with --npu-shadow-* options)")
    ab.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    from shadow.launcher import ab

    pytest_args = args.pytest_args[1:] if args.pytest_args[:1] == ["--"] else args.pytest_args
    return ab.main(pytest_args, args.journal)
