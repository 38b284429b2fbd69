"""``npu-shadow receiver``: an Alertmanager webhook receiver that throws the rollback switch of the job an alert names.

Alertmanager posts its notifications (``/alerts``, webhook format version 4); for each *firing* alert whose
``action`` label is ``rollback`` (the shipped rules set it on the hard-mismatch and fast-burn alerts), the receiver
looks up the alert's ``job`` label among its ``--switch JOB=URL`` mappings and posts ``URL/rollback`` with the
token (``NPU_SHADOW_ROLLBACK_TOKEN``) and ``X-NPU-Shadow-By: alertmanager:<alertname>``. Only toward legacy: a
resolved alert changes nothing (a person resets the switch). Each flip is printed as one JSON line on stdout.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any

MAX_BODY = 1 << 20


def flips(notification: Mapping[str, Any], switches: Mapping[str, Sequence[str]]) -> list[tuple[str, str, str]]:
    """(job, switch URL, alert name) for each firing rollback alert of an Alertmanager notification."""
    found = []
    for alert in notification.get("alerts", []):
        labels = alert.get("labels", {})
        if alert.get("status") != "firing" or labels.get("action") != "rollback":
            continue
        for url in switches.get(labels.get("job", ""), ()):
            found.append((labels.get("job", ""), url, str(labels.get("alertname", "alert"))))
    return found


def throw(url: str, token: str, by: str, timeout: float = 10.0) -> int:
    """POST ``url``/rollback; the HTTP status (0 when the job's switch could not be reached)."""
    request = urllib.request.Request(url.rstrip("/") + "/rollback", data=b"{}", method="POST")
    request.add_header("Authorization", f"Bearer {token}")
    request.add_header("X-NPU-Shadow-By", by)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


def serve(addr: str, port: int, switches: Mapping[str, Sequence[str]], token: str) -> http.server.HTTPServer:
    """A server (not yet serving: call ``serve_forever``) that receives Alertmanager's webhooks."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            pass

        def do_GET(self) -> None:
            self.send_response(200 if self.path == "/-/ready" else 404)
            self.end_headers()

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            if self.path != "/alerts" or length > MAX_BODY:
                self.send_response(404 if self.path != "/alerts" else 413)
                self.end_headers()
                return
            try:
                notification = json.loads(self.rfile.read(length))
            except ValueError:
                self.send_response(400)
                self.end_headers()
                return
            for job, url, alertname in flips(notification if isinstance(notification, dict) else {}, switches):
                status = throw(url, token, f"alertmanager:{alertname}")
                line = {"time": time.time(), "job": job, "switch": url, "alert": alertname, "status": status}
                print(json.dumps(line), flush=True)
            self.send_response(200)
            self.end_headers()

    server = http.server.ThreadingHTTPServer((addr, port), Handler)
    server.daemon_threads = True
    return server


def main(listen: str, switch_args: Sequence[str], token: str | None) -> int:
    if not token:
        print("npu-shadow receiver: NPU_SHADOW_ROLLBACK_TOKEN is not set", file=sys.stderr)
        return 2
    switches: dict[str, list[str]] = {}
    for item in switch_args:
        job, _, url = item.partition("=")
        if not job or not url.startswith(("http://", "https://")):
            print(f"npu-shadow receiver: --switch {item!r}: expected JOB=http://HOST:PORT", file=sys.stderr)
            return 2
        switches.setdefault(job, []).append(url)
    addr, _, port = listen.rpartition(":")
    try:
        server = serve(addr or "127.0.0.1", int(port), switches, token)
    except (OSError, ValueError) as exc:
        print(f"npu-shadow receiver: cannot listen on {listen}: {exc}", file=sys.stderr)
        return 2
    print(
        f"npu-shadow receiver: listening on http://{listen}/alerts for {sorted(switches)}", file=sys.stderr, flush=True
    )
    with contextlib.suppress(KeyboardInterrupt):
        server.serve_forever()
    return 0
