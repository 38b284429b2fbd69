"""Isolation under attack: the truth run never touches training, a job's threads always get legacy's result, a
kept worker holds nothing of its last run, and the memory check reads the limits that apply."""

import ctypes
import gc
import threading
import types
import weakref

import pytest
import torch
from fakes import Recorder
from torch import nn

import shadow
from shadow import Target
from shadow.core.support import memory


def _noisy_target(owner, legacy):
    """``owner.op(module, x)``: legacy the module's forward, upstream the same with a value difference (a truth
    run follows every such call at truth_rate 1)."""

    def upstream(module, x):
        return module(x) * (1 + 1e-3)

    owner.op = legacy
    return Target("op", owner, "op", upstream)


# --------------------------------------------------------------------------- 1. the truth run and the caller's state


def _batchnorm_calls(dtype, truth_rate):
    torch.manual_seed(0)
    module = nn.BatchNorm1d(4).to(dtype).train()
    owner = types.SimpleNamespace()
    target = _noisy_target(owner, lambda m, x: m(x))
    recorder = Recorder()
    inputs = [torch.randn(8, 4, dtype=dtype) for _ in range(5)]
    with shadow.install([target], sample_rate=1.0, exporters=[recorder], truth_rate=truth_rate, seed=0):
        for x in inputs:
            owner.op(module, x)
    return module, recorder


def test_a_truth_run_never_writes_the_callers_module_state():
    for dtype in (torch.float32, torch.float64):
        unwrapped, _ = _batchnorm_calls(dtype, truth_rate=0.0)
        module, recorder = _batchnorm_calls(dtype, truth_rate=1.0)
        assert any(o.nearer for o in recorder.observations), "the truth runs ran"
        assert int(module.num_batches_tracked) == 5
        for name, tensor in unwrapped.state_dict().items():
            assert torch.equal(module.state_dict()[name], tensor), (dtype, name)


def test_a_truth_run_whose_host_copies_would_not_fit_is_not_run(monkeypatch):
    monkeypatch.setattr(memory, "host_free_bytes", lambda: 16 << 20)  # the copies need 2 x 8 MiB
    module = nn.Linear(1024, 1024).double()
    owner = types.SimpleNamespace()
    target = _noisy_target(owner, lambda m, x: m(x))
    recorder = Recorder()
    with shadow.install([target], sample_rate=1.0, exporters=[recorder], truth_rate=1.0, seed=0):
        owner.op(module, torch.randn(2, 1024, dtype=torch.float64))
    (observation,) = recorder.observations
    assert observation.outcome in ("close", "mismatch") and not observation.nearer


# --------------------------------------------------------------------------- 2. a job's thread during an upstream run


def test_a_daemon_thread_the_job_starts_during_an_upstream_run_gets_legacys_result():
    owner = types.SimpleNamespace()
    started = threading.Event()
    release = threading.Event()

    def legacy(x):
        return 2.0

    def upstream(x):
        if x == "slow":
            started.set()
            release.wait(10)
        return 3.0

    owner.op = legacy
    target = Target("op", owner, "op", upstream, isolate=False)
    results = []
    with shadow.install([target], sample_rate=1.0, deadline=None) as monitor:
        caller = threading.Thread(target=lambda: owner.op("slow"), daemon=True)
        caller.start()
        assert started.wait(10)
        job_thread = threading.Thread(target=lambda: results.append(owner.op("fast")), daemon=True)
        job_thread.start()
        job_thread.join(10)
        release.set()
        caller.join(10)
        stats = monitor.experiment("op").stats()
    assert results == [2.0]
    assert stats.calls == 2


def test_a_thread_the_upstream_run_starts_is_the_upstream_runs():
    owner = types.SimpleNamespace()
    seen = []

    def legacy(x):
        return "legacy"

    def upstream(x):
        if x == "outer":  # (upstream calling its own target on a thread it starts: upstream's again)
            worker = threading.Thread(target=lambda: seen.append(owner.op("inner")), daemon=False)
            worker.start()
            worker.join()
        return "upstream"

    owner.op = legacy
    target = Target("op", owner, "op", upstream, isolate=False)
    with shadow.install([target], sample_rate=1.0) as monitor:
        assert owner.op("outer") == "legacy"
        stats = monitor.experiment("op").stats()
    assert seen == ["upstream"]
    assert stats.calls == 1


# --------------------------------------------------------------------------- 3. a kept room holds nothing


class Big(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(64, 64)

    def forward(self, x):
        return self.linear(x)


def test_a_room_kept_between_runs_holds_no_reference_of_its_last_run():
    owner = types.SimpleNamespace()
    made = []

    def upstream(module, x):
        out = module(x)
        made.append(weakref.ref(out))
        return out

    owner.op = lambda module, x: module(x)
    target = Target("op", owner, "op", upstream)
    module = Big()
    for backward_rate in (0.0, 1.0):
        made.clear()
        x = torch.randn(8, 64, requires_grad=True)
        with shadow.install([target], sample_rate=1.0, backward_rate=backward_rate, seed=0):
            owner.op(module, x).sum().backward()
            gc.collect()
            assert made and made[0]() is None, f"a room still holds upstream's result (backward_rate {backward_rate})"


# --------------------------------------------------------------------------- 4. memory limits


def _cgroup_tree(tmp_path, lines, files):
    (tmp_path / "self_cgroup").write_text("\n".join(lines) + "\n")
    for relative, text in files.items():
        path = tmp_path / "fs" / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return str(tmp_path / "self_cgroup"), str(tmp_path / "fs")


def test_a_cgroup_v1_memory_limit_is_seen(tmp_path, monkeypatch):
    proc, root = _cgroup_tree(
        tmp_path,
        ["12:memory:/job", "3:cpu,cpuacct:/job"],
        {"memory/job/memory.limit_in_bytes": "1073741824\n", "memory/job/memory.usage_in_bytes": "1040187392\n"},
    )
    monkeypatch.setattr(memory, "PROC_SELF_CGROUP", proc)
    monkeypatch.setattr(memory, "CGROUP_ROOT", root)
    assert memory.host_free_bytes() == 1073741824 - 1040187392


def test_a_cgroup_v2_limit_of_the_processs_own_cgroup_is_seen(tmp_path, monkeypatch):
    proc, root = _cgroup_tree(
        tmp_path, ["0::/jobs/one"], {"jobs/one/memory.max": "2097152000\n", "jobs/one/memory.current": "2000000000\n"}
    )
    monkeypatch.setattr(memory, "PROC_SELF_CGROUP", proc)
    monkeypatch.setattr(memory, "CGROUP_ROOT", root)
    assert memory.host_free_bytes() == 97152000


def test_a_sampled_call_whose_copies_pass_a_cgroup_v1_limit_is_skipped(tmp_path, monkeypatch):
    proc, root = _cgroup_tree(
        tmp_path,
        ["9:memory:/"],
        {"memory/memory.limit_in_bytes": str(40 << 20), "memory/memory.usage_in_bytes": str(30 << 20)},
    )
    monkeypatch.setattr(memory, "PROC_SELF_CGROUP", proc)
    monkeypatch.setattr(memory, "CGROUP_ROOT", root)
    owner = types.SimpleNamespace(op=lambda x: x * 2)
    target = Target("op", owner, "op", lambda x: x * 2)
    recorder = Recorder()
    x = torch.ones(2 << 20)  # 8 MiB: its copy is over half of the 10 MiB left
    with shadow.install([target], sample_rate=1.0, exporters=[recorder]):
        assert torch.equal(owner.op(x), x * 2)
    assert [(o.outcome, o.reasons) for o in recorder.observations] == [("skipped", ("oom",))]


# --------------------------------------------------------------------------- 7. a journal torn by a crash


def test_a_job_restarted_after_a_torn_line_keeps_every_record_readable(tmp_path):
    import json

    import journals

    from exporters import JsonlExporter
    from shadow.analysis import sources

    path = tmp_path / "j.jsonl"
    whole = json.dumps(journals.line()) + "\n"
    path.write_text(json.dumps(journals.header()) + "\n" + whole * 3 + whole[:30])  # killed mid-line
    owner = types.SimpleNamespace(op=lambda x: x + 1)
    target = Target("op", owner, "op", lambda x: x + 1, isolate=False)
    journal = JsonlExporter(str(path), all_outcomes=True)
    with shadow.install([target], sample_rate=1.0, exporters=[journal]):
        for i in range(4):
            owner.op(torch.tensor([float(i)]))
    journal.close()
    lines = path.read_bytes().split(b"\n")
    assert lines[4] == whole[:30].encode()  # (the torn line ended, on its own)
    torn = []
    counts = sources.from_journal([str(path)], torn, all_runs=True)  # (the crashed run and the restarted one)
    assert counts["op"].compared == 3 + 4
    assert torn == [f"{path}:5"]


def test_the_verdict_reads_past_a_torn_line_in_the_middle(tmp_path):
    import json

    import journals

    from shadow.analysis import sources

    path = tmp_path / "j.jsonl"
    whole = json.dumps(journals.line()) + "\n"
    path.write_text(json.dumps(journals.header()) + "\n" + whole * 2 + whole[:30] + whole * 2)  # (appended after)
    torn = []
    assert sources.from_journal([str(path)], torn)["op"].compared == 4
    assert torn == [f"{path}:4"]


# --------------------------------------------------------------------------- 6. installs over a hanging upstream


def test_an_upstream_holding_the_gil_holds_the_job_once():
    """C code that keeps the GIL cannot be left at the deadline (the caller's wait needs the GIL to return); the run
    ends past its deadline and is found finished, yet it counts as past it: the target stops, and no later call
    is held. (Before, it was compared, and the next sampled calls were held again.)"""
    keeps_the_gil = ctypes.PyDLL(None)  # (a PyDLL call keeps the GIL while it runs)
    runs = []
    owner = types.SimpleNamespace(op=lambda x: x)

    def holds_the_gil(x):
        runs.append(x)
        keeps_the_gil.usleep(400_000)
        return x

    with shadow.install([Target("op", owner, "op", holds_the_gil, isolate=False)], sample_rate=1.0, deadline=0.1,
                        seed=0) as monitor:  # fmt: skip
        assert [owner.op(i) for i in range(4)] == [0, 1, 2, 3]
        stats = monitor.experiment("op").stats()
    assert runs == [0]
    assert stats.by_reason == {"deadline": 4} and stats.compared == 0


def test_installs_over_a_hanging_upstream_leave_one_thread_behind_not_one_each():
    release = threading.Event()
    owner = types.SimpleNamespace()

    def hangs(x):
        release.wait(60)
        return x

    owner.op = lambda x: x
    target = Target("op", owner, "op", hangs, isolate=False)
    try:
        before = threading.active_count()
        for _ in range(20):
            with shadow.install([target], sample_rate=1.0, deadline=0.05, seed=0) as monitor:
                assert owner.op(1) == 1
                stats = monitor.experiment("op").stats()
        assert threading.active_count() - before <= 1
        assert stats.by_reason == {"deadline": 1}  # (the last install: not run again beside the one left behind)
    finally:
        release.set()


# --------------------------------------------------------------------------- 8. a signature function's side effects


@pytest.mark.parametrize("sample_rate", [0.0, 1.0])
@pytest.mark.parametrize("effect", ["torch", "python", "numpy", "grad"])
def test_a_signature_function_with_side_effects_changes_no_training(sample_rate, effect):
    """A user's signature function that draws a random number (or turns grad off) runs on the job's own path: it
    shifted the job's random stream, at rate 0 too. Its first call is checked, put back, and it runs no more."""
    import random

    import numpy as np

    def signature(args, kwargs):
        {"torch": lambda: torch.rand(1), "python": random.random, "numpy": np.random.rand,
         "grad": lambda: torch.set_grad_enabled(False)}[effect]()  # fmt: skip
        return "s"

    def job(owner):
        torch.manual_seed(0), random.seed(0), np.random.seed(0)
        values = [owner.op(torch.ones(1)) for _ in range(40)]
        return values, torch.rand(1).item(), random.random(), float(np.random.rand()), torch.is_grad_enabled()

    unwrapped = job(types.SimpleNamespace(op=lambda x: x + 1))
    owner = types.SimpleNamespace(op=lambda x: x + 1)
    target = Target("op", owner, "op", lambda x: x + 1, signature=signature, isolate=False)
    with shadow.install([target], sample_rate=sample_rate, seed=1) as monitor:
        shadowed = job(owner)
        stats = monitor.experiment("op").stats()
    assert shadowed[1:] == unwrapped[1:] and all(torch.equal(a, b) for a, b in zip(shadowed[0], unwrapped[0]))
    assert dict(stats.signature_calls) == {"unclassified": 40}


def test_the_signature_check_is_never_traced_by_dynamo(monkeypatch):
    """While dynamo traces the wrapper (at a graph break inside legacy) the check's own reads of the generators would
    be traced too (a graph break and a warning at each): the signature function is called plain there."""
    from shadow.core.calls.gate import coverage as classifier

    checked = []
    real = classifier.call_without_side_effects
    monkeypatch.setattr(classifier, "call_without_side_effects", lambda f, *a: checked.append(f) or real(f, *a))
    owner = types.SimpleNamespace(op=lambda x: x + 1)
    target = Target("op", owner, "op", lambda x: x + 1, signature=lambda a, k: "s", isolate=False)
    with shadow.install([target], sample_rate=0.0, seed=1):
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
        owner.op(torch.ones(1))
        assert checked == []
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
        owner.op(torch.ones(1))
        assert len(checked) == 1
