"""``npu-shadow run``: a job's command with the monitor in every Python process it starts."""

from __future__ import annotations

import argparse
from typing import Any

from shadow.launcher.commands.options import add_emulate_npu


def add(commands: Any) -> None:
    """``npu-shadow run``."""
    from shadow.launcher.config import FLAGS, SETTINGS

    run = commands.add_parser(
        "run",
        help="run COMMAND with the monitor installed in every Python process it starts",
        description="Run COMMAND shadowed. Each option overrides its environment variable; bad values stop "
        "here with exit code 2, before COMMAND starts. The exit code is COMMAND's.",
    )
    for name, setting in SETTINGS.items():
        if setting.option is None:  # (a secret: from the environment only)
            continue
        if name in FLAGS:
            run.add_argument(setting.option, dest=name, action="store_true", help=f"{FLAGS[name]} ({setting.variable})")
        elif name == "emulate_npu":
            add_emulate_npu(run, "give every process of the job N emulated npu devices")
        else:
            run.add_argument(setting.option, dest=name, metavar="VALUE", help=f"{setting.accepts} ({setting.variable})")
    run.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")
    run.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    from shadow.launcher import config as cfg
    from shadow.launcher.runner import run

    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    options = {name: getattr(args, name, None) for name in cfg.SETTINGS}
    for flag in cfg.FLAGS:
        options[flag] = "1" if getattr(args, flag) else None
    return run(command, options)
