"""``npu-shadow report``: the evidence of a run as one document for the pull request that deletes the patches.

Counts come from the verdict's sources (a Prometheus server, a saved exposition, or journals); details (what
differed, in which test) from journals, read one line at a time so that millions of lines need bounded memory:
per group of (target, signature, outcome, reasons) a count and the first few details, per test a count.
The same sections render as Markdown and as one self-contained HTML file.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import html
import math
import re
from collections.abc import Iterable, Mapping, Sequence

from shadow.analysis import arms, charts, decisions, verdict
from shadow.analysis.decisions import IDLE_CANARY, drill_note, idle_canaries, overall
from shadow.analysis.evidence import TargetCounts
from shadow.analysis.patch_evidence import Unspoken, unspoken
from shadow.analysis.sources import (
    CLUSTER_WINDOW_SECONDS,
    JournalReader,
    journal_records,
    patch_calls,
    select_run,
    with_rotated,
)
from shadow.analysis.verdict import Decision
from shadow.core.model.observation import COMPARED_OUTCOMES, DIFFERS_IN_FLOAT64, DIVERGENT_OUTCOMES, Outcome

DIVERGENT = DIVERGENT_OUTCOMES
#: Journal fields that describe the run rather than one call: collected as the report's environment.
ENVIRONMENT_FIELDS = ("run", "torch", "torch_npu", "device", "legacy", "primary", "host")
MAX_TESTS = 200
#: A known target with nothing in the sources: shown, not decided (it changes no overall decision).
NOT_EXERCISED = "not exercised"


@dataclasses.dataclass
class Group:
    """Divergent comparisons of one target, signature, outcome and reason set."""

    count: int = 0
    details: list[str] = dataclasses.field(default_factory=list)
    tests: set[str] = dataclasses.field(default_factory=set)


@dataclasses.dataclass
class Evidence:
    """What the sources hold, reduced to what the report shows."""

    counts: dict[str, TargetCounts]
    environment: dict[str, collections.Counter] = dataclasses.field(default_factory=dict)
    groups: dict[tuple[str, str, str, tuple[str, ...]], Group] = dataclasses.field(default_factory=dict)
    tests: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    test_run: bool = False
    lines: int = 0
    #: For the charts (bounded: a key per minute, per decade, per signature): minute -> [compared, divergent];
    #: error decade -> comparisons; (target, signature) -> [A/A runs, greatest A/A difference].
    minutes: dict[int, list[int]] = dataclasses.field(default_factory=dict)
    errors: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    noise: dict[tuple[str, str], list[float]] = dataclasses.field(default_factory=dict)
    rollbacks: list[tuple[str, str, str, str]] = dataclasses.field(default_factory=list)  # (time, target, event, by)
    #: The canary A/B's iterator records (shadow.analysis.arms).
    arms: list[dict] = dataclasses.field(default_factory=list)
    #: The slices of the evidence decided besides the whole (shadow.analysis.verdict.decide): name -> counts.
    slices: dict[str, dict[str, TargetCounts]] = dataclasses.field(default_factory=dict)
    #: The jobs' calls of each function patch of the release (journals of ``npu-shadow run --legacy-from``).
    patch_calls: dict[str, float] = dataclasses.field(default_factory=dict)


def collect(
    journals: Iterable[str] = (),
    counts: Mapping[str, TargetCounts] | None = None,
    details: int = 5,
    window: float = CLUSTER_WINDOW_SECONDS,
    environment: Mapping[str, Iterable[str]] | None = None,
    run: str | None = None,
    all_runs: bool = False,
    recent: float = 0.0,
    slices: Mapping[str, Mapping[str, TargetCounts]] | None = None,
) -> Evidence:
    """Read the journals (with their rotated siblings), of ``run`` or of the one run they hold
    (:func:`shadow.analysis.sources.select_run`). ``counts`` (from a metrics source) take precedence over
    the journals' own; the journals' counts come from their count records (every comparison, not only the lines
    written), the details from their lines. The slices the verdict decides too (the last ``recent`` seconds, each
    run of several) are the metrics source's ``slices`` where counts are given, else the journals'."""
    evidence = Evidence(counts=dict(counts) if counts is not None else {}, slices=dict(slices or {}))
    for field, values in (environment or {}).items():  # (the metrics' build info)
        evidence.environment.setdefault(field, collections.Counter()).update(values)
    read, _ = with_rotated(journals)
    own: dict[str, TargetCounts] = {}
    if read:
        reader = JournalReader(window, recent=recent)
        reader.read(read)
        reader.run = run = select_run(reader.runs(), run, all_runs, "the journals")
        own = reader.counts()
        if counts is None:
            evidence.slices = reader.slices()
        evidence.lines = reader.lines
        evidence.patch_calls = patch_calls(reader)
        for stream in reader.streams.values():
            for phase in stream.phases.values():
                for timestamp, compared, divergent in phase.intervals:
                    if isinstance(timestamp, (int, float)) and math.isfinite(timestamp):
                        # (the intervals are on the process's own clock; the chart's axis is UTC)
                        wall = stream.on_wall_clock(timestamp)
                        minute = evidence.minutes.setdefault(int(wall // 60), [0, 0])
                        minute[0] += round(compared)
                        minute[1] += round(divergent)
        for entry in own.values():
            for phase in entry.phases.values():
                matches = round(sum(v for (_, o), v in phase.outcomes.items() if o == Outcome.MATCH))
                if matches:
                    evidence.errors[charts.decade(0.0)] += matches
    for record in journal_records(read):
        if run is not None and record.get("run", "") != run:
            continue
        event = record.get("event")
        if event in ("rollback", "reset"):
            evidence.rollbacks.append((str(record.get("time", "")), record["target"], event, str(record["by"])))
            continue
        if event == "arm":
            evidence.arms.append(record)
            continue
        if event == "journal":  # (a process's header: its run, whether or not it wrote an outcome line)
            run_named = record.get("run")
            if isinstance(run_named, str) and run_named:
                evidence.environment.setdefault("run", collections.Counter())[run_named] += 1
        if event is not None:
            continue
        for field in ENVIRONMENT_FIELDS:
            value = record.get(field)
            if isinstance(value, str) and value:
                evidence.environment.setdefault(field, collections.Counter())[value] += 1
        _chart_data(evidence, record)
        test = record.get("test")
        if isinstance(test, str):
            evidence.test_run = True
        if record["outcome"] not in DIVERGENT and not record.get("noise_test"):
            continue
        outcome = record["outcome"] + (" (fire drill)" if record.get("drill") is True else "")
        key = (record["target"], record.get("signature", ""), outcome, tuple(record.get("reasons", [])))
        group = evidence.groups.setdefault(key, Group())
        group.count += 1
        where = f"{test} ({record.get('phase', '')}): " if isinstance(test, str) and test else ""
        if len(group.details) < details:
            noise = record.get("noise_test")
            group.details.append(where + str(record.get("detail", "")) + (f" [noise test: {noise}]" if noise else ""))
        if isinstance(test, str) and test and record["outcome"] in DIVERGENT:
            if len(group.tests) < MAX_TESTS:
                group.tests.add(test)
            if test in evidence.tests or len(evidence.tests) < MAX_TESTS:
                evidence.tests[test] += 1
    if counts is None:
        evidence.counts = own
    return evidence


def _chart_data(evidence: Evidence, record: dict) -> None:
    """What the error histogram and the noise-floor chart take from one outcome line (the rate chart comes from
    count records: the lines of a journal without every outcome are not a sample of the comparisons)."""
    outcome = record["outcome"]
    if outcome not in COMPARED_OUTCOMES:
        return
    if record.get("aa") is True:
        floor = evidence.noise.setdefault((record["target"], str(record.get("signature", ""))), [0, 0.0])
        floor[0] += 1
        aa = record.get("aa_abs_error")
        if isinstance(aa, (int, float)) and math.isfinite(aa):
            floor[1] = max(floor[1], float(aa))
    error = record.get("max_abs_error")
    if outcome not in ("error", "match") and isinstance(error, (int, float)) and record.get("numel"):
        evidence.errors[charts.decade(float(error))] += 1  # (matches: from the count records, error 0)


# --------------------------------------------------------------------------- the document


@dataclasses.dataclass(frozen=True)
class Fold:
    """A long cell: its first line shown, the rest folded away (``<details>`` in HTML; Markdown shows the first
    line and says how much more there is)."""

    first: str
    rest: str = ""

    def __str__(self) -> str:
        return self.first + (f" (+{len(self.rest):,} characters more in the HTML report)" if self.rest else "")


def fold(texts: Sequence[str], first_limit: int = 200) -> Fold:
    """The first line of the first text (cut to ``first_limit``), everything else folded."""
    whole = "\n".join(texts)
    first, _, rest = whole.partition("\n")
    if len(first) > first_limit:
        first, rest = first[: first_limit - 3] + "...", whole
    return Fold(first, rest)


@dataclasses.dataclass
class Section:
    title: str
    text: list[str] = dataclasses.field(default_factory=list)
    header: Sequence[str] = ()
    rows: list[Sequence[str]] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    figures: list[str] = dataclasses.field(default_factory=list)  # inline SVG
    html_only: bool = False  # (the charts: a pull request's Markdown has no worker for them)


def build(
    evidence: Evidence,
    sources: Sequence[str],
    max_rate: float = decisions.DEFAULT_MAX_RATE,
    risky: Mapping[str, Iterable[str]] | None = None,
    min_per_signature: int = decisions.DEFAULT_MIN_PER_SIGNATURE,
) -> tuple[str, list[Section]]:
    """(overall decision, sections) for the evidence."""
    decisions = verdict.decide_all(evidence.counts, max_rate, risky or {}, min_per_signature, evidence.slices)
    worst = overall(decisions)
    absent = sorted(set(risky or {}) - set(evidence.counts))  # known targets the sources never saw
    silent = unspoken(evidence.patch_calls, evidence.counts)
    sections = [_environment(evidence, sources), _verdict(decisions, worst, max_rate, absent, silent)]
    sections.append(_phases(decisions))
    sections.append(_charts(evidence, decisions, max_rate, min_per_signature))
    sections += [_coverage(decisions), _shared(decisions)]
    if any(d.truth for d in decisions):  # (truth runs are asked for: --truth-rate)
        sections.append(_truth(decisions))
    sections.append(_divergences(evidence))
    sections.append(_arms(evidence))
    if evidence.patch_calls:
        sections.append(_patches(evidence))
    if evidence.rollbacks or any(d.rollbacks for d in decisions):
        sections.append(
            Section(
                "Rollbacks and resets",
                [
                    "The rollback switch made legacy the primary in a running job (canary), and a person's reset "
                    "gave the canary back its primary: when, and who. A rollback not reset since blocks promote; "
                    "evidence from before a reset is set aside."
                ],
                ["time", "target", "event", "by"],
                [list(r) for r in evidence.rollbacks[:MAX_TESTS]],
                [f"{d.target}: not reset since: {'; '.join(d.rollbacks)}" for d in decisions if d.rollbacks],
            )
        )
    if evidence.test_run:
        sections.append(_tests(evidence))
    return worst, sections


def _environment(evidence: Evidence, sources: Sequence[str]) -> Section:
    def values(field: str) -> str:
        seen = evidence.environment.get(field)
        return ", ".join(sorted(seen)) if seen else "not in these sources"

    rows = [
        ["sources", "; ".join(sources)],
        ["run", values("run")],
        ["npu-shadow", values("npu-shadow")],
        ["torch", values("torch")],
        ["torch_npu", values("torch_npu")],
        ["legacy", values("legacy")],
        ["returned to the caller (primary)", values("primary")],
        ["device", values("device")],
        ["journal lines read", f"{evidence.lines:,}"],
    ]
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return Section("Environment", [f"Written {stamp}."], ["item", "value"], rows)


def _verdict(
    decisions: list[Decision],
    overall: str,
    max_rate: float,
    absent: Sequence[str] = (),
    silent: Sequence[Unspoken] = (),
) -> Section:
    rows = [
        [d.target, d.decision, f"{d.compared:,}", f"{d.divergent:,}", f"[{d.lower:.3g}, {d.upper:.3g}]", d.why]
        for d in decisions
    ]
    rows += [
        [
            target,
            NOT_EXERCISED,
            "0",
            "0",
            "-",
            "no call of this target is in the sources (not installed or never called)",
        ]
        for target in absent
    ]
    drill = drill_note(decisions)
    unspoken_for = (
        [f"The jobs called {len(silent)} of the release's patches that no evidence here speaks for: the overall "
         "decision is about the targets above only."] if silent else []
    )  # fmt: skip
    return Section(
        "Verdict",
        [
            f"Overall: **{overall}** (max divergence rate {max_rate:g}; 95% bounds valid however often they are "
            "read: a beta-binomial confidence sequence over signatures weighted by their share of calls, calls never "
            "compared counted as unknown, each process's time block one comparison where journals say which)."
        ]
        + ([f"**{drill}**."] if drill else [])
        + unspoken_for,
        ["target", "decision", "compared", "divergent", "95% bounds", "why / evidence still missing"],
        rows,
        ([] if decisions else ["No npu_shadow comparisons in these sources."])
        + [f"patch without evidence: {each.line()}" for each in silent],
    )


def _charts(evidence: Evidence, decisions: list[Decision], max_rate: float, min_per_signature: int) -> Section:
    """Where people would rather look than read (in the HTML report)."""
    figures = []
    if evidence.minutes:
        first, last = min(evidence.minutes), max(evidence.minutes)
        width = max(1, math.ceil((last - first + 1) / 48))  # at most 48 windows
        windows: dict[int, list[int]] = {}
        for minute, (compared, divergent) in evidence.minutes.items():
            window = windows.setdefault((minute - first) // width, [0, 0])
            window[0] += compared
            window[1] += divergent
        points = [(float((first + i * width) * 60), d / c if c else 0.0, c) for i, (c, d) in sorted(windows.items())]
        thresholds = {"max rate": max_rate} | {n: f * max_rate for n, f in verdict.BURN_RATE_FACTORS.items()}
        figures.append(
            charts.rate_over_time(
                points,
                thresholds,
                "Divergence rate over time",
                f"{width}-minute windows, from the journals' count records; dashed: the alert thresholds",
                window_seconds=60.0 * width,
            )
        )
    coverage = [(f"{d.target} {pattern}", float(seen)) for d in decisions for pattern, seen in d.risky.items()]
    figures.append(
        charts.horizontal_bars(
            coverage,
            "Risky signatures: comparisons made against those needed",
            charts.COVERED,
            min_per_signature,
            subtitle="the verdict's counts; short of the dashed line: orange",
            x_title="comparisons",
        )
    )
    figures.append(
        charts.histogram(
            dict(evidence.errors),
            "Greatest absolute error per comparison",
            charts.ERRORS,
            "by decade; matches from the journals' count records, the rest from their lines",
        )
    )
    floors = [(f"{t} {s} ({int(runs)} A/A runs)", value) for (t, s), (runs, value) in sorted(evidence.noise.items())]
    figures.append(
        charts.horizontal_bars(
            floors,
            "Noise floor: greatest A/A difference by signature",
            charts.NOISE,
            subtitle="legacy against itself, from the journals' A/A lines",
            x_title="greatest absolute difference",
        )
    )
    nearer = [
        (f"{d.target} {t.signature}: {side} nearer", float(count))
        for d in decisions
        for t in d.truth
        for side, count in (
            ("upstream", t.upstream),
            ("legacy", t.legacy),
            ("tie", t.tie),
            (DIFFERS_IN_FLOAT64, t.differs),
        )
    ]
    figures.append(
        charts.horizontal_bars(
            nearer,
            "Value differences against float64: the side nearer the truth",
            charts.COVERED,
            subtitle="truth runs by signature; upstream nearer: no regression",
            x_title="truth runs",
        )
    )
    figures = [f for f in figures if f]
    notes = [] if figures else ["Nothing to draw: the charts need journals (--journal) or risky signatures."]
    return Section("Charts", [], notes=notes, figures=figures, html_only=True)


def _phases(decisions: list[Decision]) -> Section:
    """Each phase of each target on its own evidence: what decided, the share of calls never compared, clusters."""
    rows = []
    for d in decisions:
        for p in d.phases:
            uncovered = ", ".join(f"{r} {v:.3g}" for r, v in sorted(p.uncovered_by.items())) or "-"
            rows.append(
                [
                    d.target,
                    p.primary,
                    p.decision,
                    f"{p.compared:,}",
                    f"{p.divergent:,}",
                    f"[{p.lower:.3g}, {p.upper:.3g}]",
                    f"{p.effective:,.1f}" + (f" ({p.clusters:,} clusters)" if p.clusters else ""),
                    f"{p.uncovered_share:.3g} ({uncovered})" if p.uncovered_share else "0",
                ]
            )
    text = [
        "Calls whose result came from legacy (shadowing) and from upstream (a canary) are judged apart, never "
        "pooled; a target gets the worst of its phases. Uncovered: the share of calls of a kind never compared, "
        "added whole to the upper bound."
    ]
    header = ["target", "primary", "decision", "compared", "divergent", "95% bounds", "effective n", "uncovered"]
    return Section("Phases", text, header, rows, [] if rows else ["No phase has evidence."])


def _arms(evidence: Evidence) -> Section:
    """The canary A/B of what cannot run twice (the DataLoader's iterator): each arm's iterators and what differs."""
    summaries = arms.summarize(evidence.arms) if evidence.arms else []
    text = (
        ["No canary A/B is in these sources."]
        if not summaries
        else [
            "Each new multi-process DataLoader iterator was built by legacy's or upstream's __init__ (never both: its "
            "workers start once), the arms alternating in seeded blocks. Ratios are upstream's over legacy's, with "
            "95% intervals (Hodges-Lehmann, inverting the Mann-Whitney test)."
        ]
    )
    rows = [[s.target, s.line()] for s in summaries]
    rows += [[name, IDLE_CANARY] for name in idle_canaries(s.target for s in summaries)]
    return Section("Canary A/B", text, ["target", "upstream's iterator"], rows, [])


def _patches(evidence: Evidence, most: int = 40) -> Section:
    """The release's function patches the jobs called, the most called first (npu-shadow census ranks them all,
    with what covers each)."""
    called = sorted(((calls, name) for name, calls in evidence.patch_calls.items() if calls), reverse=True)
    text = [
        f"The jobs called {len(called)} of the release's function patches (counted at each patch's place; "
        "`npu-shadow census RELEASE --journal ...` ranks every patch with what covers it)."
    ]
    rows = [[name, f"{round(calls):,}"] for calls, name in called[:most]]
    notes = [f"and {len(called) - most} more"] if len(called) > most else []
    return Section("Patches the jobs called", text, ["patch", "calls"], rows, notes)


def _coverage(decisions: list[Decision]) -> Section:
    rows = [[d.target, pattern, f"{seen:,}"] for d in decisions for pattern, seen in d.risky.items()]
    rows += [[d.target, pattern, "not exercised by these jobs (never called)"] for d in decisions
             for pattern in d.not_exercised]  # fmt: skip
    return Section("Risky signatures", [], ["target", "signature", "compared"], rows, [] if rows else ["None set."])


def _shared(decisions: list[Decision]) -> Section:
    rows = [[d.target, reason, f"{count:,}"] for d in decisions for reason, count in sorted(d.shared.items())]
    text = [
        "Legacy and upstream agree, but both depart from replica 0 run alone on its device (the single-device "
        "oracle): removing the patch changes nothing there; an upstream issue to file, not a reason to keep it."
    ]
    return Section("Shared divergences", text, ["target", "reason", "comparisons"], rows, [] if rows else ["None."])


def _truth(decisions: list[Decision]) -> Section:
    rows = [
        [d.target, t.signature, f"{t.upstream:,}", f"{t.legacy:,}", f"{t.tie:,}", f"{t.differs:,}",
         "-" if t.decade is None else f"~10^{t.decade}"]
        for d in decisions
        for t in d.truth
    ]  # fmt: skip
    text = [
        "Calls whose two sides differ in value (close, or a value mismatch) run again in float64 on the CPU, on each "
        "side's code path (DataParallel: replica 0's module alone, one path): where the two runs agree, the side "
        "whose result is nearer them is nearer the truth. A difference where upstream is nearer is no regression "
        "(shown here, never hidden, and never counted as agreement); one where legacy is nearer is. Where the two "
        "paths differ in float64 too (differs-in-float64), the difference is in the algorithm, not in rounding, and "
        "no side is the truth. These runs are shown beside the decision, not folded into it."
    ]
    header = [
        "target", "signature", "upstream nearer", "legacy nearer", "tie", "differs in float64",
        "upstream's error / legacy's (median)",
    ]  # fmt: skip
    return Section("Float64 truth", text, header, rows)


def _divergences(evidence: Evidence) -> Section:
    rows = []
    for (target, signature, outcome, reasons), group in sorted(evidence.groups.items(), key=lambda kv: -kv[1].count):
        rows.append([target, signature, outcome, ", ".join(reasons) or "-", f"{group.count:,}", fold(group.details)])
    notes = [] if rows else ["None in the journals." if evidence.lines else "Details need journals (--journal)."]
    return Section(
        "Divergences",
        [
            "Grouped by target, signature, outcome and reasons, with the first details of each.",
            "Rows marked (fire drill) hold divergence a fire drill injected.",
        ],
        ["target", "signature", "outcome", "reasons", "count", "first details"],
        rows,
        notes,
    )


def _tests(evidence: Evidence) -> Section:
    rows = [[test, f"{count:,}"] for test, count in evidence.tests.most_common()]
    notes = [] if rows else ["No test diverged."]
    if len(evidence.tests) >= MAX_TESTS:
        notes.append(f"Only the first {MAX_TESTS} tests that diverged are listed.")
    return Section("Tests that diverged", [], ["test", "divergent comparisons"], rows, notes)


# --------------------------------------------------------------------------- rendering

TITLE = "npu-shadow report: legacy (torch_npu patches) vs upstream PyTorch"


def _cell(text: str) -> str:
    # (a test id is anyone's text: no HTML of its own reaches a pull request, `<!--` would hide the rest; no tag
    # or entity opens without `<` or `&`)
    return text.replace("&", "&amp;").replace("<", "&lt;").replace("|", "\\|").replace("\n", " ")


#: Control characters (but a line break and a tab): a journal's text may hold an ESC, which a terminal showing the
#: Markdown would obey.
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def _encodable(text: str) -> str:
    """``text`` writable as UTF-8 and safe to show: a lone surrogate (a journal's ``\\ud800``) and a control
    character (an ESC) become their escapes."""
    text = _CONTROL.sub(lambda found: found.group().encode("unicode_escape").decode("ascii"), text)
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def to_markdown(overall: str, sections: list[Section]) -> str:
    """The report as Markdown, for a pull request."""
    lines = [f"# {TITLE}", "", f"**Overall: {overall}**", ""]
    for section in sections:
        if section.html_only:
            continue
        lines += [f"## {section.title}", ""]
        lines += [*section.text, ""] if section.text else []
        if section.rows:
            lines.append("| " + " | ".join(section.header) + " |")
            lines.append("|" + "---|" * len(section.header))
            lines += ["| " + " | ".join(_cell(str(c)) for c in row) + " |" for row in section.rows]
            lines.append("")
        lines += [*section.notes, ""] if section.notes else []
    return _encodable("\n".join(lines).rstrip() + "\n")


_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #1b1f24; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; }
th, td { border: 1px solid #c9d1d9; padding: 4px 8px; text-align: left; vertical-align: top; }
th { background: #f1f3f5; }
td.promote { background: #c8f7c5; } td.rollback { background: #ffc9c9; } td.inconclusive { background: #ffec99; }
td.not-exercised { background: #e9ecef; } details summary { cursor: pointer; } details pre { white-space: pre-wrap; }
"""


def to_html(overall: str, sections: list[Section]) -> str:
    """The report as one self-contained HTML file (no script, no external resource)."""
    e = html.escape
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{e(TITLE)}</title><style>{_STYLE}</style></head><body>",
        f"<h1>{e(TITLE)}</h1>",
        f'<p>Overall: <strong class="{e(overall)}">{e(overall)}</strong></p>',
    ]
    for section in sections:
        parts.append(f'<h2 id="{e(section.title.lower().replace(" ", "-"))}">{e(section.title)}</h2>')
        if section.figures:
            parts.append('<div class="charts">' + "".join(f"<figure>{f}</figure>" for f in section.figures) + "</div>")
        else:
            parts += [f"<p>{e(t).replace('**', '')}</p>" for t in section.text]
        if section.rows:
            parts.append("<table><tr>" + "".join(f"<th>{e(h)}</th>" for h in section.header) + "</tr>")
            for row in section.rows:
                cells = []
                for value in row:
                    kind = (
                        f' class="{value.replace(" ", "-")}"'
                        if value in (verdict.PROMOTE, verdict.ROLLBACK, verdict.INCONCLUSIVE, NOT_EXERCISED)
                        else ""
                    )
                    if isinstance(value, Fold) and value.rest:
                        text = f"<details><summary>{e(value.first)}</summary><pre>{e(value.rest)}</pre></details>"
                    else:
                        text = e(value.first if isinstance(value, Fold) else str(value))
                    cells.append(f"<td{kind}>{text}</td>")
                parts.append("<tr>" + "".join(cells) + "</tr>")
            parts.append("</table>")
        parts += [f"<p><em>{e(n)}</em></p>" for n in section.notes]
    parts.append("</body></html>")
    return _encodable("\n".join(parts) + "\n")
