"""Thread safety of the wrapper, and torch.compile seeing legacy alone."""

import json
import os
import subprocess
import sys
import threading

import pytest
import torch

import shadow

THREADS, CALLS = 8, 10_000


@pytest.mark.slow
def test_eight_threads_hammering_type_count_exactly(fake_torch_npu):
    errors = []
    barrier = threading.Barrier(THREADS)
    monitor = shadow.install(["tensor_type"], sample_rate=0.05, seed=5)

    def hammer(i):
        x = torch.ones(2)
        try:
            barrier.wait()
            for n in range(CALLS):
                out = x.type(torch.float64 if n % 2 else "torch.FloatTensor")
                assert out.dtype == (torch.float64 if n % 2 else torch.float32)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=hammer, args=(i,)) for i in range(THREADS)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        stats = monitor.stats()["tensor_type"]
        monitor.uninstall()
    assert errors == []
    assert stats.calls == THREADS * CALLS
    assert stats.sampled == stats.match + stats.close + stats.mismatch + stats.error + stats.skipped
    assert stats.match == stats.sampled > 0.02 * THREADS * CALLS
    assert stats.mismatch == stats.error == stats.skipped == 0


COMPILE_SCRIPT = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import torch
import torch_npu  # the fake: patches Tensor.type
import shadow

monitor = None
if sys.argv[2] == "shadowed":
    monitor = shadow.install(["tensor_type"], sample_rate=1.0)
    assert "torch._dynamo" not in sys.modules  # installing must not pay for importing dynamo

from torch._dynamo.utils import counters

def step(x):
    y = (x * 2).type(torch.float16)
    z = y.type("torch.npu.FloatTensor")
    return z + 1, z.type()

compiled = torch.compile(step, backend="eager")
outs = [compiled(torch.full((3,), float(i))) for i in range(10)]
eager = [step(torch.full((3,), float(i))) for i in range(10)]
assert all(torch.equal(a[0], b[0]) and a[1] == b[1] for a, b in zip(outs, eager))
print(json.dumps({
    "graphs": counters["stats"]["unique_graphs"],
    "frames": counters["stats"]["calls_captured"],
    "breaks": sum(counters["graph_break"].values()),
    "stats": {k: vars(v) for k, v in monitor.stats().items()} if monitor else None,
}, default=dict))
"""


def run_compile(mode):
    fake = os.path.join(os.path.dirname(__file__), "fake_torch_npu")
    done = subprocess.run(
        [sys.executable, "-c", COMPILE_SCRIPT, fake, mode], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_compiled_code_sees_legacy_alone():
    legacy = run_compile("legacy")
    shadowed = run_compile("shadowed")
    assert (shadowed["graphs"], shadowed["frames"], shadowed["breaks"]) == (
        legacy["graphs"],
        legacy["frames"],
        legacy["breaks"],
    )
    stats = shadowed["stats"]["tensor_type"]
    # Calls that reach the wrapper while dynamo traces are never shadowed ("compiling"); the rest are
    # eager calls (the 30 of the eager loop, and what dynamo left to run eagerly), all compared.
    assert stats["calls"] >= 30 and stats["sampled"] == stats["calls"]
    assert stats["skipped"] == stats["by_reason"].get("compiling", 0)


@pytest.mark.parametrize("deadline", [60, None])
def test_a_job_thread_started_while_an_upstream_run_is_under_way_is_the_jobs(deadline):
    """The job's own threads, started one after another (legacy's replicas), call a target: the first thread's
    call is sampled and its upstream run is slow; the second thread starts meanwhile. It is the job's: its call is
    counted and compared, and it gets legacy's result, never upstream's (it once was taken for a thread of the
    first call's upstream run: upstream's result, and not counted)."""
    import threading
    import time
    import types

    started = threading.Event()

    def slow_upstream(x):
        started.set()
        time.sleep(0.5)
        return x * 3

    ops = types.SimpleNamespace(op=lambda x: x * 2)
    target = shadow.Target("op", ops, "op", slow_upstream)
    results = {}

    def job_thread(name):
        results[name] = ops.op(torch.ones(1)).item()

    with shadow.install([target], sample_rate=1.0, budget=None, deadline=deadline) as monitor:
        first = threading.Thread(target=job_thread, args=("first",))
        first.start()
        assert started.wait(30)  # (deadline: the first call's upstream run is under way)
        second = threading.Thread(target=job_thread, args=("second",))
        second.start()
        first.join()
        second.join()
        stats = monitor.stats()["op"]
    assert results == {"first": 2.0, "second": 2.0}
    assert stats.calls == 2 and stats.mismatch == 2


EXIT_SCRIPT = r"""
import atexit, sys, threading

def left_at_finalization():  # (registered first, so it runs after every handler of npu-shadow's)
    print(sorted(t.name for t in threading.enumerate() if t.name.startswith("npu-shadow")))

atexit.register(left_at_finalization)
sys.path.insert(0, sys.argv[1])
import torch
import torch_npu  # the fake: patches Tensor.type
import shadow
from exporters.prometheus import PrometheusExporter

monitor = shadow.install(["tensor_type"], sample_rate=1.0, exporters=[PrometheusExporter()])
x = torch.ones(3)
for _ in range(5):
    x.type(torch.float16).type("torch.DoubleTensor")  # (casts: their upstream side runs on a room)
assert monitor.stats()["tensor_type"].match == 10
"""


@pytest.mark.slow
def test_no_shadow_thread_is_left_when_the_interpreter_finalizes():
    # A daemon thread still there at finalization is ended wherever it next takes the GIL; one whose stack holds
    # C++ frames (a room started under torch.compile's frame hook) aborts the process: "terminate called without
    # an active exception", exit -6, after the job's work was done.
    fake = os.path.join(os.path.dirname(__file__), "fake_torch_npu")
    done = subprocess.run([sys.executable, "-c", EXIT_SCRIPT, fake], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_the_thread_start_hook_is_installed_with_the_monitor_and_put_back_by_the_last():
    """Threads an upstream run starts inherit its run through threading's own thread-start function, wrapped: only
    while a monitor is installed, and threading's own is back once the last monitor is uninstalled (importing the
    call path changes nothing)."""
    from shadow.npu import reference

    name = "_start_joinable_thread" if hasattr(threading, "_start_joinable_thread") else "_start_new_thread"
    before = getattr(threading, name)  # (threading's own, or ours where a monitor is installed already: a plugin's)
    own = getattr(before, "__wrapped__", before)
    patches = reference.patch_torch()
    try:
        with shadow.install(["tensor_type"]):
            assert getattr(threading, name).__wrapped__ is own
            second = shadow.install(["parallel_apply"], sample_rate=0.0)
            second.uninstall()
            assert getattr(threading, name).__wrapped__ is own  # (one monitor is still installed)
        assert getattr(threading, name) is before
    finally:
        patches.undo()
