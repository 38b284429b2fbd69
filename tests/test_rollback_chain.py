"""The rollback chain holds under attack and faults: the switch, the receiver, the push, the launcher and the
job's own thread. Each test names the point of the issue it covers ("rollback chain" 1-18)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def npu_shadow(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "shadow", *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env
    )


@pytest.mark.parametrize("signal_name, code", [("PIPE", 141), ("XFSZ", 153)])
def test_11_the_job_starts_with_the_default_dispositions_a_shell_gives(signal_name, code):
    """Python ignores SIGPIPE and SIGXFSZ in itself; the job it starts must not inherit that."""
    done = npu_shadow("run", "--", "sh", "-c", f"kill -{signal_name} $$; echo survived")
    assert done.returncode == code and "survived" not in done.stdout, done.stdout + done.stderr


@pytest.mark.parametrize(
    "journal, says",
    [
        ("{tmp}/sub/", "a directory, not a file"),
        ("/dev/null", "not a regular file"),
        ("/sys/kernel/npu-shadow.jsonl", "no file can be made in /sys/kernel"),
    ],
    ids=["a-directory", "dev-null", "sysfs"],
)
def test_14_a_journal_that_would_lose_every_line_is_refused_at_start_up(tmp_path, journal, says):
    env = {**os.environ, "NPU_SHADOW_JOURNAL": journal.format(tmp=tmp_path)}
    done = npu_shadow("run", "--", sys.executable, "-c", "print('the job ran')", env=env)
    assert done.returncode == 2 and "the job ran" not in done.stdout
    assert "NPU_SHADOW_JOURNAL=" in done.stderr and says in done.stderr, done.stderr


REPATCHED = """
import torch
from shadow.npu import reference
patches = reference.patch_torch()
for _ in range(100):
    torch.ones(2).type(torch.float16)
patches.undo()
reference.patch_torch()
for _ in range(100):
    torch.ones(2).type(torch.float16)
"""


def test_18_the_exit_summary_counts_every_install_of_the_monitor(tmp_path):
    from metrics_helpers import samples, total

    textfile = tmp_path / "metrics.prom"
    done = npu_shadow(
        "run", "--sample-rate", "1", "--budget", "off", "--textfile", str(textfile), "--",
        sys.executable, "-c", REPATCHED,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert total(samples(textfile.read_text()), "npu_shadow_calls_total", target="tensor_type") == 200
    line = next(line for line in done.stderr.splitlines() if line.startswith("tensor_type"))
    assert line.split()[1:4] == ["200", "200", "200"], done.stderr  # calls, sampled, match


# --------------------------------------------------------------------------- the receiver

JOBS_TOKEN = "jobs-token-0123456789abcdef"
RECEIVER_TOKEN = "receiver-token-0123456789abcdef"


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Switches:
    """Fake job switches on loopback: each records the rollbacks posted to it; ``drip`` answers one byte every
    ``drip`` seconds (a job that is alive but slow)."""

    def __init__(self, drip: float = 0.0):
        import http.server
        import threading

        self.posts: list[tuple[float, str]] = []
        switches = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                import time

                switches.posts.append((time.monotonic(), self.headers.get("X-NPU-Shadow-By", "")))
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if drip:  # (its answer's head, a byte at a time: a read never waits long enough to time out)
                    for byte in b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n":
                        time.sleep(drip)
                        try:
                            self.wfile.write(bytes([byte]))
                            self.wfile.flush()
                        except OSError:
                            return
                    return
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


class Receiver:
    def __init__(self, tmp_path, *switches: str, env: dict | None = None):
        import time
        import urllib.request

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "NPU_SHADOW_ROLLBACK_TOKEN": JOBS_TOKEN, "NPU_SHADOW_RECEIVER_TOKEN": RECEIVER_TOKEN}
        self.log = open(tmp_path / f"receiver-{self.port}.log", "w+")  # noqa: SIM115 (open while it runs)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "shadow", "receiver", f"--listen=127.0.0.1:{self.port}", *switches],
            cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        while self.process.poll() is None:  # (ready: it answers)
            try:
                urllib.request.urlopen(f"{self.url}/-/ready", timeout=5).close()
                return
            except OSError:
                time.sleep(0.1)
        raise AssertionError(pathlib.Path(self.log.name).read_text())

    def post(self, body: bytes, token: str | None = RECEIVER_TOKEN, headers: dict | None = None) -> int:
        import urllib.error
        import urllib.request

        request = urllib.request.Request(f"{self.url}/alerts", data=body, method="POST", headers=headers or {})
        if token is not None:
            request.add_header("Authorization", f"Bearer {token}")
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return response.status
        except urllib.error.HTTPError as exc:
            return exc.code

    def lines(self) -> list[dict]:
        import json

        return [json.loads(x) for x in pathlib.Path(self.log.name).read_text().splitlines() if x[:1] == "{"]

    def close(self):
        self.process.terminate()
        self.process.wait(30)
        self.log.close()


def notification(*alerts: tuple[str, str]) -> bytes:
    import json

    return json.dumps(
        {
            "version": "4",
            "status": "firing",
            "alerts": [
                {"status": "firing", "labels": {"alertname": name, "job": job, "action": "rollback"}}
                for job, name in alerts
            ],
        }
    ).encode()


@pytest.mark.parametrize("alertname", ["Ünïcode ☃ alert", "Injected\r\nX-Evil: 1", "\x1b[31mred"])
def test_7_every_firing_rollback_alert_throws_its_switch_whatever_its_labels_hold(tmp_path, alertname):
    switches = Switches()
    receiver = Receiver(tmp_path, f"--switch=a={switches.url}", f"--switch=b={switches.url}")
    try:
        assert receiver.post(notification(("a", alertname), ("b", alertname))) == 200
    finally:
        receiver.close()
        switches.close()
    assert len(switches.posts) == 2
    assert all(by.startswith("alertmanager:") and by.isascii() and by.isprintable() for _, by in switches.posts)
    assert [line["status"] for line in receiver.lines()] == [200, 200]


def test_8_a_slow_switch_never_delays_another(tmp_path):
    import time

    slow, fast = Switches(drip=0.5), Switches()
    receiver = Receiver(tmp_path, f"--switch=slow={slow.url}", f"--switch=fast={fast.url}")
    try:
        posted = time.monotonic()
        assert receiver.post(notification(("slow", "A"), ("fast", "A"))) == 200
        answered = time.monotonic()
    finally:
        receiver.close()
        slow.close()
        fast.close()
    ((thrown, _),) = fast.posts
    assert len(slow.posts) == 1
    # (both thrown at once: the fast one did not wait for the slow one's answer, which takes 20 s)
    assert thrown - posted < answered - posted and thrown <= slow.posts[0][0] + 5
    statuses = {line["job"]: line["status"] for line in receiver.lines()}
    assert statuses == {"slow": 0, "fast": 200}  # the slow one: not answered within its deadline


def test_9_the_receiver_refuses_what_it_must_and_answers_bad_requests_with_400(tmp_path):
    switches = Switches()
    receiver = Receiver(tmp_path, f"--switch=a={switches.url}")
    try:
        assert receiver.post(notification(("a", "A")), token=None) == 403  # not Alertmanager
        assert receiver.post(notification(("a", "A")), token=JOBS_TOKEN) == 403
        assert receiver.post(b"{not json") == 400
        assert receiver.post(b'{"alerts": "all"}') == 400
        assert receiver.post(b'{"alerts": [{"labels": 3, "status": "firing"}]}') == 400
        assert receiver.post(b"[1, 2]") == 400
        assert receiver.post(notification(("nobody", "A"))) == 200
        assert receiver.process.poll() is None  # still serving
    finally:
        receiver.close()
        switches.close()
    assert switches.posts == []
    assert receiver.lines()[-1]["job"] == "nobody" and receiver.lines()[-1]["switch"] is None


@pytest.mark.parametrize(
    "args, env, says",
    [
        (["--listen=127.0.0.1:0"], {}, "no --switch"),
        (["--listen=127.0.0.1:99999", "--switch=a=http://127.0.0.1:1"], {}, "a port in 0..65535"),
        (["--listen=0.0.0.0:0", "--switch=a=http://127.0.0.1:1"], {}, "not a loopback address"),
        (["--switch=a=http://127.0.0.1:1"], {"NPU_SHADOW_ROLLBACK_TOKEN": "short"}, "NPU_SHADOW_ROLLBACK_TOKEN is"),
        (["--switch=a=http://127.0.0.1:1"], {"NPU_SHADOW_RECEIVER_TOKEN": ""}, "NPU_SHADOW_RECEIVER_TOKEN is not"),
    ],
    ids=["no-switch", "bad-port", "non-loopback", "token-jobs-refuse", "no-receiver-token"],
)
def test_9_the_receiver_refuses_to_start_saying_why(args, env, says):
    env = {"NPU_SHADOW_ROLLBACK_TOKEN": JOBS_TOKEN, "NPU_SHADOW_RECEIVER_TOKEN": RECEIVER_TOKEN, **env}
    done = npu_shadow("receiver", *args, env={**os.environ, **env}, timeout=60)
    assert done.returncode == 2 and says in done.stderr and "Traceback" not in done.stderr, done.stderr
