"""An attack round over the surfaces of rounds 5 and 7: threads, an upstream that keeps the GIL, forks, memory limits,
connections and hostile files; counted patch places, saves the environment fails, settings another thread changes,
saves whose pickling runs the job's code, append-mode streams and the census cache.

Each case is tried many times with varied inputs; a case holds when training is unchanged (the caller's result,
its module's state, its call counts) and what the monitor cannot do is refused or skipped with a counted reason.
Prints, per surface, how many attacks were tried and how many held, then the totals; exits 1 where one did not
hold. ``--quick`` tries fewer of each (what the test suite runs).

    python benchmarks/attack.py [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import io
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


#: What the job's code did while loading (a __reduce__, a callable map_location): it must run once per load.
_RAN: list[str] = []


class _Registered:
    """An object whose unpickling runs the job's code."""

    def __reduce__(self) -> tuple:
        return _RAN.append, ("unpickled",)


def _remembers(storage: Any, location: str) -> Any:
    _RAN.append("mapped")
    return storage


class _Republishing:
    """torch's own load (legacy here: any divergence is false) that republishes the file by an atomic rename right
    after reading it, once per ``next_bytes`` given."""

    def __init__(self, path: str) -> None:
        self.path, self.next_bytes = path, []

    def load(self, f: Any, *args: Any, **kwargs: Any) -> Any:
        result = torch.serialization.load(f, *args, **kwargs)
        if self.next_bytes:
            with open(self.path + ".tmp", "wb") as out:
                out.write(self.next_bytes.pop())
            os.replace(self.path + ".tmp", self.path)
        return result


def _write_checkpoint(kind: str, path: str, rng: random.Random) -> dict[str, Any]:
    """A checkpoint of ``kind`` at ``path``; the load's keyword arguments."""
    model = torch.nn.Sequential(torch.nn.Linear(4, rng.randint(1, 8)), torch.nn.ReLU())
    kwargs: dict[str, Any] = {"weights_only": False}
    if kind == "model":
        torch.save(model, path)
    elif kind == "code":
        torch.save({"plugin": _Registered(), "w": torch.ones(2)}, path)
    elif kind == "deflated":  # (8 MiB of storage in a small file)
        buffer = io.BytesIO()
        torch.save({"w": torch.zeros(8 << 18)}, buffer)
        with zipfile.ZipFile(io.BytesIO(buffer.getvalue())) as source, zipfile.ZipFile(path, "w") as out:
            for info in source.infolist():
                out.writestr(info.filename, source.read(info), zipfile.ZIP_DEFLATED)
    else:
        torch.save(model.state_dict(), path, _use_new_zipfile_serialization=rng.random() < 0.5)
    if kind == "callable":
        kwargs["map_location"] = _remembers
    if kind == "truncated":
        with open(path, "rb+") as handle:
            handle.truncate(rng.randint(1, os.path.getsize(path) - 1))
    return kwargs


def _load(loader: _Republishing, kwargs: dict[str, Any]) -> tuple[str, Any, list[str]]:
    _RAN.clear()
    try:
        return "returned", _state(loader.load(loader.path, **kwargs)), list(_RAN)
    except Exception as exc:
        return type(exc).__name__, str(exc), list(_RAN)


def _torch_load_case(kind: str, path: str, rng: random.Random) -> bool:
    """One load of a ``kind`` checkpoint unwrapped, then shadowed (the same bytes, republished alike)."""
    import dataclasses

    from shadow.core.model import live_targets
    from shadow.core.support import memory

    kwargs = _write_checkpoint(kind, path, rng)
    with open(path, "rb") as handle:
        written = handle.read()
    replacement = io.BytesIO()
    torch.save({"other": torch.zeros(3)}, replacement)
    loader = _Republishing(path)
    loader.next_bytes = [replacement.getvalue()] if kind == "rename" else []
    alone = _load(loader, kwargs)
    with open(path, "wb") as out:
        out.write(written)
    loader.next_bytes = [replacement.getvalue()] if kind == "rename" else []
    target = dataclasses.replace(live_targets.torch_load(), owner=loader, attribute="load")
    original_free = memory.host_free_bytes
    if kind == "deflated":
        memory.host_free_bytes = lambda: 4 << 20  # (what it loads to does not fit: never loaded again)
    try:
        with shadow.install([target], sample_rate=1.0, budget=None, deadline=None) as monitor:
            shadowed = _load(loader, kwargs)
            stats = monitor.stats()["torch_load"]
    finally:
        memory.host_free_bytes = original_free
    return repr(alone) == repr(shadowed) and stats.mismatch == 0 and stats.error == 0


def _torch_load(trials: int, rng: random.Random) -> list[bool]:
    """torch_load over hostile and racing checkpoints: whole models, objects whose unpickling runs the job's code,
    callable map_locations, files republished by rename mid-load, deflated storages that do not fit, truncated files,
    FIFOs. Holds when the job gets what the unwrapped load gives (the same code run as often), and nothing
    diverges (legacy is torch's own load)."""
    from shadow.core.model import live_targets

    held = []
    with tempfile.TemporaryDirectory() as directory:
        for index in range(trials):
            kind = rng.choice(["model", "state", "code", "callable", "rename", "deflated", "truncated", "fifo"])
            path = os.path.join(directory, f"latest{index}.pt")
            if kind == "fifo":  # (never opened by the signature: a load from it would block on the writer)
                os.mkfifo(path)
                held.append(live_targets.checkpoint_format(path) == "special")
            else:
                held.append(_torch_load_case(kind, path, rng))
    return held


def _state(loaded: Any) -> Any:
    if isinstance(loaded, torch.nn.Module):
        return {k: v.tolist() for k, v in loaded.state_dict().items()}
    if isinstance(loaded, dict):
        return {k: v.tolist() if isinstance(v, torch.Tensor) else type(v).__name__ for k, v in loaded.items()}
    return loaded


def _module_to(trials: int, rng: random.Random) -> list[bool]:
    """Module.to in every dtype and memory format under memory that cannot hold a second copy: the module ends as the
    unwrapped call leaves it, and no shadow run's allocation failure is counted as upstream's."""
    from shadow.core.support import memory

    held = []
    for _ in range(trials):
        seed = rng.randint(0, 1000)

        def make(seed: int = seed) -> torch.nn.Module:
            torch.manual_seed(seed)
            return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.Linear(8, 512))

        dtype = rng.choice([torch.float64, torch.float16, torch.bfloat16, torch.float32])
        fmt = rng.choice([None, torch.channels_last])
        options = {} if fmt is None else {"memory_format": fmt}
        alone = make().to(dtype, **options)
        free = rng.choice([1 << 20, 6 << 20, 1 << 40])
        original_free = memory.free_bytes
        memory.free_bytes = lambda device, free=free: free
        try:
            with shadow.install(["module_to"], sample_rate=1.0, budget=None, deadline=None) as monitor:
                module = make().to(dtype, **options)
                stats = monitor.stats()["module_to"]
        finally:
            memory.free_bytes = original_free
        same = all(
            a.dtype == b.dtype and a.stride() == b.stride() and torch.equal(a, b)
            for a, b in zip(alone.state_dict().values(), module.state_dict().values(), strict=True)
        )
        held.append(same and stats.error == 0 and stats.mismatch == 0)
    return held


def _census(trials: int, rng: random.Random) -> list[bool]:
    """census over hostile sources: links out of the tree, FIFOs, devices, members that inflate past the bound,
    undecodable text, deep expressions and call chains, escape sequences. Holds when it answers within 60 s with a
    clear refusal (exit 2) or a census, never a traceback or raw control characters."""
    hostile = {
        "link": None,
        "fifo": None,
        "device": None,
        "undecodable": b"x = '\xff\xfe'\n",
        "expression": ("x = " + "+".join(["a"] * 200_000) + "\n").encode(),
        "chain": ("".join(f"def f{i}():\n    f{i + 1}()\n" for i in range(2000)) + "f0()\n").encode(),
        "escape": b"import torch\n\nsetattr(torch, '\\x1b[2Jred', None)\n",
        "bomb": None,
    }
    held = []
    with tempfile.TemporaryDirectory() as directory:
        for index in range(trials):
            kind = rng.choice(sorted(hostile))
            root = os.path.join(directory, f"release{index}")
            os.makedirs(os.path.join(root, "torch_npu", "utils"))
            with open(os.path.join(root, "torch_npu", "__init__.py"), "w") as init:
                init.write("import torch\nimport torch_npu.odd\n\ntorch.load = None\n")
            odd = os.path.join(root, "torch_npu", "odd.py")
            source = root
            if kind == "link":
                outside = os.path.join(directory, f"outside{index}.py")
                with open(outside, "w") as handle:
                    handle.write("import torch\ntorch.save = None\n")
                os.symlink(outside, odd)
            elif kind == "fifo":
                os.mkfifo(odd)
            elif kind == "device":
                os.symlink("/dev/zero", odd)
            elif kind == "bomb":
                source = os.path.join(directory, f"torch_npu-9.9.{index}-py3-none-any.whl")
                with zipfile.ZipFile(source, "w", zipfile.ZIP_DEFLATED) as wheel:
                    wheel.writestr("torch_npu/__init__.py", "import torch\n")
                    wheel.writestr("torch_npu/utils/__init__.py", "")
                    wheel.writestr("torch_npu/big.py", b"#" * (20 << 20))
            else:
                with open(odd, "wb") as handle:
                    handle.write(hostile[kind])
            try:
                done = subprocess.run([sys.executable, "-m", "shadow", "census", source], capture_output=True,
                                      text=True, timeout=60, cwd=ROOT)  # fmt: skip
            except subprocess.TimeoutExpired:
                held.append(False)
                continue
            clean = "Traceback" not in done.stderr and "\x1b" not in done.stdout + done.stderr
            held.append(clean and done.returncode in (0, 2))
    return held


def _linger(trials: int) -> list[bool]:
    """Half-open connections by the hundred never keep a real scrape of a lingering endpoint out (a child serving
    with few descriptors, as a launcher near its limit)."""
    script = (
        "import resource, sys, time\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (48, 48))\n"
        "from prometheus_client import CollectorRegistry, Counter\n"
        "from exporters.prometheus import serve_registry\n"
        "registry = CollectorRegistry()\n"
        "Counter('final', 'the final count', registry=registry).inc(7)\n"
        "print(serve_registry(registry, 0, '127.0.0.1').server_port, flush=True)\n"
        "time.sleep(120)\n"
    )
    held = []
    for _ in range(trials):
        server = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=ROOT)
        connections = []
        try:
            port = int(server.stdout.readline())
            for _ in range(139):
                connections.append(socket.create_connection(("127.0.0.1", port), timeout=5))
            body = ""
            for _ in range(60):
                try:
                    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
                    break
                except OSError:
                    threading.Event().wait(0.5)
            held.append("final_total 7.0" in body)
        finally:
            for connection in connections:
                connection.close()
            server.kill()
            server.wait()
    return held


def _verdict_inputs(trials: int, rng: random.Random) -> list[bool]:
    """Hostile count records in journals (huge, negative, fractional, NaN counts; more
    drilled than compared). Holds when the verdict answers with a clear refusal naming the field (exit 2), never a
    traceback and never a decision."""
    import journals

    held = []
    with tempfile.TemporaryDirectory() as directory:
        for index in range(trials):
            record = journals.counts({"sig": {"match": 100}}, calls={"sig": 200})
            field, value = rng.choice([
                ("calls", {"sig": 10**400}), ("calls", {"sig": -1}), ("calls", {"sig": 2.5}),
                ("drilled", 101), ("drilled", float("nan")), ("outcomes", {"sig": {"match": 10**400}}),
            ])  # fmt: skip
            record[field] = value
            path = os.path.join(directory, f"j{index}.jsonl")
            with open(path, "w") as handle:
                handle.write(json.dumps(journals.header()) + "\n" + json.dumps(record) + "\n")
            done = subprocess.run([sys.executable, "-m", "shadow", "verdict", "--journal", path], capture_output=True,
                                  text=True, timeout=120, cwd=ROOT)  # fmt: skip
            held.append(done.returncode == 2 and "Traceback" not in done.stderr and field in done.stderr)
    return held


def _matmul_twice(x: torch.Tensor) -> torch.Tensor:
    return torch.matmul(x, x)


def _counted_places(release: str) -> list[bool]:
    """Every function patch of a release's census, counted: the object at its place, its pickle and signature are
    what they are unwatched; a model and a function calling counted places script with TorchScript."""
    import inspect
    import pickle

    from torch_npu_wheels import wheel

    from shadow.analysis import census_cache
    from shadow.core.calls import patch_calls

    def seen(name: str) -> Any:
        place = patch_calls._place(name)
        if place is None:
            return None
        value = inspect.getattr_static(*place, None)
        results = []
        for read in (lambda: pickle.dumps(getattr(*place)), lambda: str(inspect.signature(getattr(*place)))):
            try:
                results.append(read())
            except Exception as exc:
                results.append(type(exc).__name__)
        return id(value), results

    names = json.loads(census_cache.patch_list(wheel(release)).read_text())["patches"]
    before = {name: seen(name) for name in names}
    with shadow.install([], count_patches=names):
        during = {name: seen(name) for name in names}
        try:
            norm = torch.jit.script(torch.nn.Sequential(torch.nn.Embedding(4, 4), torch.nn.LayerNorm(4)))
            squared = torch.jit.script(_matmul_twice)
            scripts = norm(torch.tensor([1, 2])).shape == (2, 4) and squared(torch.eye(2)).equal(torch.eye(2))
        except Exception:
            scripts = False
    after = {name: seen(name) for name in names}
    return [before[n] == during[n] == after[n] for n in names if before[n] is not None] + [scripts]


class _FullStream(io.BytesIO):
    def __init__(self, room: int) -> None:
        super().__init__()
        self.room = room

    def write(self, data: Any) -> int:
        if self.tell() + len(data) > self.room:
            raise OSError(28, "No space left on device")
        return super().write(data)


def _environment_saves(trials: int, rng: random.Random) -> list[bool]:
    """Saves a full disk or a missing folder fails (the environment, which upstream's save into memory never
    meets): the job gets the unwrapped call's exception, and the call is skipped, never an error or a mismatch."""
    from shadow.core.model import live_targets

    held = []
    with tempfile.TemporaryDirectory() as directory:
        for index in range(trials):
            state = {"w": torch.randn(rng.randint(1, 4096))}
            room = rng.randint(0, 2000)

            def destination(index: int = index, room: int = room) -> Any:
                return _FullStream(room) if index % 2 else os.path.join(directory, "missing", f"{index}.pt")

            try:
                torch.save(state, destination())
                unwrapped: Any = None
            except Exception as exc:
                unwrapped = type(exc)
            with shadow.install([live_targets.torch_save()], sample_rate=1.0, budget=None, deadline=None) as monitor:
                try:
                    torch.save(state, destination())
                    got: Any = None
                except Exception as exc:
                    got = type(exc)
                stats = monitor.stats()["torch_save"]
            held.append(got is unwrapped and stats.error == stats.mismatch == 0)
    return held


def _settings_threads(trials: int, rng: random.Random) -> list[bool]:
    """Another thread of the job changes a process-wide setting while a sampled call's shadow run is under way:
    its value stays, and the call is never a mismatch."""
    changes = [
        (lambda: torch.set_default_dtype(torch.float64), torch.get_default_dtype,
         lambda: torch.set_default_dtype(torch.float32)),
        (lambda: torch.set_printoptions(precision=2), lambda: torch._tensor_str.PRINT_OPTS.precision,
         lambda: torch.set_printoptions(precision=4)),
        (lambda: torch.use_deterministic_algorithms(True), torch.are_deterministic_algorithms_enabled,
         lambda: torch.use_deterministic_algorithms(False)),
        (lambda: torch.set_float32_matmul_precision("medium"), torch.get_float32_matmul_precision,
         lambda: torch.set_float32_matmul_precision("highest")),
    ]  # fmt: skip
    held = []
    for _ in range(trials):
        change, read, undo = rng.choice(changes)
        changing, changed = threading.Event(), threading.Event()

        def upstream(x: Any, changing: threading.Event = changing, changed: threading.Event = changed) -> Any:
            changing.set()
            changed.wait(10)
            return x * 2

        def other(change: Any = change, changing: threading.Event = changing, changed: threading.Event = changed):
            changing.wait(10)
            change()
            changed.set()

        owner = types.SimpleNamespace(op=lambda x: x * 2)
        thread = threading.Thread(target=other)
        try:
            with shadow.install([Target("op", owner, "op", upstream)], sample_rate=1.0, budget=None) as monitor:
                thread.start()
                owner.op(torch.ones(2))
                thread.join(10)
                value = read()
                stats = monitor.stats()["op"]
            change()
            held.append(value == read() and stats.mismatch == stats.error == 0)
        finally:
            thread.join(10)
            undo()
    return held


class _Counted:
    runs = 0

    def __reduce__(self) -> Any:
        type(self).runs += 1
        return (_Counted, ())


class _CountedText(str):
    runs = 0

    def __reduce__(self) -> Any:
        type(self).runs += 1
        return (str, (str(self),))


def _pickled_once(trials: int, rng: random.Random) -> list[bool]:
    """Saves whose pickling runs the job's code (a str subclass, an object as a dict key, a tensor's attribute, a
    pickle module of the job's): the job's code runs once, as unwrapped."""
    import pickle

    from shadow.core.model import live_targets

    made: list[int] = []

    class Pickler(pickle.Pickler):  # (torch.save subclasses it: counted in a list, not on the class)
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            made.append(1)
            super().__init__(*args, **kwargs)

    module = types.ModuleType("job_pickle")
    vars(module).update({k: getattr(pickle, k) for k in dir(pickle) if not k.startswith("__")}, Pickler=Pickler)

    def tensor_with_attribute() -> Any:
        tensor = torch.ones(2)
        tensor.note = _Counted()
        return {"t": tensor}

    kinds = {
        "leaf": (lambda: {"name": _CountedText("x"), "w": torch.ones(2)}, {}, lambda: _CountedText.runs),
        "key": (lambda: {_Counted(): torch.ones(2)}, {}, lambda: _Counted.runs),
        "attribute": (tensor_with_attribute, {}, lambda: _Counted.runs),
        "module": (lambda: {"w": torch.ones(2)}, {"pickle_module": module}, lambda: len(made)),
    }
    held = []
    with tempfile.TemporaryDirectory() as directory:
        for index in range(trials):
            make, kwargs, runs = kinds[rng.choice(sorted(kinds))]
            obj = make()
            before = runs()
            with shadow.install([live_targets.torch_save()], sample_rate=1.0, budget=None, deadline=None):
                torch.save(obj, os.path.join(directory, f"{index}.pt"), **kwargs)
            held.append(runs() - before == 1)
    return held


def _append_streams(trials: int, rng: random.Random) -> list[bool]:
    """Saves into a file opened to append ("a+b") and rewound anywhere: compared where the writes land, a match."""
    from shadow.core.model import live_targets

    held = []
    with tempfile.TemporaryDirectory() as directory:
        for index in range(trials):
            path = os.path.join(directory, f"{index}.log")
            with open(path, "wb") as first:
                first.write(os.urandom(rng.randint(0, 300)))
            with shadow.install([live_targets.torch_save()], sample_rate=1.0, budget=None, deadline=None) as monitor:
                with open(path, "a+b") as stream:
                    stream.seek(rng.randint(0, 300))
                    torch.save({"w": torch.randn(rng.randint(1, 64))}, stream)
                stats = monitor.stats()["torch_save"]
            held.append(stats.match == 1)
    return held


def _census_cache(trials: int, rng: random.Random) -> list[bool]:
    """A census cache others can write (refused, exit 2 naming it), a planted name, another wheel's list or a FIFO in
    place of a kept list (never trusted, never waited on: taken again)."""
    import shutil

    from torch_npu_wheels import wheel

    from shadow.analysis import census_cache

    held = []
    with tempfile.TemporaryDirectory() as directory:
        wheels = os.path.join(directory, "wheels")
        os.makedirs(wheels)
        shutil.copy(wheel("2.14.0"), wheels)
        shutil.copytree(os.path.join(os.path.dirname(wheel("2.14.0")), "..", "census"),
                        os.path.join(directory, "census"))  # fmt: skip
        os.environ["NPU_SHADOW_WHEEL_DIR"] = wheels
        try:
            listed = census_cache.patch_list("2.14.0")
            honest = json.loads(listed.read_text())
            for _ in range(trials):
                kind = rng.choice(["planted", "other wheel", "fifo", "open folder"])
                listed.unlink()
                if kind == "fifo":
                    os.mkfifo(listed)
                else:
                    planted = {**honest, "patches": [*honest["patches"], "builtins.print"]}
                    if kind == "other wheel":
                        planted["wheel_sha256"] = "0" * 64
                    listed.write_text(json.dumps(planted))
                    os.chmod(listed, 0o666 if kind == "planted" else 0o600)
                if kind == "open folder":
                    os.chmod(listed.parent, 0o777)
                    done = subprocess.run(
                        [sys.executable, "-m", "shadow", "run", "--legacy-from", "2.14.0", "--", "true"],
                        capture_output=True, text=True, timeout=120, cwd=ROOT,
                    )  # fmt: skip
                    os.chmod(listed.parent, 0o700)
                    held.append(done.returncode == 2 and str(listed.parent) in done.stderr)
                    listed.unlink()
                    census_cache.patch_list("2.14.0")
                    continue
                found: list = []
                listing = lambda f=found: f.append(census_cache.patch_list("2.14.0"))  # noqa: E731
                worker = threading.Thread(target=listing, daemon=True)
                worker.start()
                worker.join(60)
                held.append(bool(found) and json.loads(found[0].read_text()) == honest)
        finally:
            del os.environ["NPU_SHADOW_WHEEL_DIR"]
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
        "torch_load": lambda: _torch_load(80 // n, rng),
        "module_to": lambda: _module_to(30 // n, rng),
        "census": lambda: _census(16 // n, rng),
        "linger": lambda: _linger(2 if not args.quick else 1),
        "verdict inputs": lambda: _verdict_inputs(14 // n, rng),
        "counted 2.13.0": lambda: _counted_places("2.13.0"),
        "counted 2.14.0": lambda: _counted_places("2.14.0"),
        "env saves": lambda: _environment_saves(40 // n, rng),
        "setting threads": lambda: _settings_threads(40 // n, rng),
        "pickled once": lambda: _pickled_once(40 // n, rng),
        "append streams": lambda: _append_streams(30 // n, rng),
        "census cache": lambda: _census_cache(12 // n, rng),
    }
    tried = held = 0
    for name, run in surfaces.items():
        results = run()
        tried += len(results)
        held += sum(results)
        print(f"{name:<16} tried {len(results):>4}  held {sum(results):>4}", flush=True)
    print(f"{'all':<16} tried {tried:>4}  held {held:>4}")
    return 0 if tried == held else 1


if __name__ == "__main__":
    torch.manual_seed(0)
    sys.exit(main())
