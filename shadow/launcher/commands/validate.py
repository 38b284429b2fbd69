"""``npu-shadow validate``: the device check on this host's accelerator, and its bundle."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from shadow.launcher.commands.options import Defaults


def add(commands: Any) -> None:
    """``npu-shadow validate``."""
    validate = commands.add_parser(
        "validate",
        help="check npu-shadow on this host's NPU or GPU (the emulated npu where there is none) and write the bundle",
        description="Run the device check (scripts/device_check.sh): training bitwise unchanged in shadow and canary "
        "modes, mismatches under nondeterministic kernels, step time and peak device memory at the defaults, 1% "
        "and 100%, host synchronizations per sampled call, the comparator against assert_close; writes "
        "device-check.json and device-check.md. Exit code: 0 training stayed bitwise unchanged, 1 it did not.",
        formatter_class=Defaults,
    )
    validate.add_argument("--out", default="npu-shadow-device-check", help="the folder the bundle is written to")
    validate.add_argument("--small", action="store_true", help="a quick run (CI's, on the emulated npu)")
    validate.add_argument(
        "--emulated-device", metavar="SPEC", help="the emulated npu's properties where no device is present"
    )
    validate.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    from shadow.launcher import config as cfg
    from shadow.launcher import setting_values

    if args.emulated_device is not None:
        try:
            cfg.SETTINGS["emulated_device"].parse(args.emulated_device)
        except setting_values.Invalid as exc:
            print(
                f"npu-shadow validate: --emulated-device={args.emulated_device!r} is not valid: {exc}", file=sys.stderr
            )
            return 2
    problem = _folder_problem(args.out)
    if problem:  # (before the checks run: minutes, then nowhere to write their bundle)
        print(f"npu-shadow validate: --out={args.out!r} is not valid: {problem}", file=sys.stderr)
        return 2
    from shadow.launcher import validate

    return validate.main(args.out, args.small, args.emulated_device)


def _folder_problem(path: str) -> str | None:
    """Why ``path`` cannot be the folder a bundle is written to (made here where it is not yet), or None."""
    if not path.strip():
        return "empty (name a folder)"
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        return f"cannot be made a folder: {exc.strerror or exc}"
    if not os.access(path, os.W_OK):
        return "a folder this user cannot write"
    return None
