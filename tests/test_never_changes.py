"""Promise 1 at its edges: what the shadow side does (raise anything, change global or module state) never
reaches the job."""

import types

import pytest
import torch
from fakes import Recorder, op_target

import shadow
from shadow import Target


def twice(x):
    return x * 2


@pytest.mark.parametrize("error", [SystemExit(3), GeneratorExit(), StopIteration()])
def test_anything_upstream_raises_is_counted_and_swallowed(error):
    def upstream(x):
        raise error

    ops, target = op_target(upstream)
    with shadow.install([target], sample_rate=1.0) as monitor:
        assert torch.equal(ops.op(torch.ones(2)), torch.full((2,), 2.0))
    stats = monitor.stats()["op"]
    assert stats.error == 1 and stats.by_reason == {"exception": 1}


@pytest.mark.parametrize("error", [SystemExit(3), GeneratorExit()])
def test_an_exporter_or_a_signature_raising_anything_is_counted_and_swallowed(error):
    class Raising:
        def export(self, observation):
            raise error

    def signature(args, kwargs):
        raise error

    ops, target = op_target(twice)
    with shadow.install([target], sample_rate=1.0, exporters=[Raising()]) as monitor:
        ops.op(torch.ones(2))
    assert monitor.stats()["op"].by_reason == {} and monitor.stats()["op"].export_errors == 1
    ops, target = op_target(twice, signature=signature)
    with shadow.install([target], sample_rate=1.0, first_per_signature=0) as monitor:
        ops.op(torch.ones(2))
    assert monitor.stats()["op"].by_reason == {"comparator": 1}
    with shadow.install([target], sample_rate=1.0) as monitor:  # coverage-guided: classified "unclassified"
        ops.op(torch.ones(2))
    assert monitor.stats()["op"].signature_calls == {"unclassified": 1} and monitor.stats()["op"].match == 1


def test_arguments_the_monitor_cannot_read_skip_the_call_and_the_job_gets_its_result():
    """``copy.deepcopy``'s memo holds the copies made so far, a module among them before its ``__init__`` state is
    set: reading the call's modules raises, which must be a counted skip, never the job's exception."""
    half_built = torch.nn.BatchNorm1d.__new__(torch.nn.BatchNorm1d)  # (as deepcopy makes it, before __setstate__)

    def doubled(x, memo):
        return x * 2

    ops = types.SimpleNamespace(op=doubled)
    with shadow.install([Target("op", ops, "op", doubled)], sample_rate=1.0) as monitor:
        assert torch.equal(ops.op(torch.ones(2), {id(half_built): half_built}), torch.full((2,), 2.0))
    assert monitor.stats()["op"].by_reason == {"comparator": 1}


def test_keyboard_interrupt_still_stops_the_job():
    def upstream(x):
        raise KeyboardInterrupt

    ops, target = op_target(upstream)
    with shadow.install([target], sample_rate=1.0), pytest.raises(KeyboardInterrupt):
        ops.op(torch.ones(2))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"sample_rate": 1.5}, "sample_rate: expected a number in"),
        ({"sample_rate": {"tensor_type": 2}}, r"sample_rate\['tensor_type'\]: expected a number in"),
        ({"sample_rate": {"nope": 0.5}}, r"sample_rate: unknown target\(s\) \['nope'\]"),
        ({"tolerance": "tight"}, "tolerance"),
    ],
)
@pytest.mark.filterwarnings("ignore:npu-shadow. no torch_npu patch is active")  # (it says so: tested elsewhere)
def test_bad_arguments_fail_even_where_no_target_is_active(kwargs, message):
    assert shadow.install().targets == ()  # nothing active in this process
    with pytest.raises(ValueError, match=message):
        shadow.install(**kwargs)


def test_an_exporter_that_raises_on_attribute_lookup_is_a_value_error():
    class Hostile:
        def __getattr__(self, name):
            raise RuntimeError("no attributes here")

    _, target = op_target(twice)
    with pytest.raises(ValueError, match="exporters: Hostile raised looking up its hooks"):
        shadow.install([target], exporters=[Hostile()])


def test_a_per_target_rate_may_name_a_target_whose_legacy_comes_later():
    from shadow.npu import reference

    assert shadow.install(sample_rate={"tensor_type": 0.5}).targets == ()
    patches = reference.patch_torch()
    try:
        with shadow.install(sample_rate={"tensor_type": 0.5}) as monitor:
            assert monitor.experiment("tensor_type").sampling.sampler.rate == 0.5
    finally:
        patches.undo()


def test_signatures_per_target_are_capped_and_the_overflow_is_counted(caplog):
    from shadow.core.calls.gate.coverage import MAX_SIGNATURES

    recorder = Recorder()
    ops, target = op_target(twice, signature=lambda args, kwargs: f"shape{args[0].shape[0]}")
    with shadow.install([target], sample_rate=1.0, exporters=[recorder]) as monitor:
        for n in range(1, 5002):
            ops.op(torch.ones(n))
    signatures = {o.signature for o in recorder.observations}
    assert len(signatures) == MAX_SIGNATURES + 1 and "other" in signatures
    assert monitor.stats()["op"].signatures_over_cap == 5001 - MAX_SIGNATURES
    assert any("the rest count as 'other'" in r.getMessage() for r in caplog.records)


GLOBAL_SETTERS = {
    "default_dtype": (lambda: torch.set_default_dtype(torch.float64), lambda: (torch.get_default_dtype(),
                                                                               torch.rand(1).dtype)),
    "default_device": (lambda: torch.set_default_device("meta"), lambda: torch.rand(1).device),
    "autocast_enabled": (lambda: torch.set_autocast_enabled("cpu", True), lambda: torch.is_autocast_enabled("cpu")),
    "autocast_dtype": (lambda: torch.set_autocast_dtype("cpu", torch.float16), lambda: torch.get_autocast_dtype("cpu")),
    "npu_autocast": (lambda: torch.set_autocast_enabled("npu", True), lambda: torch.is_autocast_enabled("npu")),
    "deterministic": (lambda: torch.use_deterministic_algorithms(True),
                      lambda: torch.are_deterministic_algorithms_enabled()),
    "matmul_precision": (lambda: torch.set_float32_matmul_precision("medium"),
                         lambda: torch.get_float32_matmul_precision()),
    "threads": (lambda: torch.set_num_threads(torch.get_num_threads() + 1), lambda: torch.get_num_threads()),
    "anomaly": (lambda: torch.autograd.set_detect_anomaly(True), lambda: torch.is_anomaly_enabled()),
    "printoptions": (lambda: torch.set_printoptions(precision=1), lambda: str(torch.tensor([1.23456]))),
    "current_device": (lambda: torch.accelerator.set_device_index(1), lambda: torch.accelerator.current_device_index()),
}  # fmt: skip


@pytest.mark.parametrize("setting", sorted(GLOBAL_SETTERS))
def test_global_torch_state_set_by_upstream_never_reaches_the_job(setting):
    change, read = GLOBAL_SETTERS[setting]

    def upstream(x):
        change()
        return x * 2

    ops, target = op_target(upstream)
    torch.accelerator.set_device_index(0)
    before = read()
    with shadow.install([target], sample_rate=1.0) as monitor:
        ops.op(torch.ones(2))
        assert read() == before
    # what upstream leaves behind is behaviour: compared (and a difference) but never the job's
    assert monitor.stats()["op"].mismatch == 1 and monitor.stats()["op"].by_reason == {"state": 1}


@pytest.mark.parametrize("setting", ["anomaly", "autocast_enabled", "default_dtype", "deterministic",
                                     "matmul_precision", "printoptions"])  # fmt: skip
def test_a_setting_upstreams_backward_changes_reaches_neither_legacys_next_run_nor_the_job(setting):
    """The backward comparison's runs come one after another (legacy's own graph, upstream's products, legacy's
    second graph for the gradients' floor, then the job's own backward): each run of legacy's backward sees the
    settings legacy started from, whatever upstream's backward wrote before it, and so does the job's."""
    change, read = GLOBAL_SETTERS[setting]
    seen = []

    class Doubled(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, writes):
            ctx.writes = writes
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            if ctx.writes:
                change()
            else:
                seen.append(read())
            return grad * 2, None

    ops = types.SimpleNamespace(op=lambda x: Doubled.apply(x, False))
    target = Target("op", ops, "op", lambda x: Doubled.apply(x, True))
    before = read()
    with shadow.install([target], sample_rate=1.0, aa_rate=1.0, backward_rate=1.0, seed=1) as monitor:
        ops.op(torch.ones(2, requires_grad=True)).sum().backward()
        assert read() == before
    assert seen == [before] * 3  # (legacy's two graphs, then the job's)
    assert monitor.stats()["op"].backward_runs == 1


MODULE_CHANGES = {
    "eval": lambda m: m.eval(),
    "register_buffer": lambda m: m[0].register_buffer("planted", torch.zeros(1)),
    "register_parameter": lambda m: m.register_parameter("planted", torch.nn.Parameter(torch.zeros(1))),
    "forward_hook": lambda m: m[0].register_forward_hook(lambda *a: None),
    "forward_pre_hook": lambda m: m.register_forward_pre_hook(lambda *a: None),
    "add_module": lambda m: m.add_module("planted", torch.nn.ReLU()),
    "global_hook": lambda m: torch.nn.modules.module.register_module_forward_hook(lambda *a: None),
    "buffer_replaced": lambda m: setattr(m[1], "running_mean", torch.full((3,), 7.0)),
}


@pytest.mark.parametrize("change", sorted(MODULE_CHANGES))
def test_changes_upstream_makes_to_the_module_never_reach_the_job(change):
    def run(module, x):
        return module(x)

    def upstream(module, x):
        MODULE_CHANGES[change](module)
        return module(x)

    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3))
    ops = types.SimpleNamespace(op=run)

    with shadow.install([Target("op", ops, "op", upstream)], sample_rate=1.0) as monitor:
        ops.op(model, torch.randn(4, 3))
    stats = monitor.stats()["op"]
    assert stats.sampled == 1 and stats.error == stats.skipped == 0  # upstream ran (eval may change its values)
    assert [m.training for m in model.modules()] == [True, True, True]
    assert [(set(m._parameters), set(m._buffers), len(m._forward_hooks), len(m._forward_pre_hooks), tuple(m._modules))
            for m in model.modules()] == [
        (set(), set(), 0, 0, ("0", "1")),
        ({"weight", "bias"}, set(), 0, 0, ()),
        ({"weight", "bias"}, {"running_mean", "running_var", "num_batches_tracked"}, 0, 0, ()),
    ]  # fmt: skip
    global_hooks = [n for n in vars(torch.nn.modules.module) if n.startswith("_global_") and "hooks" in n]
    assert all(len(getattr(torch.nn.modules.module, n)) == 0 for n in global_hooks)
    assert model[1].running_mean.abs().max() < 7.0  # the job's running stats, not the planted ones


def seen_by_user_code(shadowed):
    """What a counting TorchFunctionMode, a subclass's __torch_function__ and a TorchDispatchMode each see of one
    x.type(torch.float64), with or without the monitor (over the reference legacy)."""
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    from shadow.npu import reference

    seen = {"function_mode": 0, "subclass": 0, "dispatch_mode": 0}

    class CountingFunctions(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen["function_mode"] += 1
            return func(*args, **(kwargs or {}))

    class CountingDispatch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen["dispatch_mode"] += 1
            return func(*args, **(kwargs or {}))

    class Counted(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            if func is torch.Tensor.type:
                seen["subclass"] += 1
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))

    patches = reference.patch_torch()
    monitor = shadow.install(["tensor_type"], sample_rate=1.0) if shadowed else None
    try:
        with CountingFunctions():
            torch.arange(3.0).type(torch.float64)
        torch.arange(3.0).as_subclass(Counted).type(torch.float64)
        with CountingDispatch():
            torch.arange(3.0).type(torch.float64)
        stats = monitor.stats()["tensor_type"] if monitor else None
    finally:
        if monitor:
            monitor.uninstall()
        patches.undo()
    return seen, stats


def test_modes_and_subclasses_see_what_they_see_unwrapped():
    plain, _ = seen_by_user_code(shadowed=False)
    shadowed, stats = seen_by_user_code(shadowed=True)
    assert shadowed == plain
    assert stats.calls == 3 and stats.skipped == 3 and stats.by_reason == {"mode": 3}
    assert stats.compared == 0  # nothing counted as evidence that compared nothing


def test_under_a_device_context_calls_are_compared_once_and_meta_values_never_count_as_matches():
    """A default device is torch's own mode: upstream runs under it and the call is compared. Meta tensors have
    no values, so equal metadata is at best close."""
    from shadow.npu import reference

    patches = reference.patch_torch()
    try:
        with shadow.install(["tensor_type"], sample_rate=1.0) as monitor, torch.device("meta"):
            torch.ones(2).type(torch.float64)
            torch.ones(2).type(torch.float16)
    finally:
        patches.undo()
    stats = monitor.stats()["tensor_type"]
    assert (stats.calls, stats.match, stats.close, stats.skipped, stats.by_reason) == (2, 0, 2, 0, {})


def test_a_slow_upstream_costs_one_call_then_the_budget_skips_until_the_job_catches_up():
    import fakes

    from shadow.core.calls.gate.budget import Budgets

    clock, ran = fakes.Clock(), []

    def slow(x):
        ran.append(x)
        clock.advance(0.6)  # (more than the 0.5 s of shadow side a target may save up)
        return x * 2

    ops, target = op_target(slow)
    recorder = Recorder()
    budget = Budgets.of(0.1, clock)
    with shadow.install([target], sample_rate=1.0, budget=budget, exporters=[recorder]) as monitor:
        ops.op(torch.ones(2))  # the one slow call: 0.6 s of shadow side
        for _ in range(20):
            ops.op(torch.ones(2))
        monitor.flush()
    stats = monitor.stats()["op"]
    assert len(ran) == 1  # none of the 20 waited for upstream (0.6 s each): it never ran for them
    assert stats.calls == 21 and stats.match == 1 and stats.by_reason == {"budget": 20}
    assert len(recorder.observations) == 1  # skipped calls were not handed to exporters one by one


def test_a_slow_exporter_never_holds_up_a_sampled_call():
    """An exporter ran on the caller's thread: a slow one held every sampled call (the budget then refused the
    rest). Now the records wait for the exporters, which take them on the reporter's thread: the job's 20 calls
    return while the exporter is stuck in its first export, and every one is compared and exported after."""
    import threading

    from prometheus_client import CollectorRegistry, generate_latest

    from exporters import PrometheusExporter

    stuck, release = threading.Event(), threading.Event()

    class Stuck:
        exported = 0

        def export(self, observation):
            stuck.set()
            assert release.wait(60), "never released"
            Stuck.exported += 1

    prometheus = PrometheusExporter(registry=CollectorRegistry())
    ops, target = op_target(twice)
    with shadow.install([target], sample_rate=1.0, budget=0.1, exporters=[Stuck(), prometheus]) as monitor:
        ops.op(torch.ones(2))
        assert stuck.wait(60)  # (the reporter took the first record: its export is stuck there)
        for _ in range(19):
            ops.op(torch.ones(2))
        assert Stuck.exported == 0  # (every call returned while the export was stuck)
        release.set()
    stats = monitor.stats()["op"]
    assert Stuck.exported == stats.compared == 20 and stats.skipped == 0
    from metrics_helpers import samples, total

    assert total(samples(generate_latest(prometheus.registry).decode()), "npu_shadow_comparisons_total") == 20


def test_calls_on_threads_that_upstream_starts_are_part_of_the_upstream_run():
    """DataParallel's upstream runs the replicas on threads of its own: their calls are not the job's. There, as
    on the calling thread, the compared target's own calls run upstream and another target's run legacy."""
    import threading

    ops = types.SimpleNamespace()
    ran = []

    def legacy(x, inner=False):
        ran.append(("legacy", inner))
        return x * 2

    def upstream(x, inner=False):
        ran.append(("upstream", inner))
        if not inner:
            worker = threading.Thread(target=lambda: (ops.op(x, inner=True), ops.other(x)))  # like parallel_apply's
            worker.start()
            worker.join()
        return x * 2

    def other_legacy(x):
        ran.append(("other legacy", False))
        return x

    def other_upstream(x):
        ran.append(("other upstream", False))
        return x

    ops.op, ops.other = legacy, other_legacy
    targets = [Target("op", ops, "op", upstream), Target("other", ops, "other", other_upstream)]
    with shadow.install(targets, sample_rate=1.0) as monitor:
        ops.op(torch.ones(2))
    stats = monitor.stats()
    assert (stats["op"].calls, stats["op"].sampled, stats["op"].match, stats["op"].skipped) == (1, 1, 1, 0)
    assert stats["other"].calls == 0
    assert ran == [("legacy", False), ("upstream", False), ("upstream", True), ("other legacy", False)]


def test_the_comparator_neither_sees_nor_changes_the_jobs_numpy_error_settings():
    """The comparator's numpy work on NaN and infinities runs under its own error settings: a job that asked
    numpy to raise on invalid values keeps that setting, and the comparison is still made."""
    import numpy as np

    special = torch.tensor([1.0, float("nan"), float("inf"), -float("inf"), 0.0])
    ops, target = op_target(lambda x: x * 2)
    before = np.seterr(all="raise")
    try:
        with shadow.install([target], sample_rate=1.0) as monitor:
            result = ops.op(special)
        after = np.geterr()
    finally:
        np.seterr(**before)
    assert after == {"divide": "raise", "over": "raise", "under": "raise", "invalid": "raise"}
    assert torch.equal(result[[0, 2, 3, 4]], special[[0, 2, 3, 4]] * 2) and result[1].isnan()
    stats = monitor.stats()["op"]
    assert stats.compared == stats.match == 1 and stats.by_reason == {}  # the same NaN and infinities


@pytest.mark.slow
@pytest.mark.e2e
def test_a_torchscript_job_whose_other_thread_changes_settings_trains_as_unwrapped_under_214(tmp_path):
    """Under ``npu-shadow run --legacy-from 2.14.0`` at rate 1 (its patches counted, its live targets shadowed): a
    job that scripts a model and whose second thread keeps changing process-wide settings trains bitwise as it does
    unwrapped, and none of that thread's changes is undone."""
    import os
    import subprocess
    import sys

    from torch_npu_wheels import wheel

    wheel("2.14.0")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    job = os.path.join(root, "tests", "settings_job.py")
    plain, shadowed = tmp_path / "plain.pt", tmp_path / "shadowed.pt"
    done = subprocess.run([sys.executable, job, str(plain)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    done = subprocess.run(
        [sys.executable, "-m", "shadow", "run", "--emulate-npu", "2", "--legacy-from", "2.14.0", "--sample-rate", "1",
         "--", sys.executable, job, str(shadowed)],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    unwrapped, monitored = torch.load(plain), torch.load(shadowed)
    assert unwrapped["undone"] == 0 and monitored["undone"] == 0, done.stderr[-3000:]
    assert all(torch.equal(a, b) for a, b in zip(unwrapped["parameters"], monitored["parameters"], strict=True))
    rows = {line.split()[0]: line.split()[1:] for line in done.stderr.splitlines() if line.split()[:1] in (
        ["tensor_repr"], ["torch_save"])}  # fmt: skip
    assert set(rows) == {"tensor_repr", "torch_save"}, done.stderr[-3000:]
    for target, (_, _, match, _, mismatch, error, _) in rows.items():
        assert int(match) > 0 and mismatch == error == "0", (target, done.stderr[-3000:])  # (no false divergence)
