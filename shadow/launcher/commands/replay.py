"""``npu-shadow replay``: re-run legacy and upstream on a repro capture and compare them again."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from shadow.core.model.observation import DIVERGENT_OUTCOMES
from shadow.launcher.commands.options import EXIT_DIFFERENT, EXIT_OK, EXIT_USAGE, Defaults, terminal_text


def add(commands: Any) -> None:
    """``npu-shadow replay``."""
    replay = commands.add_parser(
        "replay",
        help="re-run legacy and upstream on a repro capture and compare",
        description="Re-run legacy and upstream on a repro capture (a .pt file a journal's capture_dir holds) and "
        "compare them as the monitor did. Exit code: 0 they agree, 1 they still differ, 2 a capture that cannot be "
        "read or asks for anything else.",
        formatter_class=Defaults,
    )
    replay.add_argument("capture", help="a .pt file written by JsonlExporter(capture_dir=...)")
    replay.add_argument("--legacy", metavar="MODULE:FUNCTION", help="a custom target's legacy function")
    replay.add_argument("--upstream", metavar="MODULE:FUNCTION", help="a custom target's upstream function")
    replay.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    from exporters import capture
    from shadow.analysis.replay import current_device, devices_needed, replay, resolve
    from shadow.npu import emulated

    try:
        locations: set[str] = set()
        data = capture.load(args.capture, locations)
        needed = devices_needed(data, locations)
        if needed is not None and needed[0] == "npu":
            print("(the capture ran on npu: replaying on the emulated npu)", flush=True)
            emulated.install(max(2, needed[1]))
            data = capture.load(args.capture)  # (its tensors onto the npu now)
    except emulated.EmulatorUnavailable as exc:
        print(f"npu-shadow replay: the capture ran on npu, and the emulated npu is unavailable: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (OSError, ValueError, RuntimeError) as exc:
        print(f"npu-shadow replay: cannot read {args.capture}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        legacy = resolve(args.legacy) if args.legacy else None
        upstream = resolve(args.upstream) if args.upstream else None
    except (ImportError, AttributeError, ValueError) as exc:
        print(f"npu-shadow replay: {exc}", file=sys.stderr)
        return EXIT_USAGE
    shown = terminal_text  # (a capture is data from elsewhere: no escape sequence of its reaches the terminal)
    run = f" in run {shown(str(data['run']))}" if isinstance(data.get("run"), str) else ""
    print(f"capture: target {shown(data['target'])}, signature {shown(data['signature'])}, "
          f"recorded {shown(data['outcome'])}{run}")  # fmt: skip
    print(f"  recorded: {shown(data['detail'])}")
    print(f"  {_where(data, current_device(data))}")
    try:
        result, text = replay(data, legacy, upstream)
    except ValueError as exc:
        print(f"npu-shadow replay: refused: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if result is None:
        print(f"  not re-run: {terminal_text(text)}")
        return EXIT_OK
    if text.startswith("both sides raised"):
        print(f"  replayed: {terminal_text(text)}")
    else:
        reasons = f" ({', '.join(result.reasons)})" if result.reasons else ""
        print(f"  replayed: {result.outcome}{reasons}: {terminal_text(text)}")
    return EXIT_DIFFERENT if result.outcome in DIVERGENT_OUTCOMES else EXIT_OK


def _where(data: dict, index: int | None) -> str:
    """Where the replay runs: the device (emulated or not) and the current device the capture recorded."""
    import torch

    from shadow.npu import emulated

    accelerator = torch.accelerator.current_accelerator()
    if accelerator is None:
        place = "on the CPU"
    elif emulated.installed_devices():
        place = f"on the emulated npu ({emulated.installed_devices()} devices)"
    else:
        place = f"on {accelerator.type} ({torch.accelerator.device_count()} devices)"
    current = f"current device {accelerator.type}:{index}" if accelerator is not None and index is not None else ""
    recorded = data.get("device")
    if not current:
        current = f"the recorded current device {recorded} is not here" if recorded else "no current device recorded"
    return f"replaying {place}, {current}"
