"""The rollback switch of a running canary job: a file, and/or a loopback HTTP endpoint, that make legacy the
primary from the next call on, without a restart.

- **File** (``--rollback-file PATH``): a thread looks for the file every :data:`POLL_SECONDS`; when a regular file
  of the job's own user that no one else can write appears there, the switch is thrown, by ``file:<its first line,
  or its path>``. Anything else at the path (a symbolic link, a FIFO, a device, another user's file, a file others
  can write) is refused, never read nor waited on, counted in :attr:`RollbackSwitch.refused_files` and said once.
  The file stays the record; deleting it resets nothing (only a person's reset over HTTP does).
- **HTTP** (``--rollback-port PORT``, 127.0.0.1 unless ``--rollback-addr``): ``POST /rollback`` throws the switch,
  ``POST /reset`` puts the configured primary back; both need ``Authorization: Bearer <token>``
  (``NPU_SHADOW_ROLLBACK_TOKEN``, checked before any body is read), and ``X-NPU-Shadow-By`` says who asks
  (recorded, as printable ASCII). ``GET /status`` says only whether it is thrown, when, and by which kind of source
  (``file`` or ``http``). Anything else (another path or method, no token, a wrong one, a bad ``Content-Length``) is
  refused and counted in :attr:`RollbackSwitch.refused`; refusals are logged at most once a minute. At most
  :data:`MAX_CONNECTIONS` connections are served at once, each for at most :data:`REQUEST_SECONDS`.

The switch only ever turns toward legacy on its own; the unsampled path of the wrappers pays nothing for it (the
primary is a closure cell the flip rebinds).
"""

from __future__ import annotations

import contextlib
import hmac
import http.server
import json
import logging
import mmap
import os
import re
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from shadow.core.support.safe_paths import open_own_file

log = logging.getLogger("shadow")

POLL_SECONDS = 0.2
MAX_BODY = 4096
MAX_CONNECTIONS = 32
REQUEST_SECONDS = 10.0
#: The least time between two log lines about refused requests (the others are counted, and said in the next).
REFUSAL_LOG_SECONDS = 60.0
_UNSAFE = re.compile(r"[^\x20-\x7e]")


def printable(text: str, limit: int = 200) -> str:
    """Text from the network fit for a log line, a journal and a report: printable ASCII only, at most ``limit``."""
    return _UNSAFE.sub("?", text)[:limit]


def own_first_line(path: str) -> str | None:
    """The first line (printable, at most 200 characters) of the file at ``path`` where it is a regular file of
    this user's own that no one else can write; None where there is none or it is anything else (never followed,
    never waited on). Raises nothing."""
    try:
        fd = open_own_file(path, os.O_RDONLY)
    except OSError:
        return None
    with os.fdopen(fd, errors="replace") as handle:
        return printable(handle.readline(200).strip())


class _BoundedServer(http.server.ThreadingHTTPServer):
    """A threading server that serves at most MAX_CONNECTIONS connections at once. When every slot is taken, the
    connection that has waited longest without showing its token is closed to make worker: idle clients without a
    token can never keep an authorised one out. A handler's failure (a malformed request) is counted through
    ``on_error``, never printed on the job's stderr."""

    daemon_threads = True
    #: The kernel's listen queue: connections wait there while the accept loop makes room (up to a second each).
    #: socketserver's 5 filled under a flood of idle clients, and an authorised client's handshake was dropped and
    #: retried a second later, again and again.
    request_queue_size = 4 * MAX_CONNECTIONS

    def __init__(self, *args: Any, on_error: Callable[[], None] | None = None, **kwargs: Any) -> None:
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._waiting: dict[Any, float] = {}  # connections not yet past their token, by when they came
        self._waiting_lock = threading.Lock()
        self._on_error = on_error
        self.turned_away = 0
        self.evicted = 0
        super().__init__(*args, **kwargs)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            with self._waiting_lock:
                oldest = min(self._waiting, key=self._waiting.__getitem__, default=None)
                if oldest is not None:
                    del self._waiting[oldest]
            if oldest is not None:
                self.evicted += 1
                with contextlib.suppress(OSError):
                    oldest.shutdown(socket.SHUT_RDWR)  # (its handler sees the end of its stream and leaves)
            if not self._slots.acquire(timeout=1.0):
                self.turned_away += 1
                self.shutdown_request(request)
                return
        with self._waiting_lock:
            self._waiting[request] = time.monotonic()
        super().process_request(request, client_address)

    def authorised(self, request: Any) -> None:
        """``request``'s connection showed the token: it is never closed to make worker."""
        with self._waiting_lock:
            self._waiting.pop(request, None)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.authorised(request)
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        if self._on_error is not None:
            self._on_error()


class SharedRollback:
    """A page of memory shared with every process forked after it was made (a DataLoader's workers): who threw the
    rollback, or nothing. A forked child has none of its parent's threads, so no file watcher and no endpoint: it
    polls this page instead (:meth:`watch_in_child`), and a rollback thrown in the parent reaches it within
    :data:`POLL_SECONDS`."""

    SIZE = 256

    def __init__(self) -> None:
        self._page = mmap.mmap(-1, self.SIZE)  # (anonymous and MAP_SHARED: a forked child sees the parent's writes)

    def set(self, by: str) -> None:
        data = by.encode("ascii", "replace")[: self.SIZE - 1]
        self._page[0] = 0
        self._page[1 : 1 + len(data)] = data
        self._page[0] = len(data) or 1  # (the length last: a reader never sees half of it)

    def clear(self) -> None:
        self._page[0] = 0

    def read(self) -> str | None:
        length = self._page[0]
        return self._page[1 : 1 + length].decode("ascii", "replace") if length else None

    def watch_in_child(self, roll_back: Callable[[str], Any], thrown: Callable[[], bool]) -> None:
        """In a forked child: a daemon thread that calls ``roll_back(by)`` once the page says a rollback was
        thrown and ``thrown()`` says this process has not had it yet."""

        def poll() -> None:
            while True:
                by = self.read()
                if by is not None and not thrown():
                    roll_back(by)
                time.sleep(POLL_SECONDS)

        threading.Thread(target=poll, name="npu-shadow-rollback-inherited", daemon=True).start()


class RollbackSwitch:
    """Watches a file and/or serves an endpoint; calls ``roll_back(by)`` (and ``reset(by)``) when asked."""

    def __init__(
        self,
        roll_back: Callable[[str], Any],
        reset: Callable[[str], Any],
        file: str | None = None,
        port: int | None = None,
        addr: str = "127.0.0.1",
        token: str | None = None,
    ) -> None:
        if port is not None and not token:
            raise ValueError("the rollback endpoint needs a token (NPU_SHADOW_ROLLBACK_TOKEN)")
        self._roll_back, self._reset = roll_back, reset
        self.file, self.token = file, token
        self.refused = 0
        self.refused_files = 0
        self.thrown_by: str | None = None
        self.thrown_at: float | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._last_refusal_log = -REFUSAL_LOG_SECONDS
        self._unlogged = 0
        self.server: http.server.ThreadingHTTPServer | None = None
        self.port: int | None = None
        if file:
            threading.Thread(target=self._watch, name="npu-shadow-rollback-file", daemon=True).start()
        if port is not None:
            self._serve(addr, port)

    # ------------------------------------------------------------------ throwing it

    def throw(self, by: str) -> None:
        if self.thrown_by is None:
            self.thrown_by, self.thrown_at = by, time.time()
        self._roll_back(by)

    def status(self) -> dict[str, Any]:
        """What ``GET /status`` says: thrown or not, when, and by which kind of source; never who or what it read."""
        kind = None if self.thrown_by is None else self.thrown_by.partition(":")[0]
        return {"thrown": self.thrown_by is not None, "thrown_at": self.thrown_at, "source": kind}

    def _watch(self) -> None:
        refused: tuple | None = None  # (what was refused last: said once, until something else is there)
        while not self._stop.wait(POLL_SECONDS):
            if self.thrown_by is not None or not os.path.lexists(self.file):
                continue
            try:
                fd = open_own_file(self.file, os.O_RDONLY)
            except OSError as exc:
                try:
                    info = os.lstat(self.file)
                    seen = (info.st_ino, info.st_mode, info.st_uid)
                except OSError:
                    seen = None
                if seen != refused:
                    refused = seen
                    self.refused_files += 1
                    log.warning("npu-shadow: rollback file refused, not read (%s)", printable(str(exc)))
                continue
            with os.fdopen(fd, errors="replace") as handle:
                who = printable(handle.readline(200).strip())
            self.throw(f"file:{who or self.file}")

    def _refusal(self, command: str, path: str, client: str, why: str) -> None:
        """Count a refused request; log it unless another was logged within REFUSAL_LOG_SECONDS."""
        with self._lock:
            self.refused += 1
            now = time.monotonic()
            if now - self._last_refusal_log < REFUSAL_LOG_SECONDS:
                self._unlogged += 1
                return
            self._last_refusal_log, unlogged, self._unlogged = now, self._unlogged, 0
        more = f" ({unlogged} more refused since the last such line)" if unlogged else ""
        log.warning(
            "npu-shadow: rollback endpoint refused %s %s from %s: %s%s",
            printable(command, 20), printable(path, 100), client, why, more,
        )  # fmt: skip

    def _serve(self, addr: str, port: int) -> None:
        switch = self

        class Handler(http.server.BaseHTTPRequestHandler):
            timeout = REQUEST_SECONDS  # (a client that sends nothing holds its connection this long, no longer)

            def log_message(self, format: str, *args: Any) -> None:  # (the job's stderr is not ours)
                pass

            def _answer(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.send_header("Connection", "close")
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                self.close_connection = True

            def _refuse(self, code: int, why: str) -> None:
                switch._refusal(self.command or "?", self.path or "?", self.client_address[0], why)
                self._answer(code, {"refused": why})

            def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
                # (http.server's own refusals: a malformed request line, an unknown method, headers too long)
                self._refuse(code, printable(message or "bad request", 100))

            def parse_request(self) -> bool:
                if not super().parse_request():
                    return False
                if self.command not in ("GET", "POST"):
                    self._refuse(405, "method not allowed")
                    return False
                return True

            def do_GET(self) -> None:
                if self.path == "/status":
                    self._answer(200, switch.status())
                else:
                    self._refuse(404, "no such endpoint")

            def do_POST(self) -> None:
                given = self.headers.get("Authorization", "")
                if not hmac.compare_digest(given.encode(errors="replace"), f"Bearer {switch.token}".encode()):
                    return self._refuse(403, "missing or wrong token")
                if switch.server is not None:
                    switch.server.authorised(self.request)
                try:
                    length = int(self.headers.get("Content-Length") or 0)
                except ValueError:
                    return self._refuse(400, "bad Content-Length")
                if not 0 <= length <= MAX_BODY:
                    return self._refuse(413 if length > MAX_BODY else 400, "bad Content-Length")
                self.rfile.read(length)
                by = "http:" + printable(self.headers.get("X-NPU-Shadow-By") or self.client_address[0])
                if self.path == "/rollback":
                    switch.throw(by)
                    self._answer(200, {"rolled_back": True})
                elif self.path == "/reset":
                    switch.thrown_by = switch.thrown_at = None
                    switch._reset(by)
                    self._answer(200, {"reset": True})
                else:
                    self._refuse(404, "no such endpoint")

        def failed() -> None:
            switch._refusal("?", "?", "?", "a request that broke off or could not be read")

        try:
            self.server = _BoundedServer((addr, port), Handler, on_error=failed)
        except (OSError, OverflowError) as exc:  # the launcher decides what a canary does without its switch
            log.warning("npu-shadow: cannot serve the rollback endpoint on %s:%s (%s)", addr, port, exc)
            return
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, name="npu-shadow-rollback-http", daemon=True).start()

    def close(self) -> None:
        self._stop.set()
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None
