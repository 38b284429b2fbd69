"""``npu-shadow doctor``: can this host shadow, and if not, why."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from shadow.launcher.commands.options import Defaults, add_emulate_npu


def add(commands: Any) -> None:
    """``npu-shadow doctor``."""
    from shadow.launcher.config import SETTINGS

    doctor = commands.add_parser(
        "doctor",
        help="check that this host can shadow (exit 0) or say why not (1)",
        description="Check that this host can shadow: torch, the accelerator, the legacy side npu-shadow run would "
        "use, the Prometheus port, and a self-test of tensor_type. Exit code: 0 ok, 1 not (each line says why).",
        formatter_class=Defaults,
    )
    doctor.add_argument("--port", type=int, default=9464, help="the Prometheus port to try")
    doctor.add_argument("--addr", default="127.0.0.1", help="the address to try the port on")
    add_emulate_npu(doctor, "check with N emulated npu devices installed")
    legacy = SETTINGS["legacy_from"]
    doctor.add_argument(
        "--legacy-from", metavar="PATH", help=f"check with torch_npu's own legacy: {legacy.accepts} ({legacy.variable})"
    )
    doctor.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    from shadow.launcher import config as cfg

    if not 0 <= args.port <= 65535:
        print(
            f"npu-shadow doctor: --port={args.port} is not valid; expected a port number in 0..65535", file=sys.stderr
        )
        return 2
    if "torch" not in sys.modules:  # (its checks are torch's: a second or two before the first of them)
        print("npu-shadow doctor: loading torch to check it...", file=sys.stderr, flush=True)
    from shadow.launcher.doctor import diagnose

    try:
        config = cfg.from_sources(os.environ, {"emulate_npu": args.emulate_npu, "legacy_from": args.legacy_from})
    except cfg.ConfigError as exc:
        print(f"npu-shadow doctor: {exc}", file=sys.stderr)
        return 2
    code, lines = diagnose(args.port, args.addr, emulate_npu=config.emulate_npu, legacy_from=config.legacy_from)
    for line in lines:
        print(line)
    if code != 0:
        print("not ok: see above")
    return code
