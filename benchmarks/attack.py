"""An attack round over the surface of round 5: threads, an upstream that keeps the GIL, forks, memory limits,
connections and hostile files.

Each case is tried many times with varied inputs; a case holds when training is unchanged (the caller's result,
its module's state, its call counts) and what the monitor cannot do is refused or skipped with a counted reason.
Prints, per surface, how many attacks were tried and how many held, then the totals; exits 1 where one did not
hold. ``--quick`` tries fewer of each (what the test suite runs).

    python benchmarks/attack.py [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import types
import urllib.request
import zipfile
from collections.abc import Iterator
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import torch  # noqa: E402

import shadow  # noqa: E402
from shadow import Target  # noqa: E402

TOKEN = "attack-token-0123456789abcdef"


@contextlib.contextmanager
def _upstream_run_under_way() -> Iterator[tuple[Any, Any]]:
    """(owner, monitor) while a sampled call's upstream run is under way on another thread of the job's (a slow
    upstream, released when the body ends): ``owner.op(x)`` gives ("legacy", x) unwrapped."""
    owner = types.SimpleNamespace(op=lambda x: ("legacy", x))
    started, release = threading.Event(), threading.Event()

    def upstream(x: Any) -> tuple[str, Any]:
        if x == "slow":
            started.set()
            release.wait(10)
        return ("upstream", x)

    target = Target("op", owner, "op", upstream, isolate=False)
    with shadow.install([target], sample_rate=1.0, deadline=None) as monitor:
        caller = threading.Thread(target=lambda: owner.op("slow"), daemon=True)
        caller.start()
        started.wait(10)
        try:
            yield owner, monitor
        finally:
            release.set()
            caller.join(10)


def _threads(trials: int, rng: random.Random) -> list[bool]:
    """Job threads (daemon or not) started while an upstream run is under way get legacy's result, counted."""
    held = []
    for _ in range(trials):
        results: list = []
        count = rng.randint(1, 6)
        with _upstream_run_under_way() as (owner, monitor):
            jobs = [
                threading.Thread(target=lambda i=i, o=owner, r=results: r.append(o.op(i)), daemon=rng.random() < 0.5)
                for i in range(count)
            ]
            for job in jobs:
                job.start()
            for job in jobs:
                job.join(10)
        calls = monitor.experiment("op").stats().calls
        held.append(sorted(results) == [("legacy", i) for i in range(count)] and calls == count + 1)
    return held


def _gil(trials: int, rng: random.Random) -> list[bool]:
    """An upstream that keeps the GIL past its deadline (C code that never releases it: the caller cannot leave its
    wait) holds the job once: it runs once, every call gets legacy's result and is counted, the target stops."""
    import ctypes

    keeps_the_gil = ctypes.PyDLL(None)
    held = []
    for _ in range(trials):
        runs: list = []
        owner = types.SimpleNamespace(op=lambda x: ("legacy", x))
        keep = rng.randint(60_000, 200_000)

        def holds_the_gil(x, runs=runs, keep=keep):
            runs.append(x)
            keeps_the_gil.usleep(keep)
            return ("upstream", x)

        calls = rng.randint(2, 5)
        target = Target("op", owner, "op", holds_the_gil, isolate=False)
        with shadow.install([target], sample_rate=1.0, deadline=rng.uniform(0.01, 0.05), seed=0) as monitor:
            results = [owner.op(i) for i in range(calls)]
            stats = monitor.experiment("op").stats()
        held.append(results == [("legacy", i) for i in range(calls)] and runs == [0] and stats.calls == calls)
    return held


def _forks(trials: int) -> list[bool]:
    """A child forked while an upstream run is under way calls as the job does: legacy's result, counted."""
    held = []
    for _ in range(trials):
        with _upstream_run_under_way() as (owner, monitor):
            read, write = os.pipe()
            pid = os.fork()
            if pid == 0:
                try:
                    ok = owner.op(1) == ("legacy", 1) and monitor.experiment("op").stats().calls == 1
                    os.write(write, b"1" if ok else b"0")
                finally:
                    os._exit(0)
            os.close(write)
            answer = os.read(read, 1)
            os.waitpid(pid, 0)
            os.close(read)
        held.append(answer == b"1")
    return held


LIMITED_JOB = """
import resource, sys, types
import torch
from torch import nn
import shadow
from shadow import Target
limit = int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
module = nn.Linear(2048, 2048).double()  # 32 MiB of float64 weights: a truth run's host copy would not fit
owner = types.SimpleNamespace(op=lambda m, x: m(x))
target = Target("op", owner, "op", lambda m, x: m(x) * (1 + 1e-3))
with shadow.install([target], sample_rate=1.0, truth_rate=1.0, seed=0) as monitor:
    for _ in range(3):
        owner.op(module, torch.randn(4, 2048, dtype=torch.float64))
    stats = monitor.stats()["op"]
print(stats.calls, stats.compared, dict(stats.truth_runs))
"""


def _limits(trials: int) -> list[bool]:
    """Under an address-space limit just above the job's own needs, shadowing never gets the job killed."""
    held = []
    with open("/proc/self/status") as handle:  # (this interpreter's size once torch is in: the job's own needs)
        status = handle.read()
    vm = next(int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmSize:"))
    for index in range(trials):
        limit = vm + (400 + 50 * index) * (1 << 20)
        done = subprocess.run(
            [sys.executable, "-c", LIMITED_JOB, str(limit)], capture_output=True, text=True, timeout=300, cwd=ROOT
        )
        held.append(done.returncode == 0 and done.stdout.split()[:1] == ["3"])
    return held


def _connections(trials: int, rng: random.Random) -> list[bool]:
    """Idle and malformed connections never keep an authorised rollback out, and never print a traceback."""
    from shadow.launcher.switch import MAX_CONNECTIONS, RollbackSwitch

    held = []
    for _ in range(trials):
        thrown = threading.Event()
        switch = RollbackSwitch(lambda by, thrown=thrown: thrown.set(), lambda by: None, port=0, token=TOKEN)
        idle = []
        try:
            for _ in range(MAX_CONNECTIONS + rng.randint(0, 32)):
                connection = socket.create_connection(("127.0.0.1", switch.port))
                if rng.random() < 0.3:
                    connection.sendall(rng.choice([b"\x00\xff\r\n\r\n", b"GET /", b"POST /rollback HTTP/1.1\r\n"]))
                idle.append(connection)
            request = urllib.request.Request(
                f"http://127.0.0.1:{switch.port}/rollback", data=b"{}", method="POST",
                headers={"Authorization": f"Bearer {TOKEN}"},
            )  # fmt: skip
            try:
                with urllib.request.urlopen(request, timeout=5) as response:
                    ok = response.status == 200
            except OSError:
                ok = False
            held.append(ok and thrown.is_set())
        finally:
            for connection in idle:
                connection.close()
            switch.close()
    return held


def _hostile_files(trials: int, rng: random.Random) -> list[bool]:
    """Journals torn anywhere stay readable past the tear; captures that are FIFOs, symlinks, zip bombs or
    escape sequences are refused or shown escaped."""
    import journals

    from exporters import capture
    from shadow.analysis import sources

    held = []
    with tempfile.TemporaryDirectory() as directory:
        whole = json.dumps(journals.line()) + "\n"
        for index in range(trials):
            path = os.path.join(directory, f"j{index}.jsonl")
            before, after = rng.randint(0, 5), rng.randint(1, 5)
            cut = rng.randint(1, len(whole) - 2)
            with open(path, "w") as handle:
                handle.write(json.dumps(journals.header()) + "\n" + whole * before + whole[:cut] + whole * after)
            try:
                compared = sources.from_journal([path], [])["op"].compared
                held.append(compared == before + after - 1 or compared == before + after)
            except sources.SourceError:
                held.append(False)
        fifo = os.path.join(directory, "fifo.pt")
        os.mkfifo(fifo)
        link = os.path.join(directory, "link.pt")
        os.symlink("/etc/passwd", link)
        bomb = os.path.join(directory, "bomb.pt")
        with (
            zipfile.ZipFile(bomb, "w", compression=zipfile.ZIP_DEFLATED) as archive,
            archive.open("archive/data/0", "w", force_zip64=True) as entry,
        ):
            for _ in range(20):
                entry.write(bytes(1 << 24))
        for hostile in (fifo, link, bomb):
            try:
                capture.load(hostile)
                held.append(False)
            except ValueError:
                held.append(True)
    return held


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer trials of each (the test suite's run)")
    args = parser.parse_args()
    logging.getLogger("shadow").setLevel(logging.ERROR)  # (the refusals it provokes are logged, as they should be)
    n = 3 if args.quick else 1
    rng = random.Random(5)
    surfaces = {
        "threads": lambda: _threads(60 // n, rng),
        "gil": lambda: _gil(21 // n, rng),
        "forks": lambda: _forks(30 // n),
        "limits": lambda: _limits(3 if not args.quick else 1),
        "connections": lambda: _connections(15 // n, rng),
        "hostile files": lambda: _hostile_files(300 // n, rng),
    }
    tried = held = 0
    for name, run in surfaces.items():
        results = run()
        tried += len(results)
        held += sum(results)
        print(f"{name:<14} tried {len(results):>4}  held {sum(results):>4}", flush=True)
    print(f"{'all':<14} tried {tried:>4}  held {held:>4}")
    return 0 if tried == held else 1


if __name__ == "__main__":
    torch.manual_seed(0)
    sys.exit(main())
