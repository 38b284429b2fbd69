"""Counts from journals (:mod:`exporters.journal_format`'s records): the count records of every process, the
outcome lines after its last one, rollbacks and resets, clusters cut on each process's own clock."""

from __future__ import annotations

import collections
import dataclasses
import json
import math
from collections.abc import Iterable

from exporters import journal_format
from shadow.analysis import verdict
from shadow.analysis.evidence import TargetCounts
from shadow.analysis.sources.common import (
    CLOCK_JUMP_SECONDS,
    CLUSTER_WINDOW_SECONDS,
    MAX_LINE_BYTES,
    SourceError,
    _count,
    add_series,
    one_job_per_run,
    select_run,
)
from shadow.analysis.sources.journal_lines import (
    check_counts,
    record_of,
    said,
    seconds_of,
    whole_record,
    with_rotated,
)
from shadow.core.judging import noise
from shadow.core.model.observation import (
    COMPARED_OUTCOMES,
    DIFFERS_IN_FLOAT64,
    DIVERGENT_OUTCOMES,
    LEGACY,
    NEARER,
    PRIMARY_SIDES,
    Outcome,
    error_decade,
)


def clustering(window: float) -> str:
    """How journals' comparisons are clustered, as the verdict says it."""
    return f"process x {window:g} s blocks from its start" if window > 0 else "process"


#: An outcome line as the journal exporter frames it: its process is read without parsing the line (fast path).
_OUTCOME_START = journal_format.LINE_START
_PROCESS_FIELDS = journal_format.PROCESS_KEY


@dataclasses.dataclass
class _Phase:
    """One (target, primary) of one process stream."""

    counts: dict | None = None  # the last count record (cumulative)
    baseline: dict | None = None  # the count record at its target's last reset (set aside)
    intervals: list = dataclasses.field(default_factory=list)  # (timestamp, compared, divergent)
    previous: tuple[float, float] = (0.0, 0.0)  # cumulative (compared, divergent) at the last count record
    #: Its count records since its target's last reset as (wall time, counts), oldest first, those before the
    #: reader's recent window dropped as reading goes (all but the last of them: the window's baseline).
    history: collections.deque = dataclasses.field(default_factory=collections.deque)
    at: float = -math.inf  # (the last count record's time)


#: The observation fields that say where a run stood against its noise thresholds, by (evidence, pair).
_NOISE_FIELDS = {
    ("forward", "ab"): "noise_check", ("forward", "aa"): "aa_check",
    ("gradients", "ab"): "grad_noise_check", ("gradients", "aa"): "grad_aa_check",
}  # fmt: skip


@dataclasses.dataclass
class _Tail:
    """The lines of one (target, primary) after a process's last count record, counted: bounded memory however
    many (their times by the second)."""

    outcomes: dict[tuple[str, str], float] = dataclasses.field(default_factory=dict)  # (signature, outcome)
    skipped: dict[tuple[str, str], float] = dataclasses.field(default_factory=dict)  # (signature, reason)
    reasons: dict[tuple[str, bool], float] = dataclasses.field(default_factory=dict)  # (reason, divergent line)
    shared: dict[str, float] = dataclasses.field(default_factory=dict)
    drilled: dict[bool, float] = dataclasses.field(default_factory=dict)  # divergent line -> drilled lines
    truth: dict[tuple[str, str], float] = dataclasses.field(default_factory=dict)  # (signature, nearer)
    truth_decades: dict[tuple[str, str], float] = dataclasses.field(default_factory=dict)  # (signature, decade)
    backward: dict[tuple[str, str], float] = dataclasses.field(default_factory=dict)  # (signature, found)
    noise: dict[tuple[str, str, str], float] = dataclasses.field(default_factory=dict)  # (evidence, pair, check)
    seconds: dict[int, list[float]] = dataclasses.field(default_factory=dict)  # second -> [compared, divergent]
    lines: int = 0

    def add(self, record: dict) -> None:
        self.lines += 1
        signature, outcome = record.get("signature", ""), record["outcome"]
        if outcome == Outcome.SKIPPED:
            for reason in record.get("reasons", []):
                self.skipped[(signature, reason)] = self.skipped.get((signature, reason), 0) + 1
            return
        divergent = outcome in DIVERGENT_OUTCOMES
        self.outcomes[(signature, outcome)] = self.outcomes.get((signature, outcome), 0) + 1
        for reason in record.get("reasons", []):
            self.reasons[(reason, divergent)] = self.reasons.get((reason, divergent), 0) + 1
        if record.get("shared_divergence"):
            self.shared[record["shared_divergence"]] = self.shared.get(record["shared_divergence"], 0) + 1
        if record.get("drill") is True:
            self.drilled[divergent] = self.drilled.get(divergent, 0) + 1
        if record.get("backward") is True:
            found = "mismatch" if "grad" in record.get("reasons", []) else "match"
            self.backward[(signature, found)] = self.backward.get((signature, found), 0) + 1
        for (evidence, pair), field in _NOISE_FIELDS.items():
            if record.get(field) in noise.CHECKS:
                key = (evidence, pair, record[field])
                self.noise[key] = self.noise.get(key, 0) + 1
        nearer = record.get("nearer")
        if nearer in NEARER:
            self.truth[(signature, nearer)] = self.truth.get((signature, nearer), 0) + 1
            errors = record.get("legacy_truth_error"), record.get("upstream_truth_error")
            numbers = all(isinstance(e, (int, float)) and not isinstance(e, bool) for e in errors)
            if numbers and nearer != DIFFERS_IN_FLOAT64:  # (errors against two runs: no ratio)
                decade = error_decade(*errors)
                if decade is not None:
                    key = (signature, str(decade))
                    self.truth_decades[key] = self.truth_decades.get(key, 0) + 1
        timestamp = seconds_of(record.get("timestamp"))
        second = int(timestamp) if timestamp is not None else 0
        counts = self.seconds.setdefault(second, [0.0, 0.0])
        counts[0] += 1
        counts[1] += divergent


@dataclasses.dataclass
class _Stream:
    """One process's writing (host, pid, stream): whether it writes every outcome, its count records, its events,
    the lines after its last count record."""

    where: str
    all_outcomes: bool | None = None
    start: float | None = None
    last: float | None = None
    phases: dict[tuple[str, str], _Phase] = dataclasses.field(default_factory=dict)
    events: list[dict] = dataclasses.field(default_factory=list)  # rollbacks and resets, in order
    #: Where its unparsed lines after the last count record begin, file by file (path, offset, line number): read
    #: again at the end, so that lines a count record covers are never parsed and memory stays bounded.
    marks: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)
    folded: dict[tuple[str, str], _Tail] = dataclasses.field(default_factory=dict)  # tail lines counted
    counted: bool = False  # has count records
    tail_timed: bool = False  # the times of the lines after its last count record are in its phases' intervals
    run: str = ""  # the run its records name ("": before runs had ids)
    arms: list[dict] = dataclasses.field(
        default_factory=list
    )  # its canary A/B's iterators (shadow.core.calls.canary.arms)
    #: Its count records' monotonic clock (``mono``) and wall clock at the first and the last of them: its clusters
    #: follow the monotonic clock, which no wall-clock jump moves.
    mono_start: float | None = None
    clock: tuple[float, float] | None = None  # (wall, mono) of the last count record
    jumps: list[str] = dataclasses.field(default_factory=list)  # the wall clock's jumps, said
    process_seconds: float | None = None  # its time under the monitor, from its count records (the latest)
    commands: set[str] = dataclasses.field(default_factory=set)  # the job it ran, from its count records
    patch_calls: dict[str, float] = dataclasses.field(default_factory=dict)  # its calls of a release's patches

    def see(self, value: object) -> None:
        timestamp = seconds_of(value)
        if timestamp is not None:
            self.start = timestamp if self.start is None else min(self.start, timestamp)
            self.last = timestamp if self.last is None else max(self.last, timestamp)

    def process_time(self, record: dict, where: str) -> float:
        """Where a count record falls on the process's own time: its monotonic clock where the record has one
        (a jump of the wall clock between two records is said, and adds no time), else its timestamp."""
        wall, mono = record["timestamp"], record.get("mono")
        if mono is None:
            return wall
        if seconds_of(mono) is None:
            raise SourceError(f"{where}: a count record whose mono is {said(mono)}, not a finite number")
        if self.clock is not None:
            jump = (wall - self.clock[0]) - (mono - self.clock[1])
            if abs(jump) > CLOCK_JUMP_SECONDS:
                self.jumps.append(f"{where}: the wall clock jumped {jump:+.0f} s (clusters follow the monotonic clock)")
        self.clock = (wall, mono)
        self.mono_start = mono if self.mono_start is None else min(self.mono_start, mono)
        return mono

    def on_process_time(self, wall: float) -> float:
        """A wall-clock time (an outcome line after the last count record) on the process's own time."""
        return wall if self.clock is None else self.clock[1] + (wall - self.clock[0])

    def on_wall_clock(self, process_time: float) -> float:
        """A time on the process's own clock (:meth:`on_process_time`) back on the wall clock, by its last count
        record's pair of readings (for a chart's labels: a jump of the wall clock since moves it)."""
        return process_time if self.clock is None else self.clock[0] + (process_time - self.clock[1])

    @property
    def origin(self) -> float | None:
        """The start of the process's own time: its first monotonic reading, else its first timestamp."""
        return self.mono_start if self.mono_start is not None else self.start

    @property
    def seconds(self) -> float:
        """How long the process ran: its time under the monitor where its count records say it (the metrics'
        process time, so that both sources of one run give one evidence rate), else on its own clock from its first
        record to its last."""
        if self.process_seconds is not None:
            return self.process_seconds
        if self.mono_start is not None and self.clock is not None:
            return self.clock[1] - self.mono_start
        return self.last - self.start if self.start is not None and self.last is not None else 0.0


def _compared(counts: dict) -> tuple[float, float]:
    compared = divergent = 0.0
    for by_outcome in counts.get("outcomes", {}).values():
        for outcome, value in by_outcome.items():
            compared += value if outcome in COMPARED_OUTCOMES else 0
            divergent += value if outcome in DIVERGENT_OUTCOMES else 0
    return compared, divergent


def _minus(now: dict, base: dict | None) -> dict:
    """Count record ``now`` less ``base`` (the evidence after a reset)."""
    if base is None:
        return now

    def less(a: dict, b: dict) -> dict:
        return {k: (less(v, b.get(k, {})) if isinstance(v, dict) else v - b.get(k, 0)) for k, v in a.items()}

    return {k: (less(v, base.get(k, {})) if isinstance(v, dict) else v - base.get(k, 0)) for k, v in now.items()}


class JournalReader:
    """Counts from JSONL journals, complete: every comparison of every process is counted, from its count records
    (cumulative, so a rotated-away file or a lost line loses no count) and the lines it wrote after its last one;
    a process that did not write every outcome and left lines after its last count record (killed before its
    final flush) has those lines' divergences counted as comparisons whose matches are not known. A process whose
    completeness cannot be told (no count record, no header saying it wrote every outcome) is refused.

    Each comparison's cluster is its process, in blocks of ``window`` seconds counted from the process's own first
    record (0: the whole process), a run of blocks with divergences kept whole (one incident). Evidence from before
    a target's last reset (after a rollback) is set aside."""

    def __init__(self, window: float = CLUSTER_WINDOW_SECONDS, run: str | None = None, recent: float = 0.0) -> None:
        # (a window can only widen the bound: one shorter than the default would count more clusters, more
        # evidence, from the same comparisons; 0 is the widest, a cluster per process)
        self.window = window if window == 0 else max(window, CLUSTER_WINDOW_SECONDS)
        #: Count only the processes of this run (None: every process read).
        self.run = run
        #: The length of the recent window :meth:`counts` can be asked for (seconds of wall time before the last
        #: record read; 0: none is kept), and the last record's time.
        self.recent = recent
        self.latest: float | None = None
        self.earliest = math.inf
        #: By target: the last count record's time where a drill grew, and where comparisons grew without one.
        self.drilled_until: dict[str, float] = {}
        self.clean_until: dict[str, float] = {}
        self.streams: dict[tuple, _Stream] = {}
        self._located: dict[bytes, _Stream] = {}  # an outcome line's process fields -> its process's stream
        self.torn: list[str] = []
        self.lines = 0

    def read(self, paths: Iterable[str]) -> None:
        for path in paths:
            self._read_file(path)

    def runs(self) -> set[str]:
        """The runs of the processes read ("" for a process from before runs had ids)."""
        return {stream.run for stream in self.streams.values()}

    def arm_runs(self) -> list[dict]:
        """The canary A/B iterator records (``"event": "arm"``) of the processes counted, oldest first."""
        found = [r for s in self.streams.values() if self.run is None or s.run == self.run for r in s.arms]
        return sorted(found, key=lambda r: r.get("timestamp") if isinstance(r.get("timestamp"), (int, float)) else 0)

    def _read_file(self, path: str, only: _Stream | None = None, start: tuple[int, int] = (0, 0)) -> None:
        """Read one journal from ``start`` (offset, line number). An outcome line framed as the journal exporter
        frames it is only located (its process read from its last fields); everything else is parsed. With
        ``only``: the second reading of one process's tail, whose outcome lines are counted now."""
        offset, number = start
        located = self._located  # process fields (bytes) -> stream
        try:
            with open(path, "rb") as handle:
                handle.seek(offset)
                readline = handle.readline
                while raw := readline(MAX_LINE_BYTES + 1):
                    number += 1
                    at, offset = offset, offset + len(raw)
                    if raw.startswith(_OUTCOME_START) and raw.endswith(b"\n"):
                        fields = raw[raw.rfind(b',"host":') :]
                        stream = located.get(fields) or self._locate(fields, f"{path}:{number}")
                        if stream is not None:
                            if only is stream:
                                self._count_tail_line(stream, raw, f"{path}:{number}")
                            elif only is None and path not in stream.marks:
                                stream.marks[path] = (at, number - 1)
                            continue
                    if only is not None:
                        continue
                    where = f"{path}:{number}"
                    record = whole_record(raw, where, self.torn)
                    if record is not None:
                        self._add(record, where)
        except OSError as exc:
            raise SourceError(f"cannot read {path}: {exc.strerror or exc}") from exc
        if only is None:
            self.lines += number - start[1]

    def _locate(self, fields: bytes, where: str) -> _Stream | None:
        """The process whose last fields an outcome line ends with (never inside a string: the exporter escapes
        quotes), or None where they are not as the exporter writes them."""
        found = _PROCESS_FIELDS.match(fields)
        if found is None:
            return None
        try:
            host = json.loads(found[1])
        except ValueError:
            return None
        stream = self._located[fields] = self._stream((host, int(found[2]), found[3].decode()), where)
        return stream

    def _count_tail_line(self, stream: _Stream, raw: bytes, where: str) -> None:
        record = record_of(raw, where)
        if record is not None and "event" not in record:
            stream.see(record.get("timestamp"))
            primary = record.get("primary") if record.get("primary") in PRIMARY_SIDES else LEGACY
            stream.folded.setdefault((record["target"], primary), _Tail()).add(record)

    def _stream(self, key: tuple, where: str) -> _Stream:
        stream = self.streams.get(key)
        if stream is None:
            stream = self.streams[key] = _Stream(where)
        return stream

    @staticmethod
    def _key(record: dict, where: str) -> tuple:
        pid = record.get("pid")
        if isinstance(pid, bool) or not isinstance(pid, int):
            raise SourceError(
                f"{where}: a record without its process (pid): which process's counts it belongs to, and its "
                "cluster, cannot be told"
            )
        host, stream = record.get("host"), record.get("stream", "")
        if not (host is None or isinstance(host, str)) or not isinstance(stream, str):
            raise SourceError(f"{where}: a record whose host or stream is not a string")
        return (host, pid, stream)

    def _add(self, record: dict, where: str) -> None:
        stream = self._stream(self._key(record, where), where)
        stream.see(record.get("timestamp"))
        if isinstance(record.get("run"), str):
            stream.run = record["run"]
        event = record.get("event")
        if event == "journal":
            stream.all_outcomes = record.get("all_outcomes") is True
        elif event == "counts":
            stream.counted = True
            stream.marks.clear()  # (a count record covers every line before it: see the journal exporter)
            stream.folded.clear()
            counts = check_counts(record, where)
            phase = stream.phases.setdefault((record["target"], record["primary"]), _Phase())
            self._mark_drill(phase, record, counts)
            phase.counts, phase.at = counts, record["timestamp"]
            command = record.get("command")
            if isinstance(command, str) and len(command) <= 64:
                stream.commands.add(command)
            if "process_seconds" in record:  # (the process's time under the monitor, as its metrics count it)
                seconds = _count(record["process_seconds"], f"{where}: process_seconds", whole=False)
                stream.process_seconds = max(stream.process_seconds or 0.0, seconds)
            compared, divergent = _compared(_minus(counts, phase.baseline))
            before = phase.previous
            if compared < before[0] or divergent < before[1]:
                raise SourceError(f"{where}: a count record below the process's earlier one (counts only grow)")
            phase.previous = (compared, divergent)
            at = stream.process_time(record, where)
            if compared - before[0] > 0:
                phase.intervals.append((at, compared - before[0], divergent - before[1]))
            if self.recent > 0:
                self._keep(phase, record["timestamp"], counts)
        elif event == "arm":
            stream.arms.append(record)
        elif event == "patch_calls":  # (cumulative: the process's last record says all)
            stream.patch_calls = record["calls"]
        elif event in ("rollback", "reset"):
            stream.events.append(record)
            if event == "reset":
                for (target, _), phase in stream.phases.items():
                    if target == record["target"] and phase.counts is not None:
                        phase.baseline = phase.counts
                        phase.previous = (0.0, 0.0)
                        phase.intervals.clear()
                        phase.history.clear()
        else:  # an outcome line not framed as the exporter frames it: counted now, forgotten at a count record
            stream.see(record.get("timestamp"))
            primary = record.get("primary") if record.get("primary") in PRIMARY_SIDES else LEGACY
            stream.folded.setdefault((record["target"], primary), _Tail()).add(record)

    def _mark_drill(self, phase: _Phase, record: dict, counts: dict) -> None:
        """Follow a fire drill by its own marks (the drilled count of count records): per target the last time a
        drill grew and the last time comparisons grew without one."""
        target, timestamp = record["target"], record["timestamp"]
        previous = phase.counts or {}
        drilled = counts["drilled"] - previous.get("drilled", 0)
        compared = _compared(counts)[0] - _compared(previous)[0] if previous else _compared(counts)[0]
        if drilled > 0:
            self.drilled_until[target] = max(self.drilled_until.get(target, -math.inf), timestamp)
        elif compared > 0:
            self.clean_until[target] = max(self.clean_until.get(target, -math.inf), timestamp)

    def drill_over(self, target: str) -> bool:
        """Whether a fire drill of ``target`` is over: comparisons without one were counted after its last."""
        return self.clean_until.get(target, -math.inf) > self.drilled_until.get(target, math.inf)

    def slices(self) -> dict[str, dict[str, TargetCounts]]:
        """The slices of the evidence read, by name (:func:`shadow.analysis.verdict.decide`): the recent window
        where the count records span more than it, and each run where several are pooled."""
        found = {}
        for seconds in verdict.recent_windows(self.recent):
            if self.latest is not None and self.earliest < self.latest - seconds:
                found[verdict.recent_slice(seconds)] = self.counts(recent=seconds)
        runs = self.runs()
        if self.run is None and len(runs) > 1:
            for each in sorted(runs):
                found[verdict.run_slice(each)] = self.counts(run=each)
        return found

    def _keep(self, phase: _Phase, timestamp: float, counts: dict) -> None:
        """Keep a count record for the recent window; drop those no window ending at the latest record can
        start after (the last of them stays: it is where such a window starts)."""
        self.latest = timestamp if self.latest is None else max(self.latest, timestamp)
        self.earliest = min(self.earliest, timestamp)
        history = phase.history
        history.append((timestamp, counts))
        cutoff = self.latest - self.recent
        while len(history) > 1 and history[1][0] <= cutoff:
            history.popleft()

    def _fold(self, stream: _Stream) -> None:
        """Count the framed outcome lines after the process's last count record: read again from where they
        begin."""
        marks, stream.marks = stream.marks, {}
        for path, start in marks.items():
            self._read_file(path, only=stream, start=start)

    def counts(self, recent: float = 0.0, run: str | None = None) -> dict[str, TargetCounts]:
        """The counts of every target, by phase, with clusters; refuses (SourceError) what cannot be counted.
        ``recent``: only those of the last ``recent`` seconds (at most :attr:`recent`) before the latest count
        record (each process's
        counts less those of its last count record at or before the window's start; the lines after its last
        count record all count). ``run``: only that run's processes (else the reader's :attr:`run`, or all)."""
        counts: dict[str, TargetCounts] = {}
        seconds = 0.0  # (the processes' time, first record to last: the evidence rate's denominator)
        processes = 0
        run = self.run if run is None else run
        since = self.latest - min(recent, self.recent) if recent > 0 and self.latest is not None else None
        for stream in self.streams.values():
            self._fold(stream)
            for (target, _), tail in stream.folded.items():
                if sum(tail.drilled.values()):  # (a drill in its last lines: drilling to the end)
                    self.drilled_until[target] = math.inf
        for key, stream in self.streams.items():
            if run is not None and stream.run != run:
                continue
            if not stream.counted and stream.all_outcomes is not True and stream.folded:
                raise SourceError(
                    f"{stream.where}: process {key[0]}/{key[1]} wrote outcome lines but no count record and no header "
                    "saying it wrote every outcome: its matches are not known, so no rate can be computed from it "
                    "(journals of npu-shadow before count records; write them with all_outcomes=True)"
                )
            _add_stream(self, counts, key, stream, since)
            seconds += stream.seconds
            processes += 1
        for entry in counts.values():
            entry.process_seconds = seconds
            entry.processes = processes
        return counts


def _add_stream(
    reader: JournalReader, counts: dict[str, TargetCounts], key: tuple, stream: _Stream, since: float | None
) -> None:
    """One process's evidence added to ``counts``: its rollbacks and resets, its count records (less what came
    before the recent window's start, a reset, a fire drill that is over), the lines after its last count record,
    and its clusters."""
    _add_events(counts, stream)
    _add_records(reader, counts, stream, since)
    _add_tails(counts, key, stream)
    _add_clusters(reader, counts, key, stream, since)


def _add_events(counts: dict[str, TargetCounts], stream: _Stream) -> None:
    """The process's rollbacks (those after a target's last reset) and resets."""
    last_reset: dict[str, int] = {}
    for index, event in enumerate(stream.events):
        if event["event"] == "reset":
            last_reset[event["target"]] = index
    for index, event in enumerate(stream.events):
        entry = counts.setdefault(event["target"], TargetCounts())
        said = f"{event['by']} at {event.get('time', '?')}"
        if event["event"] == "reset":
            entry.resets.append(said)
        elif index > last_reset.get(event["target"], -1):
            entry.rollbacks.append(said)


def _add_records(reader: JournalReader, counts: dict[str, TargetCounts], stream: _Stream, since: float | None) -> None:
    """The process's count records: each phase's last, less its baseline (a reset's, or the recent window's start)
    and the comparisons a fire drill that is over marked."""
    for (target, primary), phase in stream.phases.items():
        entry = counts.setdefault(target, TargetCounts())
        if phase.counts is None:
            continue
        baseline = phase.baseline
        before = [(t, c) for t, c in phase.history if t <= since] if since is not None else []
        if before:
            baseline = before[-1][1]  # (the window's start: what came before is not recent)
        elif phase.baseline is not None:
            entry.set_aside += _compared(phase.baseline)[0]
        evidence = _minus(phase.counts, baseline)
        if evidence["drilled"] > 0 and reader.drill_over(target):
            evidence = _without_drilled(evidence, entry, stream.where)
        _add_counts(counts, target, primary, evidence)


def _without_drilled(evidence: dict, entry: TargetCounts, where: str) -> dict:
    """The evidence of a count record (less its baseline) without the comparisons a fire drill that is over marked
    (its ``drilled_outcomes`` and ``drilled_reasons``), which are added to ``entry.drill_set_aside``: exactly those,
    never whatever else was counted beside them (a real divergence during a drill stays evidence). A record from
    before drills marked their outcomes keeps them as evidence, said."""
    marked = sum(n for by_outcome in evidence["drilled_outcomes"].values() for n in by_outcome.values())
    if marked < evidence["drilled"]:
        entry.notes.append(
            f"{where}: {evidence['drilled'] - marked:g} drilled comparisons without their outcomes (a journal from "
            "before drills marked them) are kept as evidence"
        )
    outcomes = {
        signature: {o: n - evidence["drilled_outcomes"].get(signature, {}).get(o, 0) for o, n in by_outcome.items()}
        for signature, by_outcome in evidence["outcomes"].items()
    }
    reasons = {r: n - evidence["drilled_reasons"].get(r, 0) for r, n in evidence["reasons"].items()}
    entry.drill_set_aside += marked
    return {**evidence, "outcomes": outcomes, "reasons": reasons, "drilled": 0}


def _add_tails(counts: dict[str, TargetCounts], key: tuple, stream: _Stream) -> None:
    """The lines after the process's last count record (their clusters not known), and their times."""
    complete_tail = stream.all_outcomes is True
    for (target, primary), tail in stream.folded.items():
        entry = counts.setdefault(target, TargetCounts())
        _add_tail(entry, primary, tail, complete_tail)
        entry.clusters_not_counted(primary)  # (lines after its last count record: their clusters not known)
        phase = stream.phases.setdefault((target, primary), _Phase())
        for second, (compared, divergent) in tail.seconds.items() if not stream.tail_timed else ():
            counted = compared if complete_tail else divergent  # (incomplete: only the divergences count)
            if counted:
                phase.intervals.append((stream.on_process_time(float(second)), counted, divergent))
        if not complete_tail and any(o in DIVERGENT_OUTCOMES for (_, o) in tail.outcomes):
            entry.notes.append(
                f"process {key[0]}/{key[1]} left {tail.lines} lines after its last count record (it did not "
                "exit cleanly): their divergences count as comparisons whose matches are not known"
            )
    stream.tail_timed = True  # (its tail's times are in its intervals: once, however often it is counted)


def _add_clusters(
    reader: JournalReader, counts: dict[str, TargetCounts], key: tuple, stream: _Stream, since: float | None
) -> None:
    """The process's clusters: its comparisons in blocks of the reader's window on its own time (those of the
    recent window where ``since`` is given), and the clock jumps said."""
    start = -math.inf if since is None else stream.on_process_time(since)
    for (target, primary), phase in stream.phases.items():
        entry = counts.setdefault(target, TargetCounts())
        entry.clustering = clustering(reader.window)
        recent = [i for i in phase.intervals if i[0] > start]
        for block, (compared, divergent) in enumerate(_blocks(recent, stream.origin, reader.window)):
            entry.add_to_cluster((*key, block), compared, divergent, primary)
        for jump in stream.jumps[:3]:
            if jump not in entry.notes:
                entry.notes.append(jump)


def _add_counts(counts: dict[str, TargetCounts], target: str, primary: str, record: dict) -> None:
    """A count record's evidence (less its baseline), through the reader every source's series go through; the
    drill's count and the truth runs' decades (the journal's own tables) beside it."""
    for metric, labels, value in journal_format.record_samples(record):
        add_series(counts, metric.series, {**labels, "target": target, "primary": primary}, value)
    entry = counts[target]
    entry.drilled += record["drilled"]
    if "clusters" not in record and _compared(record)[0]:
        entry.clusters_not_counted(primary)  # (a process of a version before clusters were counted)
    for signature, by_decade in record.get("truth_decades", {}).items():
        for decade, value in by_decade.items():
            entry.add_truth_decade(signature, int(decade), value, primary)


def _add_tail(entry: TargetCounts, primary: str, tail: _Tail, complete: bool) -> None:
    """A process's lines after its last count record: all of them where it wrote every outcome; else skips and
    divergences only (comparisons whose matches are not known: never counted as agreement)."""
    for (signature, reason), value in tail.skipped.items():
        entry.add_skip(reason, value, primary, signature)
    for (signature, outcome), value in tail.outcomes.items():
        if complete:
            entry.add_outcome(signature, outcome, value, primary)
        elif outcome in DIVERGENT_OUTCOMES:
            phase = entry.phase(primary)
            phase.unmatched[signature] = phase.unmatched.get(signature, 0) + value
    for (reason, divergent), value in tail.reasons.items():
        if complete or divergent:
            entry.add_reason(reason, value, primary)
    for reason, value in tail.shared.items():
        entry.add_shared(reason, value, primary)
    for (signature, side), value in tail.truth.items():  # (truth runs are of value differences: all lines)
        entry.add_truth(signature, side, value, primary)
    for (signature, decade), value in tail.truth_decades.items():
        entry.add_truth_decade(signature, int(decade), value, primary)
    for (signature, found), value in tail.backward.items():
        if complete:  # (a gradient match not written as a line is not known: never counted as agreement)
            entry.add_backward(signature, found, value, primary)
        elif found == "mismatch":
            phase = entry.phase(primary)
            phase.backward_unmatched[signature] = phase.backward_unmatched.get(signature, 0) + value
    entry.drilled += sum(v for divergent, v in tail.drilled.items() if complete or divergent)
    for (evidence, pair, check), value in tail.noise.items() if complete else ():  # (within: agreement not known)
        entry.add_noise(evidence, pair, check, value, primary)


def _blocks(intervals: list, start: float | None, window: float) -> list[tuple[float, float]]:
    """(compared, divergent) per block: ``window`` seconds counted from the process's start; a block that ends
    in divergence runs on while divergence does (an incident is never cut)."""
    blocks: list[list[float]] = []
    origin = start or 0.0
    current = None
    diverging = False
    for timestamp, compared, divergent in sorted(intervals, key=lambda i: i[0]):
        cell = int((timestamp - origin) // window) if window > 0 else 0
        if current is None or (cell != current and not (diverging and divergent > 0)):
            blocks.append([0.0, 0.0])
            current = cell
        blocks[-1][0] += compared
        blocks[-1][1] += divergent
        diverging = divergent > 0
    return [(c, d) for c, d in blocks]


def from_journal(
    paths: Iterable[str],
    torn: list[str] | None = None,
    window: float = CLUSTER_WINDOW_SECONDS,
    run: str | None = None,
    all_runs: bool = False,
    arms: list[dict] | None = None,
    recent: float = 0.0,
    slices: dict[str, dict[str, TargetCounts]] | None = None,
    patches: dict[str, float] | None = None,
) -> dict[str, TargetCounts]:
    """Counts from JSONL journals and their rotated siblings (see :class:`JournalReader`), of ``run`` or of the one
    run they hold (:func:`select_run`); a torn final line is skipped (its place appended to ``torn`` when
    given). ``arms``, when given, receives the run's canary A/B iterator records. ``slices``, when given,
    receives the counts of the last ``recent`` seconds (where the evidence spans more) and, where several runs are
    pooled, of each run (:func:`shadow.analysis.verdict.decide`). ``patches``, when given, receives the calls of
    each function patch of the release (:func:`patch_calls`)."""
    reader = JournalReader(window, recent=recent if slices is not None else 0.0)
    read, added = with_rotated(paths)
    reader.read(read)
    reader.run = select_run(reader.runs(), run, all_runs, "the journals")
    commands: dict[str, set[str]] = {}
    for stream in reader.streams.values():
        if reader.run is None or stream.run == reader.run:
            commands.setdefault(stream.run, set()).update(stream.commands)
    one_job_per_run(commands, "the journals")
    if torn is not None:
        torn.extend(reader.torn)
    if arms is not None:
        arms.extend(reader.arm_runs())
    if patches is not None:
        patches.update(patch_calls(reader))
    counts = reader.counts()
    if slices is not None:
        slices.update(reader.slices())
    if added:
        for entry in counts.values():
            entry.notes.append(f"read with the rotated files beside them: {', '.join(added)}")
    return counts


def patch_calls(reader: JournalReader) -> dict[str, float]:
    """The calls of each function patch of a release in the journals ``reader`` read, every process of its run
    together (each process's last ``patch_calls`` record: they are cumulative)."""
    found: dict[str, float] = {}
    for stream in reader.streams.values():
        if reader.run is None or stream.run == reader.run:
            for patch, calls in stream.patch_calls.items():
                found[patch] = found.get(patch, 0) + calls
    return found
