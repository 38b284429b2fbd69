"""A JSON-lines journal of observations, rotated by size, with optional repro captures."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import errno
import fcntl
import json
import math
import os
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from json.encoder import encode_basestring_ascii

from exporters import capture, contract
from shadow.core.calls.canary.arms import ArmRun
from shadow.core.model.observation import DIFFERS_IN_FLOAT64, LEGACY, Observation, Outcome, error_decade
from shadow.core.support import forks
from shadow.core.support.safe_paths import (
    check_private_directory,
    make_private_directory,
    open_own_file,
    template_problem,
)


def _rank() -> int | None:
    for name in ("RANK", "LOCAL_RANK"):
        value = os.environ.get(name)
        if value is not None and value.isdigit():
            return int(value)
    return None


_UTC = datetime.timezone.utc
_encode = json.JSONEncoder(separators=(",", ":")).encode
_quote = encode_basestring_ascii


def _number(value: float) -> str:
    """A JSON number, or a string for inf/nan (strict JSON has neither)."""
    return repr(float(value)) if math.isfinite(value) else f'"{value}"'


#: Count records are written at most this often while observations arrive (and at every flush, close, rollback
#: and reset): a process killed between two loses at most this long of counts.
COUNT_INTERVAL_SECONDS = 10.0


class _Counts:
    """What one (target, primary) phase of this process saw since the exporter started: every observation (those
    not written as lines too), calls and budget skips. Written whole (cumulative) in count records."""

    __slots__ = (
        "backward", "calls", "clusters", "drilled", "outcomes", "reasons", "shared", "skipped", "truth",
        "truth_decades",
    )  # fmt: skip

    def __init__(self) -> None:
        self.outcomes: dict[str, dict[str, int]] = {}  # signature -> outcome -> count
        self.skipped: dict[str, dict[str, int]] = {}  # signature -> reason -> count
        self.reasons: dict[str, int] = {}
        self.shared: dict[str, int] = {}
        self.calls: dict[str, int] = {}
        self.clusters = (
            0.0  # (shadow.core.calls.record.clusters: the clusters its comparisons opened, 1 / WORLD_SIZE each)
        )
        self.drilled = 0
        self.truth: dict[str, dict[str, int]] = {}  # signature -> nearer -> truth runs
        self.truth_decades: dict[str, dict[str, int]] = {}  # signature -> error decade -> truth runs
        self.backward: dict[str, dict[str, int]] = {}  # signature -> what the backward comparison found -> count

    def observe(self, o: Observation) -> None:
        if o.outcome == Outcome.SKIPPED:
            for reason in o.reasons:
                self.skip(o.signature, reason, 1)
            return
        by_outcome = self.outcomes.setdefault(o.signature, {})
        by_outcome[o.outcome] = by_outcome.get(o.outcome, 0) + 1
        self.clusters += o.cluster_share
        for reason in o.reasons:
            self.reasons[reason] = self.reasons.get(reason, 0) + 1
        if o.shared_divergence:
            self.shared[o.shared_divergence] = self.shared.get(o.shared_divergence, 0) + 1
        self.drilled += o.drill
        if o.backward:
            by_found = self.backward.setdefault(o.signature, {})
            by_found[o.backward_outcome] = by_found.get(o.backward_outcome, 0) + 1
        if o.nearer:
            by_side = self.truth.setdefault(o.signature, {})
            by_side[o.nearer] = by_side.get(o.nearer, 0) + 1
            decade = error_decade(o.legacy_truth_error, o.upstream_truth_error)
            if decade is not None and o.nearer != DIFFERS_IN_FLOAT64:  # (errors against two runs: no ratio)
                by_decade = self.truth_decades.setdefault(o.signature, {})
                by_decade[str(decade)] = by_decade.get(str(decade), 0) + 1

    def skip(self, signature: str, reason: str, count: int) -> None:
        by_reason = self.skipped.setdefault(signature, {})
        by_reason[reason] = by_reason.get(reason, 0) + count

    def fields(self) -> dict:
        return {
            "outcomes": self.outcomes,
            "skipped": self.skipped,
            "reasons": self.reasons,
            "shared": self.shared,
            "calls": self.calls,
            "clusters": self.clusters,
            "drilled": self.drilled,
            "truth": self.truth,
            "truth_decades": self.truth_decades,
            "backward": self.backward,
        }


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
        numbers["max_capture_bytes"] = max_capture_bytes
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
            check_private_directory(capture_dir, "capture_dir")
        self.count_interval = float(count_interval)
        self.annotate = annotate
        self.path_template = path
        self.max_bytes = max_bytes
        self.backups = backups
        self.all_outcomes = all_outcomes
        self.capture_dir = capture_dir
        self.max_captures = max_captures
        self.max_capture_bytes = max_capture_bytes
        self.host = socket.gethostname()
        #: Lines not written (a full disk, a file that is not this user's own): each also raised to the engine.
        self.lines_lost = 0
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._primary: dict[str, str] = {}  # target -> the side the caller gets now (set_primary)
        self._reset_process_state()
        forks.register(self)

    def _reset_process_state(self) -> None:
        self.run = contract.run_id()  # (ValueError naming the variable where the named run cannot be one)
        self.pid = os.getpid()
        self.rank = _rank()
        self.path = self.path_template.format(pid=self.pid, rank=self.rank if self.rank is not None else "none")
        self.captures_written = 0
        self.captures_tried = 0
        self.captures_failed = 0
        self.capture_bytes = 0
        self._process_fields: str | None = None  # at the first line: the device may come after the exporter
        self.stream = uuid.uuid4().hex[:16]  # this process's writing, whatever pid a later process gets
        self._counts: dict[tuple[str, str], _Counts] = {}  # (target, primary) -> counts
        self._dirty: set[tuple[str, str]] = set()
        self._counts_written_at = time.monotonic()
        self._header_written = False
        self._opened_before = False

    # ------------------------------------------------------------------ export

    def _phase(self, target: str, primary: str) -> _Counts:
        key = (target, primary)
        self._dirty.add(key)
        counts = self._counts.get(key)
        if counts is None:
            counts = self._counts[key] = _Counts()
        return counts

    def set_primary(self, target: str, side: str) -> None:
        with self._lock:
            self._primary[target] = side

    def record_calls(self, target: str, calls: int, signature: str = "") -> None:
        with self._lock:
            phase = self._phase(target, self._primary.get(target, LEGACY))
            phase.calls[signature] = phase.calls.get(signature, 0) + calls

    def record_skips(self, target: str, reason: str, count: int) -> None:
        with self._lock:
            self._phase(target, self._primary.get(target, LEGACY)).skip("", reason, count)

    def flush(self) -> None:
        """Write the count records of whatever changed since the last ones."""
        with self._lock:
            self._write_counts()

    def export(self, observation: Observation) -> None:
        with self._lock:
            self._phase(observation.target, observation.primary).observe(observation)
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
        try:
            data, failure = self._capture_data(observation), None
        except Exception as exc:  # the evidence could not be described (a __repr__ that raises, ...)
            data, failure = None, exc
            self.captures_failed += 1
        capture_path = self._capture_path(observation) if data is not None else None
        self._write(self._line(observation, capture_path))
        if capture_path is not None:
            self._capture(data, capture_path)
        if failure is not None:
            raise failure

    def export_arm(self, run: ArmRun) -> None:
        """One iterator of a canary A/B (``"event": "arm"``, :mod:`shadow.core.calls.canary.arms`): its arm and what was
        measured
        of it."""
        fields = dataclasses.asdict(run)
        fields.pop("timestamp")
        with self._lock:
            self._write_record({"event": "arm", **fields, "workers_bound": run.workers_bound})

    def record_rollback(self, target: str, by: str) -> None:
        """A line of its own for each rollback (``"event": "rollback"``): when, which target, who or what threw it;
        the count records first, so that the counts before it are known exactly."""
        self._event("rollback", target, by)

    def record_reset(self, target: str, by: str) -> None:
        """A person's reset after a rollback (``"event": "reset"``): evidence from before it is set aside."""
        self._event("reset", target, by)

    def _event(self, event: str, target: str, by: str) -> None:
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
        for key in sorted(self._dirty):
            target, primary = key
            self._write_record({"event": "counts", "target": target, "primary": primary, **self._counts[key].fields()})
            self._dirty.discard(key)

    def _line(self, observation: Observation, capture_path: str | None) -> str:
        """One JSON object. Strings go through json's own (C) escaper; the object is framed here, which
        is several times faster than encoding a dict (the journal writes on the training thread)."""
        o = observation
        reasons = ",".join(map(_quote, o.reasons))
        return (
            f'{{"time":{_quote(datetime.datetime.fromtimestamp(o.timestamp, _UTC).isoformat())},'
            f'"timestamp":{o.timestamp!r},"target":{_quote(o.target)},"outcome":{_quote(o.outcome)},'
            f'"reasons":[{reasons}],"max_abs_error":{_number(o.max_abs_error)},'
            f'"max_rel_error":{_number(o.max_rel_error)},"mismatched":{o.mismatched:d},"numel":{o.numel:d},'
            f'"signature":{_quote(o.signature)},"detail":{_quote(o.detail)},'
            f'"legacy_seconds":{o.legacy_seconds!r},"upstream_seconds":{o.upstream_seconds!r},'
            f'"compare_seconds":{o.compare_seconds!r},"oracle_seconds":{o.oracle_seconds!r},'
            f'"shared_divergence":{_quote(o.shared_divergence) if o.shared_divergence else "null"},'
            f'"shared_detail":{_quote(o.shared_detail)},"aa":{"true" if o.aa else "false"},'
            f'"aa_abs_error":{_number(o.aa_abs_error)},"aa_rel_error":{_number(o.aa_rel_error)},'
            f'"noise_test":{_quote(o.noise_test)},"backward":{"true" if o.backward else "false"},'
            f'"backward_skip":{_quote(o.backward_skip) if o.backward_skip else "null"},'
            f'"nearer":{_quote(o.nearer) if o.nearer else "null"},'
            f'"legacy_truth_error":{_number(o.legacy_truth_error)},'
            f'"upstream_truth_error":{_number(o.upstream_truth_error)},'
            f'"capture":{"null" if capture_path is None else _quote(capture_path)},'
            f'"drill":{"true" if o.drill else "false"},"legacy":{_quote(o.legacy)},"primary":{_quote(o.primary)},'
            f"{self._annotations()}{self._process_fields or self._process()}\n"
        )

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

    def _open(self) -> None:
        directory = os.path.dirname(self.path)
        if directory:
            os.makedirs(directory, exist_ok=True)
        # O_APPEND: each line is one write(2) at the end of the file, whole, even with other writers.
        # Only a regular file of this user's that no one else can write, never through a symlink, never waiting
        # on a FIFO planted there. 0600: lines hold tensor values.
        self._fd = open_own_file(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        if not self._opened_before:  # (a torn line is left by a process that died: only a start can find one)
            self._opened_before = True
            self._end_a_torn_line()

    def _end_a_torn_line(self) -> None:
        """A file whose last line is torn (a job killed mid-line, restarted on the same journal) gets its newline
        first: the next line starts whole, never appended to the torn one (readers skip the torn line, said)."""
        size = os.fstat(self._fd).st_size
        if not size:
            return
        try:
            with open(self.path, "rb", opener=lambda path, flags: os.open(path, os.O_RDONLY | os.O_NOFOLLOW)) as f:
                f.seek(size - 1)
                last = f.read(1)
        except OSError:
            return
        if last != b"\n":
            os.write(self._fd, b"\n")

    def _still_named(self) -> bool:
        """Whether the path still names the open file (not deleted, renamed or rotated by another process)."""
        try:
            named, held = os.lstat(self.path), os.fstat(self._fd)
        except FileNotFoundError:
            return False
        return (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)

    def _write(self, line: str) -> None:
        if not self._header_written:
            self._header_written = True  # (first: the header's own write comes through here)
            try:
                self._write_record({"event": "journal", "all_outcomes": self.all_outcomes})
            except BaseException:
                self._header_written = False
                raise
        data = line.encode()
        if self._fd is not None and not self._still_named():
            os.close(self._fd)
            self._fd = None
        if self._fd is None:
            self._open()
        size = os.fstat(self._fd).st_size
        if self.max_bytes and size and size + len(data) > self.max_bytes:
            self._rotate(len(data))
        written = 0
        try:
            written = os.write(self._fd, data)
        finally:
            if written != len(data):
                self.lines_lost += 1
                if written:  # a line is written whole or not at all: take the part back
                    os.ftruncate(self._fd, os.fstat(self._fd).st_size - written)
        if written != len(data):
            raise OSError(errno.ENOSPC, f"{self.path}: a line could not be written whole (disk full?); not written")

    def _rotate(self, incoming: int) -> None:
        """Rotate under an exclusive lock on ``path.lock``, so that processes sharing the path rotate once
        between them; a process that finds the file already rotated just reopens the new one."""
        lock = open_own_file(f"{self.path}.lock", os.O_WRONLY | os.O_CREAT)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if self._still_named() and os.fstat(self._fd).st_size + incoming > self.max_bytes:
                if self.backups:
                    for index in range(self.backups - 1, 0, -1):
                        older = f"{self.path}.{index}"
                        if os.path.exists(older):
                            os.replace(older, f"{self.path}.{index + 1}")
                    os.replace(self.path, f"{self.path}.1")
                else:
                    os.remove(self.path)
            os.close(self._fd)
            self._fd = None
            self._open()
        finally:
            os.close(lock)  # (releases the lock)

    def _capture_data(self, observation: Observation) -> dict | None:
        """What this observation's capture would hold, if it gets one within the limits."""
        if self.capture_dir is None or observation.evidence is None or self.captures_written >= self.max_captures:
            return None
        data = {**capture.payload(observation), "run": self.run}  # (which run's evidence it is)
        return data if self.capture_bytes + capture.size_of(data) <= self.max_capture_bytes else None

    def _capture_path(self, observation: Observation) -> str:
        """A fresh name: one that no earlier attempt of this process used, failed or not."""
        self.captures_tried += 1
        # (a target's name is anyone's string: only its plain characters make the file name, inside capture_dir)
        name = re.sub(r"[^A-Za-z0-9_-]", "_", observation.target)[:64]
        return os.path.join(self.capture_dir, f"{name}-{self.pid}-{self.captures_tried:04d}.pt")

    def _capture(self, data: dict, path: str) -> None:
        try:
            make_private_directory(self.capture_dir, "capture_dir")
            capture.save(data, path)
        except BaseException:
            self.captures_failed += 1
            with contextlib.suppress(OSError):
                if os.path.isfile(path) and not os.path.islink(path):
                    os.remove(path)  # a partial file; the next capture gets another name anyway
            raise
        self.captures_written += 1
        self.capture_bytes += capture.size_of(data)

    def close(self) -> None:
        with self._lock:
            with contextlib.suppress(OSError):
                self._write_counts()
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def _after_fork_in_child(self) -> None:
        self._lock = threading.Lock()
        if "{pid}" in self.path_template or "{rank}" in self.path_template:
            self._fd = None  # the parent keeps writing its file; this child opens its own
        self._reset_process_state()
