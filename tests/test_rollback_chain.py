"""The rollback chain holds under attack and faults: the switch, the receiver, the push, the launcher and the
job's own thread. Each test names the point of the issue it covers ("rollback chain" 1-18)."""

from __future__ import annotations

import os
import pathlib
import re
import socket
import struct
import subprocess
import sys

import fakes
import pytest
from commands import npu_shadow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
@pytest.mark.parametrize("signal_name, code", [("PIPE", 141), ("XFSZ", 153)])
def test_the_job_starts_with_the_default_dispositions_a_shell_gives(signal_name, code):
    """Python ignores SIGPIPE and SIGXFSZ in itself; the job it starts must not inherit that."""
    done = npu_shadow("run", "--", "sh", "-c", f"kill -{signal_name} $$; echo survived")
    assert done.returncode == code and "survived" not in done.stdout, done.stdout + done.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    "journal, says",
    [
        ("{tmp}/sub/", "a directory, not a file"),
        ("/dev/null", "not a regular file"),
        ("/sys/kernel/npu-shadow.jsonl", "no file can be made in /sys/kernel"),
    ],
    ids=["a-directory", "dev-null", "sysfs"],
)
def test_a_journal_that_would_lose_every_line_is_refused_at_start_up(tmp_path, journal, says):
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


@pytest.mark.slow
def test_the_exit_summary_counts_every_install_of_the_monitor(tmp_path):
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


@pytest.mark.slow
@pytest.mark.parametrize("alertname", ["Ünïcode ☃ alert", "Injected\r\nX-Evil: 1", "\x1b[31mred"])
def test_every_firing_rollback_alert_throws_its_switch_whatever_its_labels_hold(tmp_path, alertname):
    a, b = Switches(), Switches()
    receiver = Receiver(tmp_path, f"--switch=a={a.url}", f"--switch=b={b.url}")
    try:
        assert receiver.post(notification(("a", alertname), ("b", alertname))) == 200
    finally:
        receiver.close()
        a.close()
        b.close()
    posts = a.posts + b.posts
    assert len(a.posts) == len(b.posts) == 1
    assert all(by.startswith("alertmanager:") and by.isascii() and by.isprintable() for _, by in posts)
    assert [line["status"] for line in receiver.lines()] == [200, 200]


@pytest.mark.slow
def test_a_slow_switch_never_delays_another(tmp_path):
    """A switch that drips its answer (20 s) is left behind at the receiver's deadline, and the other switch of the
    same notification is thrown and answers within it: thrown one after the other, the fast one would be thrown only
    after the slow one's 20 s, past the deadline (status 0)."""
    slow, fast = Switches(drip=0.5), Switches()
    receiver = Receiver(tmp_path, f"--switch=slow={slow.url}", f"--switch=fast={fast.url}")
    try:
        # (502: the slow switch was not thrown within its deadline, so Alertmanager sends it again)
        assert receiver.post(notification(("slow", "A"), ("fast", "A"))) == 502
    finally:
        receiver.close()
        slow.close()
        fast.close()
    assert len(fast.posts) == 1 and len(slow.posts) == 1
    statuses = {line["job"]: line["status"] for line in receiver.lines()}
    assert statuses == {"slow": 0, "fast": 200}  # the slow one: not answered within its deadline


@pytest.mark.slow
def test_the_receiver_refuses_what_it_must_and_answers_bad_requests_with_400(tmp_path):
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


@pytest.mark.slow
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
def test_the_receiver_refuses_to_start_saying_why(args, env, says):
    env = {"NPU_SHADOW_ROLLBACK_TOKEN": JOBS_TOKEN, "NPU_SHADOW_RECEIVER_TOKEN": RECEIVER_TOKEN, **env}
    done = npu_shadow("receiver", *args, env={**os.environ, **env}, timeout=60)
    assert done.returncode == 2 and says in done.stderr and "Traceback" not in done.stderr, done.stderr


# --------------------------------------------------------------------------- the switch


def _switch(**options):
    import threading

    from shadow.launcher.switch import RollbackSwitch

    thrown = threading.Event()
    seen: list[str] = []
    switch = RollbackSwitch(lambda by: (seen.append(by), thrown.set()), lambda by: None, **options)
    return switch, thrown, seen


def _get(url: str) -> tuple[int, dict]:
    import json
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


@pytest.mark.parametrize("planted", ["symlink", "other-writable", "fifo"])
def test_the_rollback_file_is_read_only_when_it_is_the_jobs_own_regular_file(tmp_path, planted):
    """A symlink to a secret, a file others could have written, a FIFO: refused and counted, never read nor waited
    on; /status never says what a file holds; a regular file of the job's own, later, still throws the switch."""
    import time

    secret = tmp_path / "secret"
    secret.write_text("API_KEY=hunter2\n")
    path = tmp_path / "rollback"
    switch, thrown, seen = _switch(file=str(path), port=0, token="t" * 24)
    try:
        if planted == "symlink":
            path.symlink_to(secret)
        elif planted == "other-writable":
            path.write_text("someone else\n")
            path.chmod(0o666)
        else:
            os.mkfifo(path)
        deadline = time.monotonic() + 30
        while switch.refused_files == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert switch.refused_files == 1 and not thrown.is_set()
        code, status = _get(f"http://127.0.0.1:{switch.port}/status")
        assert code == 200 and status == {"thrown": False, "thrown_at": None, "source": None}
        path.unlink()
        path.write_text("oncall: bob\n")  # the job's own file
        path.chmod(0o600)
        assert thrown.wait(30) and seen == ["file:oncall: bob"]
        code, status = _get(f"http://127.0.0.1:{switch.port}/status")
        assert status["thrown"] and status["source"] == "file" and "bob" not in str(status)
    finally:
        switch.close()


def _raw(port: int, data: bytes, wait: float = 10) -> bytes:
    import socket

    with socket.create_connection(("127.0.0.1", port), timeout=wait) as connection:
        connection.sendall(data)
        chunks = []
        try:
            while chunk := connection.recv(4096):
                chunks.append(chunk)
        except TimeoutError:
            pass
        return b"".join(chunks)


@pytest.mark.slow
def test_idle_connections_are_bounded_and_the_token_is_checked_before_any_body(tmp_path, monkeypatch):
    import socket
    import threading
    import time

    from shadow.launcher import switch as switch_module

    monkeypatch.setattr(switch_module, "REQUEST_SECONDS", 1.0)
    switch, thrown, _ = _switch(port=0, token="t" * 24)
    try:
        before = threading.active_count()
        idle = [socket.create_connection(("127.0.0.1", switch.port)) for _ in range(2 * switch_module.MAX_CONNECTIONS)]
        time.sleep(0.5)
        assert threading.active_count() - before <= switch_module.MAX_CONNECTIONS + 1
        deadline = time.monotonic() + 30  # idle ones are dropped after REQUEST_SECONDS
        while threading.active_count() - before > 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert threading.active_count() - before <= 1
        for connection in idle:
            connection.close()
        # a negative Content-Length without a token: refused at once, no body waited for
        answer = _raw(switch.port, b"POST /rollback HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n")
        assert answer.startswith(b"HTTP/1.0 403") or answer.startswith(b"HTTP/1.1 403"), answer[:80]
        token = b"Authorization: Bearer " + b"t" * 24 + b"\r\n"
        answer = _raw(switch.port, b"POST /rollback HTTP/1.1\r\nHost: x\r\n" + token + b"Content-Length: -1\r\n\r\n")
        assert b" 400 " in answer.split(b"\r\n")[0] and not thrown.is_set()
    finally:
        switch.close()


@pytest.mark.skipif(not hasattr(socket, "TCP_INFO"), reason="the listen queue is read through Linux's TCP_INFO")
def test_a_flood_of_idle_connections_leaves_room_in_the_listen_queue_for_an_authorised_one():
    """While the accept loop makes room for a new connection (closing the oldest idle one, waiting up to a second
    for its slot), the ones after it wait in the kernel's listen queue: at socketserver's default of 5, twice
    MAX_CONNECTIONS idle clients filled it, and an authorised client's handshake was dropped and retried a second
    later (the attack round's connections took 8 s a trial). The queue, as the kernel holds it, takes that flood
    and the authorised client."""
    from shadow.launcher.switch import MAX_CONNECTIONS

    switch, _, _ = _switch(port=0, token="t" * 24)
    try:
        info = switch.server.socket.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
        state, *_, backlog = struct.unpack_from("8B6I", info)  # (a listener: tcpi_sacked holds its queue's size)
        assert state == 10 and backlog >= 2 * MAX_CONNECTIONS + 1  # (TCP_LISTEN)
    finally:
        switch.close()


def test_every_other_method_is_refused_counted_and_logged_escaped_and_rate_limited(caplog):
    import logging

    switch, thrown, _ = _switch(port=0, token="t" * 24)
    try:
        with caplog.at_level(logging.WARNING, logger="shadow"):
            for method in (b"HEAD", b"OPTIONS", b"TRACE", b"CONNECT", b"BREW", b"DELETE"):
                answer = _raw(switch.port, method + b" /rollback HTTP/1.1\r\nHost: x\r\n\r\n")
                assert b" 405 " in answer.split(b"\r\n")[0], (method, answer[:80])
            for _ in range(50):
                _raw(switch.port, b"GET /\x1b[31mred\x07 HTTP/1.1\r\nHost: x\r\n\r\n")
        assert switch.refused == 56 and not thrown.is_set()
        lines = [r.getMessage() for r in caplog.records if "rollback endpoint refused" in r.getMessage()]
        assert len(lines) == 1  # one a minute, the rest counted
        assert all(line.isprintable() and "\x1b" not in line for line in lines)
    finally:
        switch.close()


SPAWNS_AFTER_ROLLBACK = """
import os, sys, urllib.request, multiprocessing as mp
import torch


def worker(queue):
    from shadow.launcher.launch import LAUNCHER

    torch.ones(2).type(torch.float16)
    queue.put(LAUNCHER.monitor.stats()["tensor_type"].primary)


if __name__ == "__main__":
    request = urllib.request.Request(
        f"http://127.0.0.1:{sys.argv[1]}/rollback", data=b"{}", method="POST",
        headers={"Authorization": "Bearer " + os.environ["NPU_SHADOW_ROLLBACK_TOKEN"]},
    )
    urllib.request.urlopen(request, timeout=30).read()
    for method in ("spawn", "forkserver", "fork"):
        context = mp.get_context(method)
        queue = context.Queue()
        process = context.Process(target=worker, args=(queue,))
        process.start()
        print(method, queue.get(timeout=120), flush=True)
        process.join()
"""


@pytest.mark.slow
def test_a_rollback_reaches_every_process_started_after_it_whatever_the_start_method(tmp_path):
    job = tmp_path / "job.py"
    job.write_text(SPAWNS_AFTER_ROLLBACK)
    port = free_port()
    done = npu_shadow(
        "run", "--legacy-from", "reference", "--primary", "upstream", "--rollback-port", str(port), "--",
        sys.executable, str(job), str(port), env={**os.environ, "NPU_SHADOW_ROLLBACK_TOKEN": JOBS_TOKEN},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:3] == ["spawn legacy", "forkserver legacy", "fork legacy"], done.stdout


# --------------------------------------------------------------------------- the push, the launcher, the job


@pytest.mark.slow
def test_the_exit_push_has_one_deadline_then_the_textfile_and_exit(tmp_path):
    """A gateway that drips its answer a byte at a time never trips a socket timeout: the push as a whole is given
    up on at its deadline, and the textfile is still written."""
    import socket
    import threading

    from metrics_helpers import samples, total

    gateway = socket.socket()
    gateway.bind(("127.0.0.1", 0))
    gateway.listen()
    stop = threading.Event()

    def drip():
        connection, _ = gateway.accept()
        with connection:
            for byte in b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n" * 100:
                if stop.wait(0.5):
                    return
                try:
                    connection.sendall(bytes([byte]))
                except OSError:
                    return

    threading.Thread(target=drip, daemon=True).start()
    textfile = tmp_path / "metrics.prom"
    script = (
        "import torch\nfrom shadow.npu import reference\nreference.patch_torch()\ntorch.ones(2).type(torch.float16)\n"
    )
    try:
        done = npu_shadow(
            "run", "--sample-rate", "1", "--budget", "off", "--pushgateway", f"127.0.0.1:{gateway.getsockname()[1]}",
            "--textfile", str(textfile), "--", sys.executable, "-c", script,
        )  # fmt: skip
    finally:
        stop.set()
        gateway.close()
    assert done.returncode == 0, done.stderr
    # (given up at its deadline, the documented 3 s, not at the end of the gateway's answer: what the job says it did)
    assert re.search(r"push to \S+ failed after [0-9.]+ s: not finished within its 3 s deadline",
                     done.stderr), done.stderr  # fmt: skip
    assert total(samples(textfile.read_text()), "npu_shadow_calls_total", target="tensor_type") == 1


def _interrupt_points(code, cache={}):  # noqa: B006 (a cache by code object)
    """The offsets where CPython 3.11+ can raise a pending KeyboardInterrupt in ``code`` (its eval breaker's
    checks): a function's start (RESUME), a loop's backward jump, and each call (raised there as if the call
    had been interrupted: the exception belongs to the call's offset, inside whatever try covers it)."""
    import dis

    if code not in cache:
        names = ("RESUME", "JUMP_BACKWARD", "CALL", "CALL_FUNCTION_EX")
        instructions = list(dis.get_instructions(code))
        points = set()
        for j, instruction in enumerate(instructions):
            before = [(i.opname, i.argval) for i in instructions[max(0, j - 4) : j] if i.opname != "PRECALL"]
            if instruction.opname == "CALL" and before[-3:] == [("LOAD_CONST", None)] * 3:
                continue  # (a with block's __exit__: the interrupt lands inside the block, at its last call)
            if instruction.opname in names:
                points.add(instruction.offset)
        cache[code] = points
    return cache[code]


def test_no_interrupt_at_any_point_leaves_the_caller_on_the_shadow_side():
    """Ctrl-C raised at each point of a sampled call where CPython can raise it (every eval-breaker check in
    npu-shadow's own code, one run each); after every one, a call returns legacy's result and is counted, and no
    thread is left marked as an upstream side."""
    import sys
    import types

    import torch

    import shadow
    from shadow.core.runs import sides

    here = os.path.dirname(sides.__file__)
    ops = types.SimpleNamespace(op=lambda x: x * 2)
    target = shadow.Target("op", ops, "op", lambda x: x * 3)

    def interrupted_at(k: int) -> bool:
        """Run one sampled call raising KeyboardInterrupt at its k-th interrupt point; whether it got there."""
        seen = 0

        def opcodes(frame, event, arg):
            nonlocal seen
            if event == "opcode" and frame.f_lasti in _interrupt_points(frame.f_code):
                seen += 1
                if seen == k:
                    where.append(f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}")
                    raise KeyboardInterrupt
            return opcodes

        def calls(frame, event, arg):
            if frame.f_code.co_filename.startswith(here):
                frame.f_trace_opcodes = True
                return opcodes
            return None

        sys.settrace(calls)
        try:
            ops.op(torch.ones(2))
        except KeyboardInterrupt:
            pass
        finally:
            sys.settrace(None)
        return seen >= k

    where: list[str] = []
    with shadow.install([target], sample_rate=1.0, budget=None) as monitor:
        k = 0
        while interrupted_at(k := k + 1):
            calls = monitor.stats()["op"].calls
            assert ops.op(torch.ones(2)).tolist() == [2.0, 2.0], f"interrupted at {where[-1]}: upstream's result after"
            assert monitor.stats()["op"].calls == calls + 1, f"interrupted at {where[-1]}: a call not counted after"
            assert getattr(sides.marks, "shadow_side", None) is None and not sides.shadow_runs, where[-1]
    assert k > 100  # (every point of a sampled call was tried)


# --------------------------------------------------------------------------- pytest-xdist

XDIST_SUITE = """
import os
import pytest
import torch


def test_casts():
    assert torch.arange(4.0).type(torch.float16).dtype == torch.float16


def test_crashes_its_worker():
    torch.ones(2).type(torch.float16)
    if os.environ.get("CRASH_A_WORKER"):
        os._exit(3)
"""

TAMPERING_CONFTEST = """
import pytest


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session):
    output = getattr(session.config, "workeroutput", None)
    if output is not None and "npu_shadow" in output:
        output["npu_shadow"] = {"stats": {"tensor_type": {"calls": -5, "compared": "x"}}, "divergences": [1]}
"""


def _xdist(tmp_path, *options, env=None):
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-n", "2", "--npu-shadow",
         "--npu-shadow-legacy=reference", f"--npu-shadow-journal={tmp_path / 'j.jsonl'}", *options],
        cwd=tmp_path, capture_output=True, text=True, timeout=600, env={**os.environ, **(env or {})},
    )  # fmt: skip
    return done.returncode, done.stdout + done.stderr


@pytest.mark.slow
def test_malformed_worker_counts_are_refused_and_said_never_crash_the_summary(tmp_path):
    (tmp_path / "test_suite.py").write_text(XDIST_SUITE)
    (tmp_path / "conftest.py").write_text(TAMPERING_CONFTEST)
    code, output = _xdist(tmp_path)
    assert code == 0, output  # every test passed: so does the run
    summary = output.split("= npu-shadow =")[1]
    assert summary.count("missing from this summary: xdist worker gw") == 2, summary
    assert "its evidence was refused" in summary and "INTERNALERROR" not in output


@pytest.mark.slow
def test_a_crashed_workers_calls_are_said_to_be_missing(tmp_path):
    (tmp_path / "test_suite.py").write_text(XDIST_SUITE)
    code, output = _xdist(tmp_path, env={"CRASH_A_WORKER": "1"})
    assert code == 1, output  # (the crashed test fails; xdist replaced the worker)
    summary = output.split("= npu-shadow =")[1]
    assert "missing from this summary: xdist worker gw" in summary and "ended without reporting" in summary, summary


ESCAPING_CONFTEST = """
import pytest


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session):
    output = getattr(session.config, "workeroutput", None)
    if output is not None and "npu_shadow" in output and session.config.workerinput["workerid"] == "gw0":
        output["npu_shadow"] = {"stats": {"tensor_type\\x1b[2J": {"calls": 1}}, "divergences": []}
    elif output is not None and "npu_shadow" in output:
        output["npu_shadow"]["divergences"] = [("t\\x1b[31m", "call", "tensor_type mismatch: \\x1b]0;owned\\x07")]
"""


@pytest.mark.slow
def test_a_workers_names_and_texts_reach_the_terminal_without_control_characters(tmp_path):
    """A worker's target name with an ESC is refused (no Target may have one), said with the ESC escaped; the
    control characters of its divergences' texts reach the terminal as '?'."""
    (tmp_path / "test_suite.py").write_text(XDIST_SUITE)
    (tmp_path / "conftest.py").write_text(ESCAPING_CONFTEST)
    code, output = _xdist(tmp_path)
    assert code == 0, output  # (every test passed; a refused worker is said, not a failure)
    summary = output.split("= npu-shadow =")[1]
    assert "\x1b" not in summary and "\x07" not in summary, ascii(summary)
    assert "is no target name" in summary and "\\x1b[2J" in summary, summary
    assert "diverged: t?[31m (call): tensor_type mismatch: ?]0;owned?" in summary, summary


# --------------------------------------------------------------------------- OpenTelemetry


def test_one_collection_records_a_bounded_share_of_the_queue_and_none_is_lost():
    """60,000 observations queue 180,000 histogram values: a collection records at most its share (the SDK drops
    a collection past 10 s), the rest wait for the next ones, and the sums are whole at every collection."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from exporters import OTelExporter, otel
    from shadow.core.model import contract
    from shadow.core.model.observation import Observation

    reader = InMemoryMetricReader()
    exporter = OTelExporter(meter_provider=MeterProvider(metric_readers=[reader]))
    exporter.record(contract.registered_samples("op", 1.0))
    observation = Observation("op", "close", numel=4, max_abs_error=1e-6, shadow_seconds=0.001)
    samples = contract.observation_samples(observation)
    for _ in range(60_000):
        exporter.record(samples)
    queued = 100_000 - 100_000 % 3  # (MAX_PENDING: whole observations of 3 values each)
    assert exporter.dropped == 60_000 - queued // 3

    def collect():
        data = reader.get_metrics_data().resource_metrics[0].scope_metrics[0].metrics
        by_name = {m.name: m for m in data}
        histogram = sum(p.count for p in by_name["npu_shadow.shadow.duration"].data.data_points)
        comparisons = sum(p.value for p in by_name["npu_shadow.comparisons"].data.data_points)
        return histogram, comparisons

    first, comparisons = collect()
    assert comparisons == 60_000  # every sum, at once
    assert 0 < first <= otel.MAX_RECORDED_PER_COLLECTION  # a bounded share of the queue
    collections = 1
    while len(exporter._pending) and collections < 100:
        collect()
        collections += 1
    assert not exporter._pending and collect()[0] == queued // 3  # every queued value, in later collections


# --------------------------------------------------------------------------- 6. a canary and its switch

CANARY = ["run", "--legacy-from", "reference", "--primary", "upstream", "--sample-rate", "1"]
PRINTS = [sys.executable, "-c", "print('the job ran')"]


@pytest.mark.slow
def test_a_canary_whose_switch_cannot_start_refuses_to_start_unless_told(tmp_path):
    import socket

    env = {**os.environ, "NPU_SHADOW_ROLLBACK_TOKEN": JOBS_TOKEN}
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        refused = npu_shadow(*CANARY, "--rollback-port", port, "--", *PRINTS, env=env)
        assert refused.returncode == 2 and "the job ran" not in refused.stdout, refused.stdout + refused.stderr
        assert "cannot listen on 127.0.0.1:" in refused.stderr and "--rollback-optional" in refused.stderr
        told = npu_shadow(*CANARY, "--rollback-port", port, "--rollback-optional", "--", *PRINTS, env=env)
        assert told.returncode == 0 and "the job ran" in told.stdout, told.stderr
        assert "the file switch still works" not in told.stderr  # (none was configured)
    past = npu_shadow(*CANARY, "--rollback-port", "65535", "--", *PRINTS, env={**env, "LOCAL_RANK": "1"})
    assert past.returncode == 2 and "past port 65535" in past.stderr and "the job ran" not in past.stdout


@pytest.mark.slow
def test_the_token_never_on_the_command_line_and_an_open_address_is_said(tmp_path):
    on_the_line = npu_shadow(*CANARY, "--rollback-port", "0", "--rollback-token", JOBS_TOKEN, "--", *PRINTS)
    assert on_the_line.returncode == 2 and "the job ran" not in on_the_line.stdout
    token = tmp_path / "token"
    token.write_text(JOBS_TOKEN + "\n")
    token.chmod(0o644)
    readable = npu_shadow(*CANARY, "--rollback-port", "0", "--rollback-token-file", str(token), "--", *PRINTS)
    assert readable.returncode == 2 and "others can read it" in readable.stderr
    token.chmod(0o600)
    env = {k: v for k, v in os.environ.items() if k != "NPU_SHADOW_ROLLBACK_TOKEN"}
    from_file = npu_shadow(
        *CANARY, "--rollback-port", "0", "--rollback-token-file", str(token), "--rollback-addr", "0.0.0.0", "--",
        *PRINTS, env=env,
    )  # fmt: skip
    assert from_file.returncode == 0 and "the job ran" in from_file.stdout, from_file.stderr
    assert "will listen on 0.0.0.0: other hosts can reach it" in from_file.stderr


# --------------------------------------------------------------------------- 15. npu-shadow ab

AB_SUITE = """
import os
import signal
import time

import torch


def test_plain():
    assert torch.ones(2).type(torch.float16).dtype == torch.float16


def test_crashes_only_without_the_patches():
    if getattr(torch.Tensor.type, "__wrapped__", None) is None:  # the upstream world: no patch, no shadow
        os.kill(os.getpid(), signal.SIGSEGV)


def test_after_the_crash():
    assert True


def test_waits_for_a_signal():
    if os.environ.get("AB_MARKER"):
        open(os.environ["AB_MARKER"], "w").close()
        time.sleep(120)
"""


def _ab(tmp_path: pathlib.Path, *pytest_args: str, journal: str | None = None, **popen: object) -> list[str]:
    (tmp_path / "test_suite.py").write_text(AB_SUITE)
    journal = journal if journal is not None else str(tmp_path / "j.jsonl")
    return [sys.executable, "-m", "shadow", "ab", "--journal", journal, "--", "-q", "-p", "no:xdist",
            "--npu-shadow-legacy=reference", *pytest_args]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(
    "argument, says",
    [
        ("--npu-shadow-world=legacy", "--npu-shadow-world: ab runs the suite in both worlds itself"),
        ("--npu-shadow-outcomes=x.json", "--npu-shadow-outcomes: ab records"),
        ("--npu-shadow-journal=other.jsonl", "--npu-shadow-journal: give the journal as ab's own --journal"),
        ("--co", "--co: a collection runs no test"),
        ("--collect-only", "--collect-only: a collection runs no test"),
        ("--setup-plan", "--setup-plan: a setup plan runs no test"),
        ("--setup-only", "--setup-only: setting up fixtures alone runs no test"),
        ("--fixtures", "--fixtures: listing fixtures runs no test"),
        ("--markers", "--markers: listing markers runs no test"),
        ("--version", "--version: pytest's version runs no test"),
        ("--help", "--help: pytest's help runs no test"),
    ],
)
def test_ab_refuses_options_that_would_make_its_comparison_empty_or_one_sided(tmp_path, argument, says):
    done = subprocess.run(_ab(tmp_path, argument), capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 2 and says in done.stderr, done.stdout + done.stderr
    assert "the legacy world" not in done.stderr  # refused before any world ran


@pytest.mark.slow
def test_a_symlink_at_the_journal_path_is_refused_before_anything_runs(tmp_path):
    (tmp_path / "elsewhere").write_text("")
    (tmp_path / "j.jsonl").symlink_to(tmp_path / "elsewhere")
    done = subprocess.run(_ab(tmp_path), capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "--journal" in done.stderr and "not a regular file" in done.stderr, done.stderr
    assert (tmp_path / "elsewhere").read_text() == ""


@pytest.mark.slow
def test_a_test_that_crashes_the_interpreter_in_one_world_is_the_finding(tmp_path):
    import json

    command = _ab(tmp_path, "-k", "not waits")
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "3 tests, 1 changed their outcome without the patches" in done.stdout, done.stdout
    assert "test_crashes_only_without_the_patches: legacy world: passed; upstream world: crashed" in done.stdout
    assert "SIGSEGV" in done.stdout
    records = [json.loads(line) for line in (tmp_path / "j.jsonl").read_text().splitlines()]
    ab = {r["test"]: r for r in records if r.get("target") == "suite_ab" and "outcome" in r}
    assert ab["test_suite.py::test_crashes_only_without_the_patches"]["signature"] == "test/passed->crashed"
    # the tests after the crash ran in the upstream world too (a fresh pytest for the rest)
    assert ab["test_suite.py::test_after_the_crash"]["outcome"] == "match"
    assert ab["test_suite.py::test_plain"]["outcome"] == "match"


def _ab_in_its_test(tmp_path, ignoring: tuple) -> tuple[subprocess.Popen, list[str]]:
    """ab running the AB suite's waiting test (its pytest's pid beside it), started with the forwarded signals at
    their defaults but for ``ignoring`` (as nohup or a shell's background job starts a command: whatever this test
    process was started with)."""
    import signal
    import time

    from shadow.launcher.ab import FORWARDED_SIGNALS

    def dispositions() -> None:
        for signum in FORWARDED_SIGNALS:
            signal.signal(signum, signal.SIG_IGN if signum in ignoring else signal.SIG_DFL)

    marker = tmp_path / "running"
    env = {**os.environ, "AB_MARKER": str(marker)}
    ab = subprocess.Popen(
        _ab(tmp_path, "-k", "waits"), cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, preexec_fn=dispositions,
    )  # fmt: skip
    deadline = time.monotonic() + 120  # (deadline: the world's pytest starts and reaches the test)
    while not marker.exists() and ab.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    if not marker.exists():
        ab.kill()
        raise AssertionError(f"the test never started: {ab.communicate()}")
    children = subprocess.run(["pgrep", "-P", str(ab.pid)], capture_output=True, text=True).stdout.split()
    assert len(children) == 1
    return ab, children


def _ignored(pid: int | str) -> set[int]:
    """The signals process ``pid`` ignores (its SigIgn mask)."""
    with open(f"/proc/{pid}/status") as status:
        mask = int(next(line for line in status if line.startswith("SigIgn:")).split()[1], 16)
    return {bit + 1 for bit in range(64) if mask >> bit & 1}


@pytest.mark.slow
def test_ab_started_ignoring_a_hang_up_keeps_ignoring_it_and_its_pytest_does_too(tmp_path):
    """Under nohup (SIGHUP ignored) ab and its pytest go on ignoring SIGHUP; the signals ab was not started
    ignoring reach its pytest at their defaults, whatever ab does with them."""
    import signal

    ab, children = _ab_in_its_test(tmp_path, ignoring=(signal.SIGHUP,))
    try:
        assert signal.SIGHUP in _ignored(ab.pid) and signal.SIGHUP in _ignored(children[0])
        assert not {signal.SIGTERM, signal.SIGQUIT, signal.SIGUSR1} & _ignored(children[0])
        ab.send_signal(signal.SIGTERM)
        _, err = ab.communicate(timeout=60)
    finally:
        ab.kill()
    assert ab.returncode == 2 and "stopped by SIGTERM" in err, err


@pytest.mark.slow
@pytest.mark.parametrize("signal_name", ["SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1"])
def test_a_signal_to_ab_stops_the_running_pytest_too(tmp_path, signal_name):
    import signal

    ab, children = _ab_in_its_test(tmp_path, ignoring=())
    try:
        ab.send_signal(getattr(signal, signal_name))
        _, err = ab.communicate(timeout=60)
    finally:
        ab.kill()
    assert ab.returncode == 2 and f"stopped by {signal_name}" in err, err
    assert not os.path.exists(f"/proc/{children[0]}"), "the world's pytest outlived ab"


# --------------------------------------------------------------------------- 13. a deadline and a windowed budget


def test_a_hanging_upstream_is_abandoned_at_its_deadline_and_the_target_stops_shadowing(caplog):
    import threading
    import time

    import torch

    import shadow

    release, calls = threading.Event(), []

    def hangs(x):
        calls.append(x)
        release.wait()  # (a lock never released: no exception reaches a thread blocked here)
        return x * 3

    ops, target = fakes.op_target(hangs)
    try:
        with shadow.install([target], sample_rate=1.0, deadline=0.3) as monitor:
            start = time.monotonic()
            first = ops.op(torch.ones(2))
            waited = time.monotonic() - start  # (deadline: measured against the deadline it waited for)
            later = [ops.op(torch.ones(2)) for _ in range(5)]
            stats = monitor.stats()["op"]
    finally:
        release.set()
    assert first.tolist() == [2.0, 2.0] and all(x.tolist() == [2.0, 2.0] for x in later)  # legacy's result
    assert 0.3 <= waited < 30  # (deadline: the caller waited for its deadline, then went on)
    assert len(calls) == 1  # the target shadowed no more
    assert stats.calls == 6 and stats.skipped == 6 and stats.by_reason == {"deadline": 6} and stats.compared == 0
    assert any("took longer than its deadline (0.3 s)" in r.getMessage() for r in caplog.records)


HANGING_JOB = """
import threading, types
import torch
import shadow
from shadow import Target

ops = types.SimpleNamespace(op=lambda x: x * 2)
target = Target("op", ops, "op", lambda x: threading.Event().wait() or x)
with shadow.install([target], sample_rate=1.0, deadline=0.2):
    print(ops.op(torch.ones(1)).tolist(), flush=True)
"""


@pytest.mark.slow
def test_a_job_whose_upstream_hangs_forever_still_ends():
    done = subprocess.run([sys.executable, "-c", HANGING_JOB], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0 and done.stdout.strip() == "[2.0]", done.stdout + done.stderr


def test_the_shadow_side_runs_the_same_call_on_its_own_thread():
    """Thread-local torch state reaches the upstream run's thread (grad mode, inference mode, autocast, intra-op
    threads, a default device, NumPy's error settings), and what upstream leaves there is still compared."""
    import numpy as np
    import torch

    import shadow

    seen = []

    def upstream(x):
        seen.append((
            torch.is_grad_enabled(), torch.is_inference_mode_enabled(), torch.is_autocast_enabled("cpu"),
            torch.get_autocast_dtype("cpu"), torch.get_num_threads(), torch.empty(1).device.type,
            np.geterr()["divide"],
        ))  # fmt: skip
        torch.set_num_threads(torch.get_num_threads() + 1)  # (thread-local for OpenMP: seen on that thread)
        return x * 2

    ops, target = fakes.op_target(upstream)
    threads = torch.get_num_threads()
    with shadow.install([target], sample_rate=1.0, deadline=30) as monitor:
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), np.errstate(divide="raise"):
            torch.set_num_threads(max(1, threads - 1))
            try:
                with torch.device("meta"):
                    ops.op(torch.ones(2))
            finally:
                torch.set_num_threads(threads)
        with torch.inference_mode():
            ops.op(torch.ones(2))
    assert seen[0] == (False, False, True, torch.bfloat16, max(1, threads - 1), "meta", "raise")
    assert seen[1][:2] == (False, True)  # (inference mode: no grad)
    stats = monitor.stats()["op"]
    assert stats.mismatch == 2 and stats.by_reason == {"state": 2}


def test_the_budget_holds_over_a_window_after_a_long_idle_time():
    """Since install alone, an hour idle banked an hour's share: every call of a burst then compared. Now at most
    the burst is saved up: the burst's 100 calls of 0.02 s use 0.5 s and the share of their time, no more, and no
    less than that less one call."""
    import torch

    import shadow
    from shadow.core.calls.gate.budget import BURST_SECONDS, Budgets

    clock, spent = fakes.Clock(), []
    ops, target = fakes.op_target(clock.costing(0.02, spent))
    with shadow.install([target], sample_rate=1.0, budget=Budgets.of(0.1, clock)) as monitor:
        clock.advance(3600)  # the job idle for an hour
        began = clock()
        for _ in range(100):  # then 100 calls, 0.05 s of job time apart
            clock.advance(0.05)
            ops.op(torch.ones(2))
        stats = monitor.stats()["op"]
    share = BURST_SECONDS + 0.1 * (clock() - began)
    assert share - 0.02 <= sum(spent) <= share + 1e-9, (sum(spent), share)
    assert stats.compared == len(spent) and stats.by_reason == {"budget": 100 - stats.compared}, stats


def test_a_slow_signature_function_is_paid_from_the_budget():
    """A guided target classifies every call while a signature is in its first calls: a 5 ms signature function
    on every call was outside the budget. Within it, classifying stops once it alone has used the budget (its calls
    count as unclassified): it uses the burst and the share of the time, within one call's cost."""
    import torch

    import shadow
    from shadow.core.calls.gate.budget import BURST_SECONDS, Budgets

    clock, classified = fakes.Clock(), []

    def signature(args, kwargs):
        classified.append(1)
        clock.advance(0.005)
        return "call"

    ops, target = fakes.op_target(lambda x: x * 2, signature=signature)
    began = clock()
    # (a signature's first 1,000 calls: every call is classified)
    budget = Budgets.of(0.1, clock)
    with shadow.install([target], sample_rate=0.0, budget=budget, first_per_signature=1000) as monitor:
        for _ in range(400):
            clock.advance(0.001)  # (the job's own time between calls)
            ops.op(torch.ones(2))
        calls = monitor.stats()["op"].signature_calls
    share = BURST_SECONDS + 0.1 * (clock() - began)
    assert share <= len(classified) * 0.005 <= share + 0.005 + 1e-9, (len(classified), share)
    assert calls["unclassified"] == 400 - len(classified) > 0 and sum(calls.values()) == 400


# --------------------------------------------------------------------------- the rollback always gets through


@pytest.mark.slow
def test_idle_connections_without_a_token_never_keep_an_authorised_rollback_out():
    import socket
    import urllib.request

    from shadow.launcher import switch as switch_module

    switch, thrown, _ = _switch(port=0, token="t" * 24)
    try:
        idle = [socket.create_connection(("127.0.0.1", switch.port)) for _ in range(switch_module.MAX_CONNECTIONS + 8)]
        request = urllib.request.Request(
            f"http://127.0.0.1:{switch.port}/rollback", data=b"{}", method="POST",
            headers={"Authorization": "Bearer " + "t" * 24},
        )  # fmt: skip
        with urllib.request.urlopen(request, timeout=5) as response:
            assert response.status == 200
        assert thrown.is_set() and switch.server.evicted >= 1
        for connection in idle:
            connection.close()
    finally:
        switch.close()


def test_a_malformed_request_is_refused_and_counted_never_a_traceback(capfd):
    switch, thrown, _ = _switch(port=0, token="t" * 24)
    try:
        for data in (b"\x00\xff garbage\r\n\r\n", b"GET /" + b"x" * 70000 + b" HTTP/1.1\r\n\r\n", b"POST\r\n\r\n"):
            _raw(switch.port, data, wait=5)
        assert switch.refused >= 3 and not thrown.is_set()
    finally:
        switch.close()
    assert "Traceback" not in capfd.readouterr().err


@pytest.mark.slow
def test_the_receiver_posts_each_switch_once_per_notification(tmp_path):
    switches = [Switches() for _ in range(8)]
    receiver = Receiver(tmp_path, *(f"--switch=job{i}={s.url}" for i, s in enumerate(switches)))
    try:
        alerts = [(f"job{i % 8}", f"Alert{i}") for i in range(64)]
        assert receiver.post(notification(*alerts)) == 200
    finally:
        receiver.close()
        for s in switches:
            s.close()
    assert [len(s.posts) for s in switches] == [1] * 8


@pytest.mark.slow
def test_the_receiver_answers_502_when_a_switch_was_not_thrown(tmp_path):
    receiver = Receiver(tmp_path, f"--switch=gone=http://127.0.0.1:{free_port()}")
    try:
        assert receiver.post(notification(("gone", "A"))) == 502
    finally:
        receiver.close()
    assert [line["status"] for line in receiver.lines()] == [0]


FORKED_BEFORE_ROLLBACK = """
import os, sys, time
import torch

read, write = os.pipe()
pid = os.fork()
if pid == 0:  # a DataLoader-like worker, forked before the rollback
    os.close(read)
    end = time.monotonic() + 120
    while time.monotonic() < end:
        from shadow.launcher.launch import LAUNCHER
        primary = LAUNCHER.monitor.stats()["tensor_type"].primary
        torch.ones(2).type(torch.float16)
        if primary == "legacy":
            os.write(write, b"legacy")
            os._exit(0)
        time.sleep(0.05)
    os.write(write, b"upstream")
    os._exit(1)
os.close(write)
time.sleep(0.3)
open(sys.argv[1], "w").write("a person\\n")
print(os.read(read, 100).decode(), flush=True)
os.waitpid(pid, 0)
"""


@pytest.mark.slow
def test_a_rollback_reaches_a_process_forked_before_it(tmp_path):
    job = tmp_path / "job.py"
    job.write_text(FORKED_BEFORE_ROLLBACK)
    switch_file = tmp_path / "rollback"
    done = npu_shadow(
        "run", "--legacy-from", "reference", "--primary", "upstream", "--rollback-file", str(switch_file), "--",
        sys.executable, str(job), str(switch_file),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[0] == "legacy", done.stdout + done.stderr


@pytest.mark.slow
def test_an_abort_at_exit_after_every_test_ran_loses_no_outcome(tmp_path):
    (tmp_path / "conftest.py").write_text("import atexit, os\natexit.register(os.abort)\n")
    done = subprocess.run(
        _ab(tmp_path, "-k", "plain or after"), capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 tests, 0 changed their outcome without the patches" in done.stdout, done.stdout
    assert "after its session finished; every test's outcome is on record" in done.stderr
