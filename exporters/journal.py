"""A JSON-lines journal of observations, rotated by size, with optional repro captures.

The exporter keeps the protocol (what to write when) and the counts; the lines' schema is
:mod:`exporters.journal_format`'s, the file :class:`~exporters.journal_file.JournalFile`, the captures
:class:`~exporters.capture.Captures`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import math
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping

from exporters.capture import Captures
from exporters.journal_file import JournalFile
from exporters.journal_format import PHASE_SERIES, Counts, observation_line, quote
from shadow.core.calls.canary.arms import ArmRun
from shadow.core.model import contract
from shadow.core.model.observation import Observation, Outcome, Switched
from shadow.core.support import forks
from shadow.core.support.safe_paths import check_private_directory, template_problem


def _rank() -> int | None:
    for name in ("RANK", "LOCAL_RANK"):
        value = os.environ.get(name)
        if value is not None and value.isdigit():
            return int(value)
    return None


_UTC = datetime.timezone.utc
_encode = json.JSONEncoder(separators=(",", ":")).encode

#: Count records are written at most this often while observations arrive (and at every flush, close, rollback
#: and reset): a process killed between two loses at most this long of counts.
COUNT_INTERVAL_SECONDS = 10.0


def _check_arguments(path: object, numbers: dict[str, object], count_interval: object, capture_dir: object) -> None:
    """A JsonlExporter's arguments, checked before anything is opened: ValueError naming the one that is wrong."""
    for name, value in numbers.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"JsonlExporter: {name} must be an int >= 0, got {value!r}")
    problem = template_problem(path) if isinstance(path, str) else "not a string"
    if problem is not None:
        raise ValueError(f"JsonlExporter: path={path!r} is not valid: {problem}")
    if (
        isinstance(count_interval, bool)
        or not isinstance(count_interval, (int, float))
        or not (0 <= count_interval < math.inf)
    ):
        raise ValueError(f"JsonlExporter: count_interval must be seconds >= 0, got {count_interval!r}")
    if capture_dir is not None:
        check_private_directory(capture_dir, "capture_dir")  # type: ignore[arg-type]


class JsonlExporter:
    """One JSON line per observation that is not a bitwise match, found a shared divergence or ran an A/A run
    (every one with ``all_outcomes``), and count records: every ``count_interval`` seconds while observations
    arrive, and at every flush, close, rollback and reset, one ``{"event": "counts"}`` line per target and primary
    side with everything this process counted so far (comparisons by signature and outcome, skips by signature and
    reason, calls by signature). The first line of each process says whether it writes every outcome
    (``{"event": "journal", "all_outcomes": ...}``). Counts are cumulative, so a lost line or a rotated-away file
    loses no count: ``npu-shadow verdict`` counts every comparison from them.

    ``path`` may hold ``{pid}`` and ``{rank}``; give each process its own file that way when several
    processes journal. The file rotates past ``max_bytes`` keeping ``backups`` old files (path.1, ...).
    ``capture_dir`` turns on repro captures of mismatches and errors: at most ``max_captures`` files and
    ``max_capture_bytes`` of tensor data per process. ``annotate`` returns fields to add to each line (the pytest
    plugin's test node id, say). Write errors (disk full, unwritable) are raised to
    the engine, which counts them as export errors; training never sees them.
    """

    def __init__(
        self,
        path: str,
        max_bytes: int = 16 << 20,
        backups: int = 3,
        all_outcomes: bool = False,
        capture_dir: str | None = None,
        max_captures: int = 20,
        max_capture_bytes: int = 256 << 20,
        annotate: Callable[[], Mapping[str, str]] | None = None,
        count_interval: float = COUNT_INTERVAL_SECONDS,
    ) -> None:
        numbers = {"max_bytes": max_bytes, "backups": backups, "max_captures": max_captures}
        _check_arguments(path, {**numbers, "max_capture_bytes": max_capture_bytes}, count_interval, capture_dir)
        self.count_interval = float(count_interval)
        self.annotate = annotate
        self.path_template = path
        self.max_bytes = max_bytes
        self.backups = backups
        self.all_outcomes = all_outcomes
        self.capture_dir = capture_dir
        self.captures = capture_dir is not None  # (the core keeps a divergence's evidence for them)
        self.max_captures = max_captures
        self.max_capture_bytes = max_capture_bytes
        self.host = socket.gethostname()
        self._lock = threading.Lock()
        self._file: JournalFile | None = None
        self._reset_process_state()
        forks.register(self)

    def _reset_process_state(self) -> None:
        self.run = contract.run_id()  # (ValueError naming the variable where the named run cannot be one)
        self.pid = os.getpid()
        self.rank = _rank()
        self.path = self.path_template.format(pid=self.pid, rank=self.rank if self.rank is not None else "none")
        if self._file is None or self._file.path != self.path:  # (a forked child of a {pid} or {rank} journal's)
            lost = self._file.lines_lost if self._file is not None else 0
            self._file = JournalFile(self.path, self.max_bytes, self.backups)
            self._file.lines_lost = lost
        self.captures = (
            Captures(self.capture_dir, self.max_captures, self.max_capture_bytes) if self.capture_dir else None
        )
        self._process_fields: str | None = None  # at the first line: the device may come after the exporter
        self.stream = uuid.uuid4().hex[:16]  # this process's writing, whatever pid a later process gets
        self._counts: dict[tuple[str, str], Counts] = {}  # (target, primary) -> counts
        self._dirty: set[tuple[str, str]] = set()
        self._counts_written_at = time.monotonic()
        self._header_written = False
        self._process_seconds = 0.0
        self._patch_calls: dict[str, int] = {}
        self._patch_calls_dirty = False
        self._command = contract.command_id()

    @property
    def lines_lost(self) -> int:
        """Lines not written (a full disk, a file that is not this user's own): each also raised to the engine."""
        return self._file.lines_lost if self._file is not None else 0

    @property
    def captures_failed(self) -> int:
        """Captures that could not be described or written (each raised to the engine)."""
        return self.captures.failed if self.captures is not None else 0

    # ------------------------------------------------------------------ export

    def _phase(self, target: str, primary: str) -> Counts:
        key = (target, primary)
        self._dirty.add(key)
        counts = self._counts.get(key)
        if counts is None:
            counts = self._counts[key] = Counts()
        return counts

    def record(self, samples: Iterable[contract.Sample]) -> None:
        """The contract's samples, summed into the count records: a phase's series (:data:`PHASE_SERIES`) into
        its counts, the job's patch calls into the ``patch_calls`` record, process time into every count record. (A
        zero adds nothing: the series an endpoint shows at zero from the start are no phase's counts here.)"""
        with self._lock:
            for metric, labels, value in samples:
                if not value:
                    continue
                phase = PHASE_SERIES.get(metric)
                if phase is not None:
                    self._phase(labels[phase[0]], labels[phase[1]]).add(metric, labels, value)
                elif metric is contract.PATCH_CALLS:
                    self._patch_calls[labels[0]] = self._patch_calls.get(labels[0], 0) + value
                    self._patch_calls_dirty = True
                elif metric is contract.PROCESS_TIME:
                    self._process_seconds += value

    def flush(self) -> None:
        """Write the count records of whatever changed since the last ones."""
        with self._lock:
            self._write_counts()

    def export(self, record: Observation | Switched | ArmRun) -> None:
        """A record's line: an observation's that is not a bitwise match, found a shared divergence or ran an A/A
        run (every one with ``all_outcomes``), a rollback's or reset's, a canary A/B iterator's."""
        if isinstance(record, Switched):
            self._event(record.event, record.target, record.by)
        elif isinstance(record, ArmRun):
            self._export_arm(record)
        else:
            self._export_observation(record)

    def _export_observation(self, observation: Observation) -> None:
        with self._lock:
            self._phase(observation.target, observation.primary).truth_decade(observation)
            try:
                if (
                    observation.outcome != Outcome.MATCH
                    or observation.shared_divergence
                    or observation.aa
                    or self.all_outcomes
                ):
                    self._export_line(observation)
            finally:  # (after the line: a count record covers every line before it, never one after it)
                if self.count_interval == 0 or time.monotonic() - self._counts_written_at >= self.count_interval:
                    self._write_counts()

    def _export_line(self, observation: Observation) -> None:
        """The observation's line (under the lock). The line first: it never depends on the capture. A capture
        that then fails is removed and raised (the engine counts it as an export error); its line names a file that
        is not there."""
        data, failure, captures = None, None, self.captures
        if captures is not None:
            try:
                data = captures.data(observation, self.run)
            except Exception as exc:  # the evidence could not be described (a __repr__ that raises, ...)
                failure = exc
        capture_path = captures.path(observation, self.pid) if data is not None else None  # type: ignore[union-attr]
        capture = "null" if capture_path is None else quote(capture_path)
        tail = f"{self._annotations()}{self._process_fields or self._process()}\n"
        self._write(observation_line(observation, capture, tail))
        if capture_path is not None:
            captures.save(data, capture_path)  # type: ignore[union-attr, arg-type]
        if failure is not None:
            raise failure

    def _export_arm(self, run: ArmRun) -> None:
        """One iterator of a canary A/B (``"event": "arm"``, :mod:`shadow.core.calls.canary.arms`): its arm and what
        was measured of it."""
        fields = dataclasses.asdict(run)
        fields.pop("timestamp")
        with self._lock:
            self._write_record({"event": "arm", **fields, "workers_bound": run.workers_bound})

    def _event(self, event: str, target: str, by: str) -> None:
        """A line of its own for each rollback or reset (a reset sets evidence from before it aside): when, which
        target, who or what threw it; the count records first, so that the counts before it are known exactly."""
        with self._lock:
            self._write_counts()
            self._write_record({"event": event, "target": target, "by": by})

    def _write_record(self, fields: dict) -> None:
        now = time.time()
        # (the monotonic clock beside the wall clock: the verdict places a process's counts on its own time, which
        # no jump of the wall clock moves)
        stamp = {
            "time": datetime.datetime.fromtimestamp(now, _UTC).isoformat(),
            "timestamp": now,
            "mono": time.monotonic(),
        }
        self._write(f"{_encode({**fields, **stamp})[:-1]},{self._process_fields or self._process()}\n")

    def _write_counts(self) -> None:
        """The count records of the phases that changed (under the lock). A failed write keeps them due: the next
        record carries the same cumulative counts and more."""
        self._counts_written_at = time.monotonic()
        if self._patch_calls_dirty:
            self._write_record({"event": "patch_calls", "calls": dict(sorted(self._patch_calls.items()))})
            self._patch_calls_dirty = False
        for key in sorted(self._dirty):
            target, primary = key
            fields = self._counts[key].fields()
            self._write_record(
                {"event": "counts", "target": target, "primary": primary, **fields,
                 "process_seconds": round(self._process_seconds, 3), "command": self._command}
            )  # fmt: skip
            self._dirty.discard(key)

    def _process(self) -> str:
        """This process's fields, the same on every line: run, host, pid, stream, rank, versions and device."""
        fields = {
            "run": contract.run_id(),
            "host": self.host,
            "pid": self.pid,
            "stream": self.stream,
            "rank": self.rank,
        }
        fields.update({k: v for k, v in contract.versions().items() if k != "version"}, device=contract.device())
        self._process_fields = _encode(fields)[1:]
        return self._process_fields

    def _annotations(self) -> str:
        """The caller's own fields for this line (the pytest plugin adds the test), as JSON members."""
        if self.annotate is None:
            return ""
        fields = {str(k): str(v) for k, v in self.annotate().items()}
        return _encode(fields)[1:-1] + "," if fields else ""

    def _write(self, line: str) -> None:
        if not self._header_written:
            self._header_written = True  # (first: the header's own write comes through here)
            try:
                self._write_record({"event": "journal", "all_outcomes": self.all_outcomes})
            except BaseException:
                self._header_written = False
                raise
        self._file.write(line.encode())  # type: ignore[union-attr]

    def close(self) -> None:
        with self._lock:
            with contextlib.suppress(OSError):
                self._write_counts()
            self._file.close()  # type: ignore[union-attr]

    def _after_fork_in_child(self) -> None:
        self._lock = threading.Lock()
        if "{pid}" in self.path_template or "{rank}" in self.path_template:
            self._file.forget()  # type: ignore[union-attr]  # (the parent keeps writing its file; this child opens its own)
        self._reset_process_state()
