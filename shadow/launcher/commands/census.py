"""``npu-shadow census``: what a torch_npu release replaces in torch; with the fleet's evidence, the patch board."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from shadow.launcher.commands.options import EXIT_OK, EXIT_USAGE, Defaults, add_timeout, prometheus_url, rate


def add(commands: Any) -> None:
    """``npu-shadow census``."""
    from shadow.analysis.decisions import DEFAULT_MAX_RATE

    count = commands.add_parser(
        "census",
        help="list what a torch_npu release replaces in torch, from its source alone",
        description="Every attribute of torch a torch_npu release replaces or adds, read from its source (never "
        "imported): the file and function that assigns it, its kind, when it is applied, and the npu-shadow target "
        "that shadows it. SOURCE: a torch_npu wheel, a version in the wheel cache (2.13.0), a directory holding the "
        "torch_npu package, or 'installed'. Exit 0, or 2 for a source that cannot be read.",
        formatter_class=Defaults,
    )
    count.add_argument("source", metavar="SOURCE", help="the release to read")
    count.add_argument("--against", metavar="SOURCE", help="also list what changed since this release")
    count.add_argument("--format", choices=("text", "json"), default="text", help="output format")
    calls = count.add_mutually_exclusive_group()
    calls.add_argument(
        "--journal",
        nargs="+",
        metavar="PATH",
        help="rank the patches by the calls these jobs' journals counted "
        "(npu-shadow run --legacy-from RELEASE), with what covers each and that evidence's decision",
    )
    calls.add_argument(
        "--prometheus",
        metavar="URL",
        type=prometheus_url,
        help="the same from a Prometheus server or any PromQL store (VictoriaMetrics): every run it holds",
    )
    count.add_argument("--selector", default="", help='with --prometheus: series selector, e.g. job="train"')
    add_timeout(count)
    count.add_argument(
        "--max-rate", type=rate, default=DEFAULT_MAX_RATE, help="tolerated divergence rate of the decisions"
    )
    count.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    import json

    from shadow.analysis import census, census_cache
    from shadow.analysis.sources import SourceError
    from shadow.npu.release_files import LegacySourceError, printable

    try:
        taken = census_cache.kept(args.source)
        against = census_cache.kept(args.against) if args.against else None
        evidence = _evidence(args) if args.journal or args.prometheus else None
    except (LegacySourceError, OSError, SourceError) as exc:
        print(f"npu-shadow census: {printable(str(exc))}", file=sys.stderr)
        return EXIT_USAGE
    if evidence is not None:
        return _board(taken, *evidence, args.format)
    if args.format == "json":
        found = taken.as_dict()
        if against is not None:
            changed = census.difference(taken, against)
            found["against"] = {"source": against.source, "version": against.version, **changed}
        print(json.dumps(found, indent=2))
        return EXIT_OK
    # (names and files come from the release's source: printed with their control characters escaped)
    shown = f"torch_npu {taken.version} ({taken.source}): {len(taken.patches)} attributes of torch replaced or added"
    print(printable(shown))
    print(f"{'patched':<64} {'kind':<12} {'applied':<22} {'shadowed by':<15} where")
    for patch in taken.patches:
        where = f"{patch.file}:{patch.line} {patch.function}" + (f" (table {patch.table})" if patch.table else "")
        row = f"{patch.name:<64} {patch.kind:<12} {patch.applied:<22} {patch.shadowed_by or '-':<15} {where}"
        print(printable(row))
    if against is not None:
        changed = census.difference(taken, against)
        print(f"against torch_npu {printable(against.version)}: {len(changed['added'])} added, "
              f"{len(changed['removed'])} removed")  # fmt: skip
        for name in changed["removed"]:
            print(f"  removed: {printable(name)}")
        for name in changed["added"]:
            print(f"  added:   {printable(name)}")
    return EXIT_OK


def _evidence(args: argparse.Namespace) -> tuple[dict[str, float], dict[str, str]]:
    """The jobs' calls of each function patch and each target's decision, every process and run of the journals or
    the Prometheus server together (raises SourceError). A source with calls and no comparison yet ranks the calls
    alone."""
    from shadow.analysis import patch_board
    from shadow.analysis.sources import (
        JournalReader,
        SourceError,
        from_journal,
        from_prometheus,
        patch_calls,
        patch_calls_from_prometheus,
        with_rotated,
    )

    calls: dict[str, float] = {}
    try:
        if args.prometheus:
            counts = from_prometheus(args.prometheus, None, args.selector, args.timeout, all_runs=True, patches=calls)
        else:
            counts = from_journal(args.journal, [], all_runs=True, patches=calls)
    except SourceError:
        if args.prometheus:
            return patch_calls_from_prometheus(args.prometheus, args.selector, args.timeout), {}
        reader = JournalReader()
        reader.read(with_rotated(args.journal)[0])
        return patch_calls(reader), {}
    return calls, patch_board.decisions_of(counts, args.max_rate)


def _board(taken: Any, calls: dict[str, float], decisions: dict[str, str], form: str) -> int:
    """``census RELEASE --journal ...`` or ``--prometheus URL``: the patch board (the release's patches ranked by
    the jobs' calls, with what covers each and that evidence's decision)."""
    import json

    from shadow.analysis import patch_board
    from shadow.npu.release_files import printable

    rows = patch_board.board(taken, calls, decisions)
    called = [row for row in rows if row.calls]
    if form == "json":
        print(json.dumps({"source": taken.source, "version": taken.version, "called": len(called),
                          "patches": [row.as_dict() for row in rows]}, indent=2))  # fmt: skip
        return EXIT_OK
    print(printable(f"torch_npu {taken.version}: the jobs called {len(called)} of its {len(rows)} patches"))
    print(f"{'calls':>12}  {'patched':<56} {'kind':<10} {'applied':<22} {'decision':<13} covered by")
    for row in called:
        patch = row.patch
        print(printable(f"{row.calls:>12,}  {patch.name:<56} {patch.kind:<10} {patch.applied:<22} {row.decision:<13} "
                        f"{row.covered_by}"))  # fmt: skip
    if not called:
        print("(no call counted: run the jobs under npu-shadow run --legacy-from RELEASE --journal PATH)")
    return EXIT_OK
