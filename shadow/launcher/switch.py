"""The rollback switch of a running canary job: a file, and/or a loopback HTTP endpoint, that make legacy the
primary from the next call on, without a restart.

- **File** (``--rollback-file PATH``): a thread looks for the file every :data:`POLL_SECONDS`; when it appears the
  switch is thrown, by ``file:<its first line, or its path>``. The file stays the record; deleting it resets
  nothing (only a person's reset over HTTP does).
- **HTTP** (``--rollback-port PORT``, 127.0.0.1 unless ``--rollback-addr``): ``POST /rollback`` throws the switch,
  ``POST /reset`` puts the configured primary back; both need ``Authorization: Bearer <token>``
  (``NPU_SHADOW_ROLLBACK_TOKEN``), and ``X-NPU-Shadow-By`` says who asks (recorded). Anything else (another path or
  method, no token, a wrong one) is refused and counted in :attr:`RollbackSwitch.refused`.

The switch only ever turns toward legacy on its own; the unsampled path of the wrappers pays nothing for it (the
primary is a closure cell the flip rebinds).
"""

from __future__ import annotations

import hmac
import http.server
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("shadow")

POLL_SECONDS = 0.2
MAX_BODY = 4096


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
        self.thrown_by: str | None = None
        self.thrown_at: float | None = None
        self._stop = threading.Event()
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

    def _watch(self) -> None:
        while not self._stop.wait(POLL_SECONDS):
            if self.thrown_by is None and os.path.exists(self.file):
                try:
                    with open(self.file, errors="replace") as handle:
                        who = handle.readline(200).strip()
                except OSError:
                    who = ""
                self.throw(f"file:{who or self.file}")

    def _serve(self, addr: str, port: int) -> None:
        switch = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:  # (the job's stderr is not ours)
                log.debug("npu-shadow rollback endpoint: " + format, *args)

            def _answer(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _refuse(self, code: int, why: str) -> None:
                switch.refused += 1
                log.warning("npu-shadow: rollback endpoint refused %s %s from %s: %s", self.command, self.path,
                            self.client_address[0], why)  # fmt: skip
                self._answer(code, {"refused": why})

            def do_GET(self) -> None:
                if self.path == "/status":
                    self._answer(200, {"thrown_by": switch.thrown_by, "thrown_at": switch.thrown_at})
                else:
                    self._refuse(404, "no such endpoint")

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                if length > MAX_BODY:
                    return self._refuse(413, "body too large")
                self.rfile.read(length)
                given = self.headers.get("Authorization", "")
                if not hmac.compare_digest(given.encode(), f"Bearer {switch.token}".encode()):
                    return self._refuse(403, "missing or wrong token")
                by = "http:" + (self.headers.get("X-NPU-Shadow-By") or self.client_address[0])[:200]
                if self.path == "/rollback":
                    switch.throw(by)
                    self._answer(200, {"rolled_back": True, "by": switch.thrown_by})
                elif self.path == "/reset":
                    switch.thrown_by = switch.thrown_at = None
                    switch._reset(by)
                    self._answer(200, {"reset": True, "by": by})
                else:
                    self._refuse(404, "no such endpoint")

            def do_PUT(self) -> None:
                self._refuse(405, "method not allowed")

            do_DELETE = do_PATCH = do_PUT

        try:
            self.server = http.server.ThreadingHTTPServer((addr, port), Handler)
        except (OSError, OverflowError) as exc:  # a busy port degrades the switch, never the job
            log.warning("npu-shadow: cannot serve the rollback endpoint on %s:%s (%s); the file switch still works",
                        addr, port, exc)  # fmt: skip
            return
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, name="npu-shadow-rollback-http", daemon=True).start()

    def close(self) -> None:
        self._stop.set()
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None
