"""``npu-shadow receiver``: Alertmanager's webhooks turned into rollbacks of the jobs they name."""

from __future__ import annotations

import argparse
import os
from typing import Any

from shadow.launcher.commands.options import Defaults


def add(commands: Any) -> None:
    """``npu-shadow receiver``."""
    receiver = commands.add_parser(
        "receiver",
        help="an Alertmanager webhook receiver that throws the rollback switch of the job an alert names",
        description="Receives Alertmanager's webhooks on LISTEN/alerts; each firing alert labelled action=rollback "
        "throws the switch of its job (--switch JOB=URL, the job's --rollback-port endpoint), with the token in "
        "NPU_SHADOW_ROLLBACK_TOKEN. Alertmanager's posts carry the bearer token in NPU_SHADOW_RECEIVER_TOKEN (its "
        "webhook http_config; anything else is refused). Prints one JSON line per flip, and per rollback alert "
        "naming a job without a switch.",
        formatter_class=Defaults,
    )
    receiver.add_argument("--listen", default="127.0.0.1:9095", metavar="HOST:PORT", help="where Alertmanager posts")
    receiver.add_argument("--switch", action="append", default=[], metavar="JOB=URL", help="a job's rollback endpoint")
    receiver.add_argument(
        "--listen-anywhere",
        action="store_true",
        help="allow --listen on an address other than loopback (anyone who reaches it can post)",
    )
    receiver.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    from shadow.launcher import receiver

    return receiver.main(
        args.listen,
        args.switch,
        os.environ.get("NPU_SHADOW_ROLLBACK_TOKEN"),
        os.environ.get("NPU_SHADOW_RECEIVER_TOKEN"),
        anywhere=args.listen_anywhere,
    )
