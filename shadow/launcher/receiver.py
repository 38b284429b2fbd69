"""``npu-shadow receiver``: an Alertmanager webhook receiver that throws the rollback switch of the job an alert names.

Alertmanager posts its notifications (``/alerts``, webhook format version 4) with a bearer token
(``NPU_SHADOW_RECEIVER_TOKEN``; the shipped ``alertmanager.yml`` sends it through the webhook's ``http_config``);
for each *firing* alert whose ``action`` label is ``rollback`` (the shipped rules set it on the hard-mismatch and
fast-burn alerts), the receiver looks up the alert's ``job`` label among its ``--switch JOB=URL`` mappings and
posts ``URL/rollback`` with the jobs' token (``NPU_SHADOW_ROLLBACK_TOKEN``) and
``X-NPU-Shadow-By: alertmanager:<alertname>``. The switches of one notification are thrown in parallel, each with
its own deadline: a slow job never delays another; each switch once per notification, however many of its
alerts name it. Where a switch was not thrown (unreached, or it refused), the receiver answers 502, so that
Alertmanager sends the notification again. Only toward legacy: a resolved alert changes nothing (a person
resets the switch). Each flip, and each rollback alert naming a job it has no switch for, is printed as one JSON
line on stdout.
"""

from __future__ import annotations

import contextlib
import hmac
import http.server
import ipaddress
import json
import re
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any

MAX_BODY = 1 << 20
#: How long one switch may take to answer (connecting, sending, its whole answer) before it counts as unreached.
THROW_SECONDS = 5.0
#: How long a client may take to send one request to the receiver.
REQUEST_SECONDS = 10.0
_UNSAFE = re.compile(r"[^\x20-\x7e]")


def header_text(text: str, limit: int = 200) -> str:
    """``text`` fit for an HTTP header value and a log line: printable ASCII only (anything else, CR and LF among
    it, as ``?``), at most ``limit`` characters."""
    return _UNSAFE.sub("?", text)[:limit]


def flips(notification: Mapping[str, Any], switches: Mapping[str, Sequence[str]]) -> list[tuple[str, str, str]]:
    """(job, switch URL or "" where the job has none, alert name) for each firing rollback alert of an
    Alertmanager notification. Raises ValueError for a notification of the wrong shape."""
    alerts = notification.get("alerts")
    if not isinstance(alerts, list) or not all(isinstance(a, dict) for a in alerts):
        raise ValueError("'alerts' must be a list of objects")
    found = []
    for alert in alerts:
        labels = alert.get("labels", {})
        if not isinstance(labels, dict):
            raise ValueError("an alert's 'labels' must be an object")
        if alert.get("status") != "firing" or labels.get("action") != "rollback":
            continue
        job, name = str(labels.get("job", "")), header_text(str(labels.get("alertname", "alert")))
        for url in switches.get(job, ()) or ("",):
            found.append((job, url, name))
    return found


def one_per_switch(found: Sequence[tuple[str, str, str]]) -> list[tuple[str, str, str]]:
    """``found`` (see :func:`flips`) with each switch once, named after the first alert that asked for it (a
    notification of 64 alerts over 8 jobs posts 8 times); a job without a switch once too."""
    seen: set[tuple[str, str]] = set()
    kept = []
    for job, url, name in found:
        key = (job, url) if not url else ("", url)
        if key not in seen:
            seen.add(key)
            kept.append((job, url, name))
    return kept


def throw(url: str, token: str, by: str, timeout: float = THROW_SECONDS) -> int:
    """POST ``url``/rollback; the HTTP status (0 when the job's switch could not be reached)."""
    request = urllib.request.Request(url.rstrip("/") + "/rollback", data=b"{}", method="POST")
    request.add_header("Authorization", f"Bearer {token}")
    request.add_header("X-NPU-Shadow-By", header_text(by))
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (OSError, ValueError):
        return 0


def throw_all(found: Sequence[tuple[str, str, str]], token: str, deadline: float = THROW_SECONDS) -> list[int]:
    """Throw every switch at once; each status, 0 for a switch that did not answer within ``deadline`` seconds
    (however slowly it drips its answer: its thread is left behind, the others are not held)."""
    statuses = [0] * len(found)

    def one(index: int, url: str, alertname: str) -> None:
        statuses[index] = throw(url, token, f"alertmanager:{alertname}", timeout=deadline)

    threads = [
        threading.Thread(target=one, args=(i, url, name), daemon=True) for i, (_, url, name) in enumerate(found) if url
    ]
    for thread in threads:
        thread.start()
    end = time.monotonic() + deadline
    for thread in threads:
        thread.join(max(0.0, end - time.monotonic()))
    return list(statuses)


def serve(
    addr: str, port: int, switches: Mapping[str, Sequence[str]], token: str, receiver_token: str
) -> http.server.HTTPServer:
    """A server (not yet serving: call ``serve_forever``) that receives Alertmanager's webhooks."""

    class Handler(http.server.BaseHTTPRequestHandler):
        timeout = REQUEST_SECONDS  # (a client that sends nothing holds a thread this long, no longer)

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def _answer(self, status: int) -> None:
            self.send_response(status)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def do_GET(self) -> None:
            self._answer(200 if self.path == "/-/ready" else 404)

        def do_POST(self) -> None:
            if self.path != "/alerts":
                return self._answer(404)
            given = self.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(errors="replace"), f"Bearer {receiver_token}".encode()):
                return self._answer(403)  # (checked before any body is read)
            try:
                length = int(self.headers.get("Content-Length", ""))
            except ValueError:
                return self._answer(400)
            if not 0 <= length <= MAX_BODY:
                return self._answer(413 if length > MAX_BODY else 400)
            try:
                notification = json.loads(self.rfile.read(length))
                if not isinstance(notification, dict):
                    raise ValueError("a notification is an object")
                found = flips(notification, switches)
            except (ValueError, UnicodeDecodeError, RecursionError):
                return self._answer(400)
            found = one_per_switch(found)
            statuses = throw_all(found, token)
            for (job, url, alertname), status in zip(found, statuses, strict=True):
                line = {"time": time.time(), "job": job, "alert": alertname}
                line |= {"switch": url, "status": status} if url else {"switch": None, "note": "no --switch for it"}
                print(json.dumps(line), flush=True)
            # (a switch not thrown: 502, so that Alertmanager sends the notification again)
            thrown = all(200 <= status < 300 for (_, url, _), status in zip(found, statuses) if url)
            self._answer(200 if thrown else 502)

    server = http.server.ThreadingHTTPServer((addr, port), Handler)
    server.daemon_threads = True
    return server


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def main(
    listen: str, switch_args: Sequence[str], token: str | None, receiver_token: str | None, anywhere: bool = False
) -> int:
    """Check the settings (exit 2 with a message naming the one that is wrong), then receive until interrupted."""
    from shadow.launcher.setting_values import TOKEN_RULE, token_problem

    for name, value in (("NPU_SHADOW_ROLLBACK_TOKEN", token), ("NPU_SHADOW_RECEIVER_TOKEN", receiver_token)):
        problem = "is not set" if not value else token_problem(value)
        if problem:
            print(f"npu-shadow receiver: {name} {problem} ({TOKEN_RULE})", file=sys.stderr)
            return 2
    if not switch_args:
        print("npu-shadow receiver: no --switch JOB=URL given: there would be no job to roll back", file=sys.stderr)
        return 2
    switches: dict[str, list[str]] = {}
    for item in switch_args:
        job, _, url = item.partition("=")
        if not job or not re.fullmatch(r"https?://[^\s/]+(/\S*)?", url):
            print(f"npu-shadow receiver: --switch {item!r}: expected JOB=http://HOST:PORT", file=sys.stderr)
            return 2
        switches.setdefault(job, []).append(url)
    host, _, port_text = listen.rpartition(":")
    host = host or "127.0.0.1"
    if not (port_text.isascii() and port_text.isdigit() and int(port_text) <= 65535):
        print(f"npu-shadow receiver: --listen {listen!r}: expected HOST:PORT with a port in 0..65535", file=sys.stderr)
        return 2
    if not _loopback(host) and not anywhere:
        print(
            f"npu-shadow receiver: --listen {listen!r} is not a loopback address: anyone who reaches it could ask "
            "for rollbacks (the token aside); give --listen-anywhere to mean it",
            file=sys.stderr,
        )
        return 2
    try:
        server = serve(host.strip("[]"), int(port_text), switches, token, receiver_token)
    except (OSError, ValueError, OverflowError) as exc:
        print(f"npu-shadow receiver: cannot listen on {listen}: {exc}", file=sys.stderr)
        return 2
    print(
        f"npu-shadow receiver: listening on http://{listen}/alerts for {sorted(switches)}", file=sys.stderr, flush=True
    )
    with contextlib.suppress(KeyboardInterrupt):
        server.serve_forever()
    return 0
