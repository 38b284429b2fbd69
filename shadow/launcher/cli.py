"""The ``npu-shadow`` command: its parser, made of each command's own (:mod:`shadow.launcher.commands`), and
``main``."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys

from shadow.launcher.commands import ab, census, doctor, receiver, replay, report, run, validate, verdict
from shadow.launcher.commands.options import Parser

#: The commands, in the order ``npu-shadow --help`` lists them.
COMMANDS = (replay, run, doctor, validate, verdict, ab, receiver, report, census)


def build_parser() -> argparse.ArgumentParser:
    """The whole command line's parser: ``--version`` and every command's."""
    from importlib.metadata import PackageNotFoundError, version

    parser = Parser(prog="npu-shadow", description="Shadow torch_npu's patches against upstream.")
    try:
        known = version("npu-shadow")
    except PackageNotFoundError:  # (run from a checkout that was never installed)
        known = "unknown (not installed)"
    parser.add_argument("--version", action="version", version=f"npu-shadow {known}")
    commands = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command ``argv`` names (default: this process's arguments); its exit code."""
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except BrokenPipeError:  # (`npu-shadow verdict ... | head`: the reader left, as with any Unix tool)
        with contextlib.suppress(OSError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())  # (no second BrokenPipeError when Python flushes stdout at exit)
        return 128 + signal.SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
