"""What the commands share: exit codes, the types their options are read as (each refusing a bad value with a message
that names it), the evidence options of verdict and report, and the parser that helps."""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any

from shadow.core.support.rates import parse_rate

#: Exit codes: 0 ok, 1 a difference was found, 2 usage error.
EXIT_OK, EXIT_DIFFERENT, EXIT_USAGE = 0, 1, 2


def terminal_text(text: object) -> str:
    """``text`` with every control character (ESC, CR, BEL...) written as its escape, for a terminal."""
    return "".join(c if c.isprintable() or c == " " else repr(c)[1:-1] for c in str(text))


def duration(text: str) -> str:
    """A Prometheus duration (``30m``, ``6h``, ``1h30m``, ``7d``), checked here: Prometheus would answer HTTP 400."""
    import re

    if not re.fullmatch(r"(\d+y)?(\d+w)?(\d+d)?(\d+h)?(\d+m)?(\d+s)?(\d+ms)?", text) or not text:
        raise argparse.ArgumentTypeError(f"{text!r} is not a Prometheus duration (e.g. 30m, 6h, 1h30m, 7d)")
    return text


def prometheus_url(text: str) -> str:
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


def timestamp(text: str) -> float:
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


def rate(text: str) -> float:
    try:
        return parse_rate(text, "--max-rate", low="(0", high="1)")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).partition(": ")[2]) from None


def count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be finite and >= 0, got {text}")
    return value


def add_emulate_npu(parser: argparse.ArgumentParser, what: str) -> None:
    """``--emulate-npu [N]``: a device count, 2 when the flag is given alone (checked by shadow.launcher.config)."""
    from shadow.launcher.config import SETTINGS

    variable = SETTINGS["emulate_npu"].variable
    parser.add_argument(
        "--emulate-npu", dest="emulate_npu", nargs="?", const="2", metavar="N", help=f"{what} (default 2; {variable})"
    )


def add_evidence_options(parser: argparse.ArgumentParser, source: argparse._MutuallyExclusiveGroup) -> None:
    """The metrics sources and the decision's parameters, shared by verdict and report."""
    from shadow.analysis.decisions import DEFAULT_MAX_RATE, DEFAULT_MIN_PER_SIGNATURE, RECENT_SECONDS

    source.add_argument(
        "--prometheus", metavar="URL", type=prometheus_url,
        help="a Prometheus server, e.g. http://127.0.0.1:9090 (host:port alone is taken as http)",
    )  # fmt: skip
    source.add_argument("--metrics-file", metavar="PATH", help="a Prometheus text exposition (saved scrape)")
    parser.add_argument("--window", type=duration, help="with --prometheus: judge increases over this window (e.g. 6h)")
    parser.add_argument("--selector", default="", help='with --prometheus: series selector, e.g. job="train"')
    add_timeout(parser)
    parser.add_argument(
        "--run", metavar="ID", help="decide on this run's evidence only (a source of several runs needs it)"
    )
    parser.add_argument("--all-runs", action="store_true", help="pool the evidence of every run the source holds")
    parser.add_argument(
        "--start", type=timestamp, metavar="TIME", help="with --prometheus: the counts since this time (unix or ISO)"
    )
    parser.add_argument(
        "--end", type=timestamp, metavar="TIME", help="with --prometheus: the counts up to this time (default: now)"
    )
    parser.add_argument("--max-rate", type=rate, default=DEFAULT_MAX_RATE, help="tolerated divergence rate")
    parser.add_argument(
        "--recent",
        type=seconds,
        default=RECENT_SECONDS,
        metavar="SECONDS",
        help="journals and --prometheus: the last this many seconds are decided too, and must allow promote as the "
        "whole history must (0: the whole history only)",
    )
    parser.add_argument(
        "--min-per-signature", type=count, default=DEFAULT_MIN_PER_SIGNATURE,
        help="comparisons each risky signature needs",
    )  # fmt: skip
    parser.add_argument(
        "--cluster-window",
        type=seconds,
        default=60.0,
        metavar="SECONDS",
        help="journals from before clusters were counted: each process's comparisons in blocks of this many "
        "seconds from its start, a run of divergent blocks kept whole (0: by process); at least 60, as a shorter "
        "window would make more clusters of the same evidence",
    )


def add_timeout(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--timeout", type=seconds, default=30.0, metavar="SECONDS",
        help="with --prometheus: every query of the read together within this many seconds (a fleet's store read "
        "whole, --all-runs, takes longer: docs/fleet.md)",
    )  # fmt: skip


def prometheus_range(args: argparse.Namespace) -> dict[str, Any]:
    return {"run": args.run, "all_runs": args.all_runs, "start": args.start, "end": args.end, "timeout": args.timeout}


def range_problem(args: argparse.Namespace) -> str:
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


class Defaults(argparse.ArgumentDefaultsHelpFormatter):
    """Help that shows each option's default, where it has one."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default in (None, False, [], "") or action.help is None:
            return action.help
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
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
            Parser._words = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)
