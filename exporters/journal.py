"""A JSON-lines journal of observations, rotated by size, with optional repro captures."""

from __future__ import annotations

import contextlib
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
from collections.abc import Callable, Mapping
from json.encoder import encode_basestring_ascii

from exporters import capture, contract
from shadow.core import forks
from shadow.core.observation import Observation, Outcome
from shadow.core.safe_paths import check_private_directory, make_private_directory, open_own_file, template_problem


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


class JsonlExporter:
    """One JSON line per observation that is not a bitwise match or found a shared divergence (every one with
    ``all_outcomes``).

    ``path`` may hold ``{pid}`` and ``{rank}``; give each process its own file that way when several
    processes journal. The file rotates past ``max_bytes`` keeping ``backups`` old files (path.1, ...).
    ``capture_dir`` turns on repro captures of mismatches and errors: at most ``max_captures`` files and
    ``max_capture_bytes`` of tensor data per process. ``annotate`` returns fields to add to each line (the pytest
    plugin's test node id, say). Write errors (disk full, unwritable) are raised to
    the engine, which counts them as ``export`` skips; training never sees them.
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
    ) -> None:
        numbers = {"max_bytes": max_bytes, "backups": backups, "max_captures": max_captures}
        numbers["max_capture_bytes"] = max_capture_bytes
        for name, value in numbers.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"JsonlExporter: {name} must be an int >= 0, got {value!r}")
        problem = template_problem(path) if isinstance(path, str) else "not a string"
        if problem is not None:
            raise ValueError(f"JsonlExporter: path={path!r} is not valid: {problem}")
        if capture_dir is not None:
            check_private_directory(capture_dir, "capture_dir")
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
        self._reset_process_state()
        forks.register(self)

    def _reset_process_state(self) -> None:
        self.pid = os.getpid()
        self.rank = _rank()
        self.path = self.path_template.format(pid=self.pid, rank=self.rank if self.rank is not None else "none")
        self.captures_written = 0
        self.captures_tried = 0
        self.captures_failed = 0
        self.capture_bytes = 0
        self._process_fields: str | None = None  # at the first line: the device may come after the exporter

    # ------------------------------------------------------------------ export

    def export(self, observation: Observation) -> None:
        if observation.outcome == Outcome.MATCH and not observation.shared_divergence and not self.all_outcomes:
            return
        with self._lock:
            # The line first: it never depends on the capture. A capture that then fails is removed and raised
            # (the engine counts it as an export skip); its line names a file that is not there.
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

    def record_rollback(self, target: str, by: str) -> None:
        """A line of its own for each rollback (``"event": "rollback"``): when, which target, who or what threw it."""
        now = time.time()
        fields = {
            "event": "rollback",
            "time": datetime.datetime.fromtimestamp(now, _UTC).isoformat(),
            "timestamp": now,
            "target": target,
            "by": by,
        }
        with self._lock:
            self._write(f"{_encode(fields)[:-1]},{self._process_fields or self._process()}\n")

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
            f'"capture":{"null" if capture_path is None else _quote(capture_path)},'
            f'"drill":{"true" if o.drill else "false"},"legacy":{_quote(o.legacy)},"primary":{_quote(o.primary)},'
            f"{self._annotations()}{self._process_fields or self._process()}\n"
        )

    def _process(self) -> str:
        """This process's fields, the same on every line: host, pid, rank, versions and device."""
        fields = {"host": self.host, "pid": self.pid, "rank": self.rank}
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

    def _still_named(self) -> bool:
        """Whether the path still names the open file (not deleted, renamed or rotated by another process)."""
        try:
            named, held = os.lstat(self.path), os.fstat(self._fd)
        except FileNotFoundError:
            return False
        return (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)

    def _write(self, line: str) -> None:
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
        data = capture.payload(observation)
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
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def _after_fork_in_child(self) -> None:
        self._lock = threading.Lock()
        if "{pid}" in self.path_template or "{rank}" in self.path_template:
            self._fd = None  # the parent keeps writing its file; this child opens its own
        self._reset_process_state()
