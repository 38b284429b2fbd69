"""The ``npu-shadow`` command."""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import signal
import sys
from typing import Any

from shadow.core.model.observation import DIVERGENT_OUTCOMES
from shadow.core.support.rates import parse_rate

#: Exit codes: 0 ok, 1 a difference was found, 2 usage error.
EXIT_OK, EXIT_DIFFERENT, EXIT_USAGE = 0, 1, 2


def _replay(args: argparse.Namespace) -> int:
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
    shown = _terminal_text  # (a capture is data from elsewhere: no escape sequence of its reaches the terminal)
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
        print(f"  not re-run: {_terminal_text(text)}")
        return EXIT_OK
    if text.startswith("both sides raised"):
        print(f"  replayed: {_terminal_text(text)}")
    else:
        reasons = f" ({', '.join(result.reasons)})" if result.reasons else ""
        print(f"  replayed: {result.outcome}{reasons}: {_terminal_text(text)}")
    return EXIT_DIFFERENT if result.outcome in DIVERGENT_OUTCOMES else EXIT_OK


def _terminal_text(text: object) -> str:
    """``text`` with every control character (ESC, CR, BEL...) written as its escape, for a terminal."""
    return "".join(c if c.isprintable() or c == " " else repr(c)[1:-1] for c in str(text))


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


def _verdict(args: argparse.Namespace) -> int:
    import json

    from shadow.analysis import arms, verdict
    from shadow.analysis.patch_evidence import unspoken
    from shadow.analysis.sources import SourceError, from_exposition, from_journal, from_prometheus, read_text
    from shadow.core.model.observation import BUILTIN_RISKY

    arm_records: list[dict] = []
    arm_series: list[tuple[str, dict[str, str], float]] = []
    slices: dict[str, dict] = {}
    patches: dict[str, float] = {}
    if problem := _range_problem(args):
        print(f"npu-shadow verdict: {problem}", file=sys.stderr)
        return EXIT_USAGE
    try:
        if args.prometheus:
            counts = from_prometheus(
                args.prometheus, args.window, args.selector, **_prometheus_range(args), arms=arm_series,
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
    result = verdict.overall(decisions)
    ab = arms.summarize(arm_records) if arm_records else arms.summarize_series(arm_series)
    silent = unspoken(patches, counts)
    if args.format == "json":
        targets = [d.as_dict() for d in decisions]
        print(json.dumps({"decision": result, "targets": targets, "ab": [a.as_dict() for a in ab],
                          "patches_without_evidence": [u.as_dict() for u in silent]}, indent=2))  # fmt: skip
    else:
        _print_verdict(decisions, ab, result, args.max_rate, silent)
    return verdict.EXIT_CODES[result]


def _print_verdict(decisions: list[Any], ab: list[Any], result: str, max_rate: float, silent: list[Any] = ()) -> None:
    """The verdict as a table: a line per target, what its evidence says under it, the canary A/B, the called
    patches no evidence speaks for, the overall."""
    from shadow.analysis import verdict

    print(f"{'target':<17}{'decision':<14}{'compared':>10}{'divergent':>11}  {'95% bounds':<22} why")
    for d in decisions:
        bounds = f"[{d.lower:.3g}, {d.upper:.3g}]"
        print(f"{d.target:<17}{d.decision:<14}{d.compared:>10}{d.divergent:>11}  {bounds:<22} {d.why}")
        for line in [*_evidence(d), *_coverage_lines(d)]:
            print(f"{'':<17}{line}")
    if not decisions:
        print("(no npu_shadow comparisons found)")
    for summary in ab:
        print(f"{summary.target:<17}{'canary A/B':<14}{summary.line()}")
    for name in verdict.idle_canaries(summary.target for summary in ab):
        print(f"{name:<17}{'canary A/B':<14}{verdict.IDLE_CANARY}")
    print(
        "bounds: anytime-valid 95% (a beta-binomial confidence sequence, valid however often the verdict is "
        "re-run as evidence grows; docs/operations.md)"
    )
    note = verdict.drill_note(decisions)
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


def _evidence(d: Any) -> list[str]:
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


def _census(args: argparse.Namespace) -> int:
    import json

    from shadow.analysis import census
    from shadow.analysis.sources import SourceError
    from shadow.npu.release_files import LegacySourceError, printable

    try:
        taken = census.kept(args.source)
        against = census.kept(args.against) if args.against else None
        evidence = _census_evidence(args) if args.journal or args.prometheus else None
    except (LegacySourceError, OSError, SourceError) as exc:
        print(f"npu-shadow census: {printable(str(exc))}", file=sys.stderr)
        return EXIT_USAGE
    if evidence is not None:
        return _census_by_calls(taken, *evidence, args.format)
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


def _census_evidence(args: argparse.Namespace) -> tuple[dict[str, float], dict[str, str]]:
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


def _census_by_calls(taken: Any, calls: dict[str, float], decisions: dict[str, str], form: str) -> int:
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


def _report(args: argparse.Namespace) -> int:
    from shadow.analysis import report
    from shadow.analysis.sources import SourceError
    from shadow.core.model.observation import BUILTIN_RISKY

    if not (args.journal or args.metrics_file or args.prometheus):
        print("npu-shadow report: give --journal, --metrics-file or --prometheus", file=sys.stderr)
        return EXIT_USAGE
    if problem := _range_problem(args):
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
            args.prometheus, args.window, args.selector, **_prometheus_range(args), recent=args.recent,
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


def _prometheus_range(args: argparse.Namespace) -> dict[str, Any]:
    return {"run": args.run, "all_runs": args.all_runs, "start": args.start, "end": args.end, "timeout": args.timeout}


def _range_problem(args: argparse.Namespace) -> str:
    """Why ``--start``/``--end`` cannot be read as given, or "": they select a span of a Prometheus server's
    history, which a journal (read whole, its own times deciding its slices) and a saved scrape (one moment) do
    not have; and a span ends after it starts."""
    if args.start is None and args.end is None:
        return ""
    if not args.prometheus:
        given = [option for option, value in (("--start", args.start), ("--end", args.end)) if value is not None]
        source = "--journal" if args.journal else "--metrics-file"
        verb = "select" if len(given) > 1 else "selects"
        return (
            f"{' and '.join(given)} {verb} a span of --prometheus history; {source} is read whole (give --recent for "
            "its last part)"
        )
    if args.start is not None and args.end is not None and args.start > args.end:
        return f"--start ({args.start:.0f}) is after --end ({args.end:.0f})"
    return ""


def _duration(text: str) -> str:
    """A Prometheus duration (``30m``, ``6h``, ``1h30m``, ``7d``), checked here: Prometheus would answer HTTP 400."""
    import re

    if not re.fullmatch(r"(\d+y)?(\d+w)?(\d+d)?(\d+h)?(\d+m)?(\d+s)?(\d+ms)?", text) or not text:
        raise argparse.ArgumentTypeError(f"{text!r} is not a Prometheus duration (e.g. 30m, 6h, 1h30m, 7d)")
    return text


def _prometheus_url(text: str) -> str:
    """A Prometheus server's URL; ``host:port`` alone is taken as ``http://host:port``."""
    from urllib.parse import urlsplit

    url = text if "://" in text else f"http://{text}"
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018  (raises ValueError for a port that is no number)
    except ValueError:
        parts = None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        raise argparse.ArgumentTypeError(f"{text!r} is not a Prometheus server's URL (e.g. http://127.0.0.1:9090)")
    return url


def _timestamp(text: str) -> float:
    """A time as unix seconds, from unix seconds or ISO 8601 (UTC where no zone is given)."""
    import datetime

    try:
        seconds = float(text)
    except ValueError:
        pass
    else:
        if not math.isfinite(seconds):
            raise argparse.ArgumentTypeError(f"{text!r} is not a time (unix seconds are a finite number)")
        return seconds
    try:
        moment = datetime.datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither unix seconds nor an ISO 8601 time") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=datetime.timezone.utc)
    return moment.timestamp()


def _rate(text: str) -> float:
    try:
        return parse_rate(text, "--max-rate", low="(0", high="1)")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).partition(": ")[2]) from None


def _count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _receiver(args: argparse.Namespace) -> int:
    from shadow.launcher import receiver

    return receiver.main(
        args.listen,
        args.switch,
        os.environ.get("NPU_SHADOW_ROLLBACK_TOKEN"),
        os.environ.get("NPU_SHADOW_RECEIVER_TOKEN"),
        anywhere=args.listen_anywhere,
    )


def _ab(args: argparse.Namespace) -> int:
    from shadow.launcher import ab

    pytest_args = args.pytest_args[1:] if args.pytest_args[:1] == ["--"] else args.pytest_args
    return ab.main(pytest_args, args.journal)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be finite and >= 0, got {text}")
    return value


def _risky(text: str) -> str:
    if "=" not in text or not text.split("=", 1)[0] or not text.split("=", 1)[1]:
        raise argparse.ArgumentTypeError(f"expected TARGET=PATTERN, got {text!r}")
    return text


def _run(args: argparse.Namespace) -> int:
    from shadow.launcher import config as cfg
    from shadow.launcher.runner import run

    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    options = {name: getattr(args, name, None) for name in cfg.SETTINGS}
    for flag in cfg.FLAGS:
        options[flag] = "1" if getattr(args, flag) else None
    return run(command, options)


def _doctor(args: argparse.Namespace) -> int:
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


def _add_emulate_npu(parser: argparse.ArgumentParser, what: str) -> None:
    """``--emulate-npu [N]``: a device count, 2 when the flag is given alone (checked by shadow.launcher.config)."""
    from shadow.launcher.config import SETTINGS

    variable = SETTINGS["emulate_npu"].variable
    parser.add_argument(
        "--emulate-npu", dest="emulate_npu", nargs="?", const="2", metavar="N", help=f"{what} (default 2; {variable})"
    )


def _add_evidence_options(parser: argparse.ArgumentParser, source: argparse._MutuallyExclusiveGroup) -> None:
    """The metrics sources and the decision's parameters, shared by verdict and report."""
    from shadow.analysis.verdict import DEFAULT_MAX_RATE, RECENT_SECONDS

    source.add_argument(
        "--prometheus", metavar="URL", type=_prometheus_url,
        help="a Prometheus server, e.g. http://127.0.0.1:9090 (host:port alone is taken as http)",
    )  # fmt: skip
    source.add_argument("--metrics-file", metavar="PATH", help="a Prometheus text exposition (saved scrape)")
    parser.add_argument(
        "--window", type=_duration, help="with --prometheus: judge increases over this window (e.g. 6h)"
    )
    parser.add_argument("--selector", default="", help='with --prometheus: series selector, e.g. job="train"')
    _add_timeout(parser)
    parser.add_argument(
        "--run", metavar="ID", help="decide on this run's evidence only (a source of several runs needs it)"
    )
    parser.add_argument("--all-runs", action="store_true", help="pool the evidence of every run the source holds")
    parser.add_argument(
        "--start", type=_timestamp, metavar="TIME", help="with --prometheus: the counts since this time (unix or ISO)"
    )
    parser.add_argument(
        "--end", type=_timestamp, metavar="TIME", help="with --prometheus: the counts up to this time (default: now)"
    )
    parser.add_argument("--max-rate", type=_rate, default=DEFAULT_MAX_RATE, help="tolerated divergence rate")
    parser.add_argument(
        "--recent",
        type=_seconds,
        default=RECENT_SECONDS,
        metavar="SECONDS",
        help="journals and --prometheus: the last this many seconds are decided too, and must allow promote as the "
        "whole history must (0: the whole history only)",
    )
    parser.add_argument("--min-per-signature", type=_count, default=30, help="comparisons each risky signature needs")
    parser.add_argument(
        "--cluster-window",
        type=_seconds,
        default=60.0,
        metavar="SECONDS",
        help="journals from before clusters were counted: each process's comparisons in blocks of this many "
        "seconds from its start, a run of divergent blocks kept whole (0: by process); at least 60, as a shorter "
        "window would make more clusters of the same evidence",
    )


def _add_timeout(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--timeout", type=_seconds, default=30.0, metavar="SECONDS",
        help="with --prometheus: every query of the read together within this many seconds (a fleet's store read "
        "whole, --all-runs, takes longer: docs/fleet.md)",
    )  # fmt: skip


class _Defaults(argparse.ArgumentDefaultsHelpFormatter):
    """Help that shows each option's default, where it has one."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default in (None, False, [], "") or action.help is None:
            return action.help
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    """argparse that helps: "did you mean" for an option misspelt (``--sampel-rate``: ``--sample-rate``), whatever
    error argparse met first (``verdict --jornal J``: not "one of the arguments is required"), and for a command
    misspelt (``verdit``); the usage of the command it was given to; the whole help where no command is given."""

    #: The words of the command line being parsed (the top parser's), which its commands' parsers read too.
    _words: list[str] = []  # (one parse at a time)

    def error(self, message: str) -> Any:
        import difflib

        commands = next((a for a in self._actions if isinstance(a, argparse._SubParsersAction)), None)
        if commands is not None and not any(w in commands.choices for w in self._words):
            given = next((w for w in self._words if not w.startswith("-")), None)
            if given is None:
                self.print_help(sys.stderr)
                self.exit(2, f"{self.prog}: error: no command given: one of {', '.join(commands.choices)}\n")
            close = difflib.get_close_matches(given, list(commands.choices), n=1, cutoff=0.6)
            if close:
                self.print_usage(sys.stderr)
                self.exit(2, f"{self.prog}: error: no command {given!r}; did you mean {close[0]!r}?\n")
        suggestion = self._suggestion(commands)
        if suggestion is not None:
            command, wrong, meant = suggestion
            command.print_usage(sys.stderr)
            command.exit(2, f"{command.prog}: error: unrecognized argument {wrong}; did you mean {meant}?\n")
        super().error(message)

    def _suggestion(self, commands: Any) -> tuple[argparse.ArgumentParser, str, str] | None:
        """(the command's parser, the option given, the one meant) for the first option of the command line that
        the command does not take and that is close to one it does."""
        import difflib

        parser: argparse.ArgumentParser = self
        if commands is not None:
            given = next((w for w in self._words if w in commands.choices), None)
            if given is None:
                return None
            parser = commands.choices[given]
        options = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
        for word in self._words:
            wrong = word.split("=", 1)[0]
            if word == "--":
                break  # (the job's own command line follows)
            if wrong.startswith("--") and wrong not in options:
                close = difflib.get_close_matches(wrong, options, n=1, cutoff=0.8)
                if close:
                    return parser, wrong, close[0]
        return None

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        if self.prog == "npu-shadow":  # (the top parser: its commands' parsers read the same words)
            _Parser._words = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)


def _add_replay_command(commands: Any) -> None:
    """``npu-shadow replay``."""
    replay = commands.add_parser(
        "replay",
        help="re-run legacy and upstream on a repro capture and compare",
        description="Re-run legacy and upstream on a repro capture (a .pt file a journal's capture_dir holds) and "
        "compare them as the monitor did. Exit code: 0 they agree, 1 they still differ, 2 a capture that cannot be "
        "read or asks for anything else.",
        formatter_class=_Defaults,
    )
    replay.add_argument("capture", help="a .pt file written by JsonlExporter(capture_dir=...)")
    replay.add_argument("--legacy", metavar="MODULE:FUNCTION", help="a custom target's legacy function")
    replay.add_argument("--upstream", metavar="MODULE:FUNCTION", help="a custom target's upstream function")
    replay.set_defaults(handler=_replay)


def _add_run_command(commands: Any) -> None:
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
            _add_emulate_npu(run, "give every process of the job N emulated npu devices")
        else:
            run.add_argument(setting.option, dest=name, metavar="VALUE", help=f"{setting.accepts} ({setting.variable})")
    run.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")
    run.set_defaults(handler=_run)


def _validate(args: argparse.Namespace) -> int:
    from shadow.launcher import config as cfg

    if args.emulated_device is not None:
        try:
            cfg.SETTINGS["emulated_device"].parse(args.emulated_device)
        except cfg.Invalid as exc:
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


def _add_validate_command(commands: Any) -> None:
    """``npu-shadow validate``."""
    validate = commands.add_parser(
        "validate",
        help="check npu-shadow on this host's NPU or GPU (the emulated npu where there is none) and write the bundle",
        description="Run the device check (scripts/device_check.sh): training bitwise unchanged in shadow and canary "
        "modes, mismatches under nondeterministic kernels, step time and peak device memory at the defaults, 1% "
        "and 100%, host synchronizations per sampled call, the comparator against assert_close; writes "
        "device-check.json and device-check.md. Exit code: 0 training stayed bitwise unchanged, 1 it did not.",
        formatter_class=_Defaults,
    )
    validate.add_argument("--out", default="npu-shadow-device-check", help="the folder the bundle is written to")
    validate.add_argument("--small", action="store_true", help="a quick run (CI's, on the emulated npu)")
    validate.add_argument(
        "--emulated-device", metavar="SPEC", help="the emulated npu's properties where no device is present"
    )
    validate.set_defaults(handler=_validate)


def _add_doctor_command(commands: Any) -> None:
    """``npu-shadow doctor``."""
    from shadow.launcher.config import SETTINGS

    doctor = commands.add_parser(
        "doctor",
        help="check that this host can shadow (exit 0) or say why not (1)",
        description="Check that this host can shadow: torch, the accelerator, the legacy side npu-shadow run would "
        "use, the Prometheus port, and a self-test of tensor_type. Exit code: 0 ok, 1 not (each line says why).",
        formatter_class=_Defaults,
    )
    doctor.add_argument("--port", type=int, default=9464, help="the Prometheus port to try")
    doctor.add_argument("--addr", default="127.0.0.1", help="the address to try the port on")
    _add_emulate_npu(doctor, "check with N emulated npu devices installed")
    legacy = SETTINGS["legacy_from"]
    doctor.add_argument(
        "--legacy-from", metavar="PATH", help=f"check with torch_npu's own legacy: {legacy.accepts} ({legacy.variable})"
    )
    doctor.set_defaults(handler=_doctor)


def _add_verdict_command(commands: Any) -> None:
    """``npu-shadow verdict``."""
    decide = commands.add_parser(
        "verdict",
        help="promote, rollback or inconclusive, per target (exit 0, 1, 3)",
        description="Decide from the evidence whether upstream can replace the legacy patches. Exit code: "
        "0 promote, 1 rollback, 3 inconclusive (the worst target's), 2 usage or source error.",
        formatter_class=_Defaults,
    )
    source = decide.add_mutually_exclusive_group(required=True)  # (formatter below)
    _add_evidence_options(decide, source)
    source.add_argument(
        "--journal", metavar="PATH", nargs="+", help="JSONL journals (their rotated files PATH.1, ... are read too)"
    )
    decide.add_argument(
        "--risky", type=_risky, action="append", default=[], metavar="TARGET=PATTERN", help="another risky signature"
    )
    decide.add_argument("--format", choices=("table", "json"), default="table", help="how to print the decisions")
    decide.set_defaults(handler=_verdict)


def _add_ab_command(commands: Any) -> None:
    """``npu-shadow ab``."""
    ab = commands.add_parser(
        "ab",
        help="run a pytest suite with and without torch_npu's patches and compare each test's outcome (exit 0, 1)",
        description="A suite A/B, for what call-level shadowing cannot see (compiled code): the suite runs in the "
        "legacy world (--npu-shadow) and in the upstream world (--npu-shadow-world upstream); each test is one "
        "comparison of target suite_ab in the journal; a test that crashes a world's interpreter is 'crashed' there, "
        "and the world goes on with the tests after it. Exit code: 0 no test changed, 1 some did, 2 refused "
        "arguments (the --npu-shadow-world, -outcomes, -resume and -journal options, --co), a world that could not "
        "run, or ab stopped (SIGTERM, Ctrl-C: the running pytest is stopped with it).",
        formatter_class=_Defaults,
    )
    ab.add_argument("--journal", default="npu-shadow-tests.jsonl", metavar="PATH", help="the journal both write to")
    ab.add_argument("pytest_args", nargs=argparse.REMAINDER, help="-- PYTEST_ARGS (with --npu-shadow-* options)")
    ab.set_defaults(handler=_ab)


def _add_receiver_command(commands: Any) -> None:
    """``npu-shadow receiver``."""
    receiver = commands.add_parser(
        "receiver",
        help="an Alertmanager webhook receiver that throws the rollback switch of the job an alert names",
        description="Receives Alertmanager's webhooks on LISTEN/alerts; each firing alert labelled action=rollback "
        "throws the switch of its job (--switch JOB=URL, the job's --rollback-port endpoint), with the token in "
        "NPU_SHADOW_ROLLBACK_TOKEN. Alertmanager's posts carry the bearer token in NPU_SHADOW_RECEIVER_TOKEN (its "
        "webhook http_config; anything else is refused). Prints one JSON line per flip, and per rollback alert "
        "naming a job without a switch.",
        formatter_class=_Defaults,
    )
    receiver.add_argument("--listen", default="127.0.0.1:9095", metavar="HOST:PORT", help="where Alertmanager posts")
    receiver.add_argument("--switch", action="append", default=[], metavar="JOB=URL", help="a job's rollback endpoint")
    receiver.add_argument(
        "--listen-anywhere",
        action="store_true",
        help="allow --listen on an address other than loopback (anyone who reaches it can post)",
    )
    receiver.set_defaults(handler=_receiver)


def _add_report_command(commands: Any) -> None:
    """``npu-shadow report``."""
    paper = commands.add_parser(
        "report",
        help="the evidence as Markdown (and HTML) for the pull request that deletes the patches",
        description="Counts from --prometheus or --metrics-file (else from the journals); details and tests "
        "from --journal. Exit 0, or 2 on a source or usage error.",
        formatter_class=_Defaults,
    )
    _add_evidence_options(paper, paper.add_mutually_exclusive_group())
    paper.add_argument("--journal", metavar="PATH", nargs="+", help="JSONL journals (details, tests)")
    paper.add_argument("--details", type=_count, default=5, help="details shown per group of divergences")
    paper.add_argument("--markdown", metavar="PATH", help="write the Markdown here (default: standard output)")
    paper.add_argument("--html", metavar="PATH", help="also write a self-contained HTML file")
    paper.set_defaults(handler=_report)


def _add_census_command(commands: Any) -> None:
    """``npu-shadow census``."""
    from shadow.analysis.verdict import DEFAULT_MAX_RATE

    count = commands.add_parser(
        "census",
        help="list what a torch_npu release replaces in torch, from its source alone",
        description="Every attribute of torch a torch_npu release replaces or adds, read from its source (never "
        "imported): the file and function that assigns it, its kind, when it is applied, and the npu-shadow target "
        "that shadows it. SOURCE: a torch_npu wheel, a version in the wheel cache (2.13.0), a directory holding the "
        "torch_npu package, or 'installed'. Exit 0, or 2 for a source that cannot be read.",
        formatter_class=_Defaults,
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
        type=_prometheus_url,
        help="the same from a Prometheus server or any PromQL store (VictoriaMetrics): every run it holds",
    )
    count.add_argument("--selector", default="", help='with --prometheus: series selector, e.g. job="train"')
    _add_timeout(count)
    count.add_argument(
        "--max-rate", type=_rate, default=DEFAULT_MAX_RATE, help="tolerated divergence rate of the decisions"
    )
    count.set_defaults(handler=_census)


def build_parser() -> argparse.ArgumentParser:
    from importlib.metadata import PackageNotFoundError, version

    parser = _Parser(prog="npu-shadow", description="Shadow torch_npu's patches against upstream.")
    try:
        known = version("npu-shadow")
    except PackageNotFoundError:  # (run from a checkout that was never installed)
        known = "unknown (not installed)"
    parser.add_argument("--version", action="version", version=f"npu-shadow {known}")
    commands = parser.add_subparsers(dest="command", required=True)
    _add_replay_command(commands)
    _add_run_command(commands)
    _add_doctor_command(commands)
    _add_validate_command(commands)
    _add_verdict_command(commands)
    _add_ab_command(commands)
    _add_receiver_command(commands)
    _add_report_command(commands)
    _add_census_command(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
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
