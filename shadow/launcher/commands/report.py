"""``npu-shadow report``: the evidence of a run as Markdown and HTML for the pull request."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from shadow.launcher.commands.options import (
    EXIT_OK,
    EXIT_USAGE,
    Defaults,
    add_evidence_options,
    count,
    prometheus_range,
    range_problem,
)


def add(commands: Any) -> None:
    """``npu-shadow report``."""
    paper = commands.add_parser(
        "report",
        help="the evidence as Markdown (and HTML) for the pull request that deletes the patches",
        description="Counts from --prometheus or --metrics-file (else from the journals); details and tests "
        "from --journal. Exit 0, or 2 on a source or usage error.",
        formatter_class=Defaults,
    )
    add_evidence_options(paper, paper.add_mutually_exclusive_group())
    paper.add_argument("--journal", metavar="PATH", nargs="+", help="JSONL journals (details, tests)")
    paper.add_argument("--details", type=count, default=5, help="details shown per group of divergences")
    paper.add_argument("--markdown", metavar="PATH", help="write the Markdown here (default: standard output)")
    paper.add_argument("--html", metavar="PATH", help="also write a self-contained HTML file")
    paper.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    from shadow.analysis import report
    from shadow.analysis.sources import SourceError
    from shadow.core.model.observation import BUILTIN_RISKY

    if not (args.journal or args.metrics_file or args.prometheus):
        print("npu-shadow report: give --journal, --metrics-file or --prometheus", file=sys.stderr)
        return EXIT_USAGE
    if problem := range_problem(args):
        print(f"npu-shadow report: {problem}", file=sys.stderr)
        return EXIT_USAGE
    sources = [f"Prometheus {args.prometheus}"] if args.prometheus else []
    sources += [f"metrics file {args.metrics_file}"] if args.metrics_file else []
    sources += [f"journals {', '.join(args.journal)}"] if args.journal else []
    try:
        evidence = _report_evidence(args)
    except SourceError as exc:
        print(f"npu-shadow report: {exc}", file=sys.stderr)
        return EXIT_USAGE
    risky: dict[str, list[str]] = {name: list(patterns) for name, patterns in BUILTIN_RISKY.items()}
    overall, sections = report.build(evidence, sources, args.max_rate, risky, args.min_per_signature)
    markdown = report.to_markdown(overall, sections)
    try:
        if args.markdown and args.markdown != "-":
            with open(args.markdown, "w", encoding="utf-8") as handle:
                handle.write(markdown)
        if args.html:
            with open(args.html, "w", encoding="utf-8") as handle:
                handle.write(report.to_html(overall, sections))
    except OSError as exc:
        print(f"npu-shadow report: cannot write: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if not args.markdown or args.markdown == "-":
        print(markdown, end="")
    else:
        print(f"npu-shadow report: {overall}; written to {args.markdown}" + (f" and {args.html}" if args.html else ""))
    return EXIT_OK


def _report_evidence(args: argparse.Namespace) -> Any:
    """The report's evidence: the metrics source's counts (and its patches' calls) where one is given, the journals'
    details beside them (raises SourceError)."""
    from shadow.analysis import report
    from shadow.analysis.sources import environment_from_exposition, from_exposition, from_prometheus, read_text

    counts = None
    environment: dict = {}
    slices: dict[str, dict] = {}
    patches: dict[str, float] = {}
    if args.prometheus:
        counts = from_prometheus(
            args.prometheus, args.window, args.selector, **prometheus_range(args), recent=args.recent,
            slices=slices, environment=environment, patches=patches,
        )  # fmt: skip
    elif args.metrics_file:
        text = read_text(args.metrics_file)
        counts = from_exposition(text, args.metrics_file, args.run, args.all_runs, slices=slices, patches=patches)
        environment = environment_from_exposition(text)
    evidence = report.collect(
        args.journal or (), counts, details=args.details, window=args.cluster_window, environment=environment,
        run=args.run, all_runs=args.all_runs, recent=args.recent, slices=slices,
    )  # fmt: skip
    if patches:  # (the metrics source's counts of the patches, like its counts of comparisons, come first)
        evidence.patch_calls = patches
    return evidence
