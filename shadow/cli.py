"""The ``npu-shadow`` command."""

from __future__ import annotations

import argparse
import sys

#: Exit codes: 0 ok, 1 a difference was found, 2 usage error.
EXIT_OK, EXIT_DIFFERENT, EXIT_USAGE = 0, 1, 2


def _replay(args: argparse.Namespace) -> int:
    from exporters import capture
    from shadow.replay import replay

    try:
        data = capture.load(args.capture)
    except (OSError, ValueError, RuntimeError) as exc:
        print(f"npu-shadow replay: cannot read {args.capture}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(f"capture: target {data['target']}, signature {data['signature']}, recorded {data['outcome']}")
    print(f"  recorded: {data['detail']}")
    try:
        result, text = replay(data)
    except (ImportError, AttributeError, ValueError) as exc:
        print(f"npu-shadow replay: cannot re-run: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if result is None:
        print(f"  not re-run: {text}")
        return EXIT_OK
    reasons = f" ({', '.join(result.reasons)})" if result.reasons else ""
    print(f"  replayed: {result.outcome}{reasons}: {text}")
    return EXIT_DIFFERENT if result.outcome == "mismatch" else EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="npu-shadow", description="Shadow torch_npu's patches against upstream.")
    commands = parser.add_subparsers(dest="command", required=True)
    replay = commands.add_parser("replay", help="re-run legacy and upstream on a repro capture and compare")
    replay.add_argument("capture", help="a .pt file written by JsonlExporter(capture_dir=...)")
    replay.set_defaults(handler=_replay)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
