"""The job never pays for the monitor: tiny rates, restore failures, memory, disks, signals and hostile files.

Each test names the point of the issue it covers ("holds up" 1-13)."""

import os
import subprocess
import sys
import types

import pytest
import torch

import shadow
from shadow import Target

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def npu_shadow(*args, env=None, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "shadow", *args], capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT
    )


class Recorder:
    def __init__(self):
        self.observations = []

    def export(self, observation):
        self.observations.append(observation)


# --------------------------------------------------------------------------- 2. tiny and huge rates


def test_2_a_tiny_sample_rate_never_crashes_the_job():
    done = npu_shadow(
        "run",
        "--sample-rate",
        "1e-310",
        "--",
        sys.executable,
        "-c",
        "import torch; from shadow.npu import reference; reference.patch_torch(); torch.ones(2).type(torch.float16);"
        " print('job done')",
    )
    assert done.returncode == 0, done.stderr
    assert "job done" in done.stdout and "Traceback" not in done.stderr


@pytest.mark.parametrize("rate", [1e-310, 1e-320, 5e-324])
def test_2_tiny_rates_install_and_sample_nothing(rate):
    ops = types.SimpleNamespace(op=lambda x: x)
    with shadow.install([Target("op", ops, "op", lambda x: x)], sample_rate=rate, oracle=rate, budget=rate) as m:
        for _ in range(100):
            ops.op(1)
    assert m.stats()["op"].calls == 100 and m.stats()["op"].sampled == 0
    assert shadow.Tolerance(rate, rate).rtol == rate
    from shadow.core.drill import Drill

    assert Drill("value", rate).rate == rate


HUGE = 10**400


@pytest.mark.parametrize(
    "make, setting",
    [
        (lambda: shadow.install(["tensor_type"], sample_rate=HUGE), "sample_rate"),
        (lambda: shadow.install(["tensor_type"], sample_rate={"tensor_type": HUGE}), "sample_rate['tensor_type']"),
        (lambda: shadow.install(["tensor_type"], oracle=HUGE), "oracle"),
        (lambda: shadow.install(["tensor_type"], budget=HUGE), "budget"),
        (lambda: shadow.Tolerance(HUGE, 0.0), "Tolerance.rtol"),
        (lambda: __import__("shadow.core.drill").core.drill.Drill("value", HUGE), "drill rate"),
    ],
    ids=["sample_rate", "sample_rate table", "oracle", "budget", "Tolerance", "Drill"],
)
def test_2_a_rate_beyond_any_float_is_a_value_error_naming_the_setting(make, setting):
    with pytest.raises(ValueError, match=r"^" + setting.replace("[", r"\[").replace("]", r"\]")) as caught:
        make()
    assert len(str(caught.value)) < 200  # the number is not printed whole


@pytest.mark.parametrize("max_rate", ["1e-310", "5e-324"])
def test_2_the_verdict_takes_a_tiny_max_rate(tmp_path, max_rate):
    journal = tmp_path / "j.jsonl"
    journal.write_text('{"target": "op", "outcome": "match", "signature": "call", "reasons": []}\n')
    done = npu_shadow("verdict", "--journal", str(journal), "--max-rate", max_rate)
    assert done.returncode == 3, done.stderr  # inconclusive, with a number of comparisons still needed
    assert "more comparisons without divergence" in done.stdout
    assert npu_shadow("verdict", "--journal", str(journal), "--max-rate", "1e400").returncode == 2


# --------------------------------------------------------------------------- 3. restore failures


def test_3_an_upstream_that_leaks_a_mode_never_leaves_the_thread_on_the_upstream_side():
    from torch.overrides import TorchFunctionMode

    class Leaked(TorchFunctionMode):  # its __torch_function__ raises NotImplementedError for every torch call
        pass

    def upstream(x):
        Leaked().__enter__()  # never exited
        return x + 100

    ops = types.SimpleNamespace(op=lambda x: x + 1)
    recorder = Recorder()
    with shadow.install([Target("op", ops, "op", upstream)], sample_rate=1.0, exporters=[recorder]) as monitor:
        first = ops.op(torch.zeros(1))
        assert torch._C._len_torch_function_stack() == 0  # the leaked mode never reaches the job
        second = ops.op(torch.zeros(1))
    assert first.item() == second.item() == 1.0  # legacy's, every time
    stats = monitor.stats()["op"]
    assert stats.calls == stats.sampled == 2
    assert stats.error == 2 and stats.by_reason == {"exception": 2, "state": 2}  # upstream's own mode broke it


# --------------------------------------------------------------------------- 13. settings outside torch's core


def _leak_saved_tensors_hooks():
    torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t).__enter__()


def _read_saved_tensors_hooks():
    return torch._C._autograd._top_saved_tensors_default_hooks(False)


MORE_SETTERS = {
    "mkldnn": (lambda: setattr(torch.backends.mkldnn, "enabled", False), lambda: torch.backends.mkldnn.enabled),
    "opt_einsum": (lambda: setattr(torch.backends.opt_einsum, "enabled", not torch.backends.opt_einsum.enabled),
                   lambda: torch.backends.opt_einsum.enabled),
    "mha fast path": (lambda: torch.backends.mha.set_fastpath_enabled(False), torch.backends.mha.get_fastpath_enabled),
    "warn_always": (lambda: torch.set_warn_always(True), torch.is_warn_always_enabled),
    "fill_uninitialized_memory": (lambda: setattr(torch.utils.deterministic, "fill_uninitialized_memory", False),
                                  lambda: torch.utils.deterministic.fill_uninitialized_memory),
    "autograd multithreading": (lambda: torch.autograd.set_multithreading_enabled(False),
                                torch.autograd.is_multithreading_enabled),
    "numpy errors": (lambda: __import__("numpy").seterr(all="raise"), lambda: __import__("numpy").geterr()),
    "warnings filters": (lambda: __import__("warnings").simplefilter("error"),
                         lambda: list(__import__("warnings").filters)),
    "recursion limit": (lambda: sys.setrecursionlimit(sys.getrecursionlimit() + 7), sys.getrecursionlimit),
    "device mode": (lambda: torch.device("meta").__enter__(), lambda: torch.empty(1).device),
    "saved tensors hooks": (_leak_saved_tensors_hooks, _read_saved_tensors_hooks),
}  # fmt: skip


@pytest.mark.parametrize("setting", sorted(MORE_SETTERS))
def test_13_settings_upstream_changes_never_reach_the_job(setting):
    change, read = MORE_SETTERS[setting]

    def upstream(x):
        change()
        return x * 2

    ops = types.SimpleNamespace(op=lambda x: x * 2)
    before = read()
    with shadow.install([Target("op", ops, "op", upstream)], sample_rate=1.0) as monitor:
        ops.op(torch.ones(2))
        assert read() == before
    stats = monitor.stats()["op"]
    assert (stats.mismatch, stats.by_reason) == (1, {"state": 1})  # and upstream's difference is seen


def test_13_upstream_turning_off_requires_grad_never_reaches_the_callers_parameters():
    def upstream(module, x):
        for parameter in module.parameters():
            parameter.requires_grad_(False)
        return module(x)

    module = torch.nn.Linear(3, 3)
    ops = types.SimpleNamespace(op=lambda m, x: m(x))
    with shadow.install([Target("op", ops, "op", upstream)], sample_rate=1.0) as monitor:
        ops.op(module, torch.ones(2, 3))
    assert all(p.requires_grad for p in module.parameters())
    assert monitor.stats()["op"].by_reason == {"requires_grad": 1}
