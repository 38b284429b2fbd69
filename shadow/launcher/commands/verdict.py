"""``npu-shadow verdict``: promote, rollback or inconclusive per target from a source's evidence, as a table or JSON."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from shadow.launcher.commands.options import (
    EXIT_USAGE,
    Defaults,
    add_evidence_options,
    prometheus_range,
    range_problem,
)


def add(commands: Any) -> None:
    """``npu-shadow verdict``."""
    decide = commands.add_parser(
        "verdict",
        help="promote, rollback or inconclusive, per target (exit 0, 1, 3)",
        description="Decide from the evidence whether upstream can replace the legacy patches. Exit code: "
        "0 promote, 1 rollback, 3 inconclusive (the worst target's), 2 usage or source error.",
        formatter_class=Defaults,
    )
    source = decide.add_mutually_exclusive_group(required=True)  # (formatter below)
    add_evidence_options(decide, source)
    source.add_argument(
        "--journal", metavar="PATH", nargs="+", help="JSONL journals (their rotated files PATH.1, ... are read too)"
    )
    decide.add_argument(
        "--risky", type=_risky, action="append", default=[], metavar="TARGET=PATTERN", help="another risky signature"
    )
    decide.add_argument("--format", choices=("table", "json"), default="table", help="how to print the decisions")
    decide.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    import json

    from shadow.analysis import arms, verdict
    from shadow.analysis.decisions import EXIT_CODES, overall
    from shadow.analysis.patch_evidence import unspoken
    from shadow.analysis.sources import SourceError, from_exposition, from_journal, from_prometheus, read_text
    from shadow.core.model.observation import BUILTIN_RISKY

    arm_records: list[dict] = []
    arm_series: list[tuple[str, dict[str, str], float]] = []
    slices: dict[str, dict] = {}
    patches: dict[str, float] = {}
    if problem := range_problem(args):
        print(f"npu-shadow verdict: {problem}", file=sys.stderr)
        return EXIT_USAGE
    try:
        if args.prometheus:
            counts = from_prometheus(
                args.prometheus, args.window, args.selector, **prometheus_range(args), arms=arm_series,
                recent=args.recent, slices=slices, patches=patches,
            )  # fmt: skip
        elif args.metrics_file:
            counts = from_exposition(
                read_text(args.metrics_file), args.metrics_file, args.run, args.all_runs, arms=arm_series,
                slices=slices, patches=patches,
            )  # fmt: skip
        else:
            counts = from_journal(
                args.journal, torn := [], args.cluster_window, args.run, args.all_runs, arm_records,
                recent=args.recent, slices=slices, patches=patches,
            )  # fmt: skip
            if torn:
                print(f"npu-shadow verdict: skipped {len(torn)} torn line(s): {', '.join(torn)}", file=sys.stderr)
    except (SourceError, OSError) as exc:
        print(f"npu-shadow verdict: {exc}", file=sys.stderr)
        return EXIT_USAGE
    risky: dict[str, list[str]] = {name: list(patterns) for name, patterns in BUILTIN_RISKY.items()}
    for item in args.risky:
        target, _, pattern = item.partition("=")
        risky.setdefault(target, []).append(pattern)
    decisions = verdict.decide_all(counts, args.max_rate, risky, args.min_per_signature, slices)
    result = overall(decisions)
    ab = arms.summarize(arm_records) if arm_records else arms.summarize_series(arm_series)
    silent = unspoken(patches, counts)
    if args.format == "json":
        targets = [d.as_dict() for d in decisions]
        print(json.dumps({"decision": result, "targets": targets, "ab": [a.as_dict() for a in ab],
                          "patches_without_evidence": [u.as_dict() for u in silent]}, indent=2))  # fmt: skip
    else:
        _print_table(decisions, ab, result, args.max_rate, silent)
    return EXIT_CODES[result]


def _risky(text: str) -> str:
    if "=" not in text or not text.split("=", 1)[0] or not text.split("=", 1)[1]:
        raise argparse.ArgumentTypeError(f"expected TARGET=PATTERN, got {text!r}")
    return text


def _print_table(decisions: list[Any], ab: list[Any], result: str, max_rate: float, silent: list[Any] = ()) -> None:
    """The verdict as a table: a line per target, what its evidence says under it, the canary A/B, the called
    patches no evidence speaks for, the overall."""
    from shadow.analysis.decisions import IDLE_CANARY, drill_note, idle_canaries

    print(f"{'target':<17}{'decision':<14}{'compared':>10}{'divergent':>11}  {'95% bounds':<22} why")
    for d in decisions:
        bounds = f"[{d.lower:.3g}, {d.upper:.3g}]"
        print(f"{d.target:<17}{d.decision:<14}{d.compared:>10}{d.divergent:>11}  {bounds:<22} {d.why}")
        for line in [*evidence_lines(d), *_coverage_lines(d)]:
            print(f"{'':<17}{line}")
    if not decisions:
        print("(no npu_shadow comparisons found)")
    for summary in ab:
        print(f"{summary.target:<17}{'canary A/B':<14}{summary.line()}")
    for name in idle_canaries(summary.target for summary in ab):
        print(f"{name:<17}{'canary A/B':<14}{IDLE_CANARY}")
    print(
        "bounds: anytime-valid 95% (a beta-binomial confidence sequence, valid however often the verdict is "
        "re-run as evidence grows; docs/operations.md)"
    )
    note = drill_note(decisions)
    if note:
        print(note)
    for each in silent:
        print(f"patch without evidence: {each.line()}")
    active = any(d.drilled for d in decisions)
    unspoken = f"; {len(silent)} called patches have no evidence here (above)" if silent else ""
    print(f"overall: {result} (max rate {max_rate:g}){' - a FIRE DRILL' if active else ''}{unspoken}")


def _coverage_lines(d: Any) -> list[str]:
    """What a decision's coverage says: risky signatures compared and not exercised, calls never compared, shared
    divergences, the float64 truth."""
    lines = []
    if d.risky:
        lines.append(f"risky signatures compared: {', '.join(f'{p} {seen}' for p, seen in d.risky.items())}")
    if d.not_exercised:
        lines.append(
            "risky signatures not exercised by these jobs (never called; the promotion does not cover them): "
            + ", ".join(d.not_exercised)
        )
    if d.uncovered:
        found = ", ".join(f"{reason} {count}" for reason, count in sorted(d.uncovered.items()))
        lines.append(f"not compared: {found} sampled calls (coverage still missing)")
    if d.shared:
        found = ", ".join(f"{reason} {count}" for reason, count in sorted(d.shared.items()))
        lines.append(
            f"shared divergence: {found} (legacy and upstream agree, both unlike replica 0 alone on its device: an "
            "upstream issue to file, not a reason to keep the patch)"
        )
    for summary in d.truth:
        lines.append(
            f"float64 truth, {summary.signature}: {summary.describe()} (where upstream is nearer, the difference is "
            "no regression; where legacy is, it is one)"
        )
    return lines


def evidence_lines(d: Any) -> list[str]:
    """What the bounds of one decision rest on, phase by phase: the estimate, its effective sample size, weights,
    clusters and the share of calls never compared; then rollbacks, resets and what the source says of itself."""
    lines = []
    for p in d.phases:
        line = f"{p.primary} phase: rate {p.rate:.3g} over {p.effective:,.1f} effective comparisons"
        line += " (signatures weighted by their share of calls)" if p.weighted else " (one stratum)"
        if p.clusters:
            line += f"; {p.clusters} clusters ({d.clustering}), each counted as one comparison"
        elif d.drilled and p.compared:
            line += "; no clusters (a fire drill's comparisons are no evidence and open none)"
        elif p.compared:
            line += "; clusters: not counted by this source (processes of a version before clusters were counted)"
        if p.uncovered_by:
            kinds = ", ".join(f"{reason} {share:.3g}" for reason, share in sorted(p.uncovered_by.items()))
            line += f"; calls never compared: {p.uncovered_share:.3g} of all ({kinds})"
        lines.append(line)
        if p.size_limit:  # (decided under a device's noise: what the evidence can and cannot see)
            lines.append(
                f"{p.primary} phase: detection limit {p.detection_limit:.3g} (an excess of divergence over legacy's "
                f"own A/A exceedances, {p.aa_beyond:,} of {p.aa_judged:,}, smaller than this cannot be told from the "
                f"noise); {p.size_limit}"
            )
        lines += [p.sooner] if p.sooner else []
    for s in d.slices:
        lines.append(
            f"{s.name}: {s.decision if s.decision != 'promote' else 'allows promote'}, rate {s.rate:.3g} over "
            f"{s.compared:,} comparisons ({s.divergent:,} divergent), 95% bounds [{s.lower:.3g}, {s.upper:.3g}]"
        )
    if d.rollbacks:
        lines.append(f"rollbacks not reset: {'; '.join(d.rollbacks)}")
    if d.resets:
        lines.append(f"resets: {'; '.join(d.resets)}; {d.set_aside:,} comparisons from before the last set aside")
    lines += list(d.notes)
    return lines
