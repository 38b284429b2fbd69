"""The patches torch_npu 2.13 still carries, shadowed with legacy from the 2.13.0 wheel's own code on the emulated npu:
each difference torch_npu's code makes is caught (shadow and canary), the calls where they agree match, and the
caller's module, stream, RNG and exceptions are what the unwrapped call gives."""

from __future__ import annotations

import collections
import contextlib
import fnmatch
import io
import json
import os
import pickle
import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from commands import npu_shadow, npu_shadow_here
from conftest import installed
from torch_npu_wheels import wheel

import shadow
from shadow.core.model import live_targets
from shadow.core.model.target import Target
from shadow.npu import torch_npu_source


def _monitor(primary: str = "legacy", targets: Any = None) -> shadow.Monitor:
    return shadow.install(targets=targets, sample_rate=1.0, seed=3, primary=primary, budget=None, deadline=None)


def _counts(monitor: shadow.Monitor, target: str) -> dict[str, Any]:
    stats = monitor.stats()[target]
    outcomes = {k: getattr(stats, k) for k in ("match", "close", "mismatch", "noise", "error", "skipped")}
    return {"outcomes": {k: v for k, v in outcomes.items() if v}, "reasons": dict(stats.by_reason)}


def _state(module: torch.nn.Module) -> list[tuple]:
    return [
        (name, t.device, t.dtype, t.stride(), t.detach().cpu().clone(), t.requires_grad, t.grad_fn)
        for name, t in (*module.named_parameters(), *module.named_buffers())
    ]


def _same_state(first: list[tuple], second: list[tuple]) -> bool:
    return len(first) == len(second) and all(
        a[:4] == b[:4] and torch.equal(a[4], b[4]) and a[5:] == b[5:] for a, b in zip(first, second)
    )


def test_the_213_wheel_gives_the_live_patches_and_lacks_the_removed_ones(legacy_213) -> None:
    assert set(legacy_213.patches) == {
        "torch_load", "torch_save", "tensor_repr", "storage_cpu", "storage_deepcopy", "module_to", "module_npu",
        "foreach_devices", "dataloader_init",
    }  # fmt: skip
    assert set(legacy_213.missing) == {"tensor_type", "parallel_apply", "data_parallel", "lstm_forward"}
    assert "has no 'npu_parallel_apply'" in legacy_213.missing["parallel_apply"]


@pytest.mark.parametrize("device", [torch.device("npu:1"), "npu:1"], ids=["torch.device", "str"])
@pytest.mark.parametrize("primary", ["legacy", "upstream"])
def test_module_npu_given_a_device_object_is_legacys_type_error(patched, primary: str, device: Any) -> None:
    expected = None
    try:
        patched.patches["module_npu"](torch.nn.Linear(3, 2), device)
    except TypeError as exc:
        expected = str(exc)
    assert expected is not None and "must be int" in expected
    model = torch.nn.Linear(3, 2)
    with _monitor(primary) as monitor:
        if primary == "legacy":
            with pytest.raises(TypeError) as raised:
                model.npu(device)
            assert str(raised.value) == expected  # (legacy's own exception, unchanged)
            assert model.weight.device.type == "cpu"
        else:
            assert model.npu(device) is model  # (the canary returns upstream's: it works)
            assert model.weight.device == torch.device("npu:1")
        counts = _counts(monitor, "module_npu")
    assert counts == {"outcomes": {"error": 1}, "reasons": {"exception": 1}}


@pytest.mark.parametrize("primary", ["legacy", "upstream"])
def test_channels_last_3d_is_a_stride_mismatch_and_the_caller_gets_its_primarys_layout(patched, primary) -> None:
    model = torch.nn.Conv3d(2, 4, 3)
    with _monitor(primary) as monitor:
        assert model.to(memory_format=torch.channels_last_3d) is model
        counts = _counts(monitor, "module_to")
    weight = model.weight
    channels_last = weight.is_contiguous(memory_format=torch.channels_last_3d) and not weight.is_contiguous()
    assert channels_last == (primary == "upstream")  # legacy converts 4-D tensors only
    assert counts == {"outcomes": {"mismatch": 1}, "reasons": {"stride": 1}}


def test_the_calls_where_they_agree_match(patched, tmp_path) -> None:
    checkpoint = tmp_path / "model.pt"
    torch.save(torch.nn.Linear(3, 2).state_dict(), checkpoint)
    with _monitor() as monitor:
        state = torch.load(checkpoint)
        model = torch.nn.Linear(3, 2)
        model.load_state_dict(state)
        model.to("npu:0")
        model.npu(1)
        torch.nn.Conv2d(2, 4, 3).to(memory_format=torch.channels_last)
        stats = monitor.stats()
    assert stats["torch_load"].match == 1
    assert stats["module_to"].match == 2 and not stats["module_to"].by_reason
    assert stats["module_npu"].match == 1 and not stats["module_npu"].by_reason
    assert model.weight.device == torch.device("npu:1")


def test_a_safetensors_path_loads_upstream_only(patched, tmp_path) -> None:
    from safetensors.torch import save_file

    path = tmp_path / "weights.safetensors"
    save_file({"w": torch.arange(4.0)}, str(path))
    with _monitor() as monitor:
        with pytest.raises(Exception) as raised:  # legacy's copy reads it as a pickle
            torch.load(path)
        counts = _counts(monitor, "torch_load")
        signatures = dict(monitor.stats()["torch_load"].signature_calls)
    assert not isinstance(raised.value, AssertionError)
    assert counts == {"outcomes": {"error": 1}, "reasons": {"exception": 1}}
    assert list(signatures) == ["path/safetensors/map=none/wo=default/env=none"], signatures
    with _monitor("upstream") as monitor:
        assert torch.equal(torch.load(path)["w"], torch.arange(4.0))
        assert _counts(monitor, "torch_load")["outcomes"] == {"error": 1}


class Settings:  # (not a weights-only type: torch.load refuses it unless weights_only is off)
    def __init__(self, rate: float) -> None:
        self.rate = rate


@pytest.mark.filterwarnings("ignore:Environment variable TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD")
@pytest.mark.parametrize("primary", ["legacy", "upstream"])
def test_the_weights_only_variable_in_mixed_case_is_read_by_upstream_only(patched, tmp_path, monkeypatch, primary):
    checkpoint = tmp_path / "settings.pt"
    torch.save({"settings": Settings(0.5)}, checkpoint)
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "TRUE")
    with _monitor(primary) as monitor:  # (a pickle of the job's own class: untrusted, it is never loaded again)
        with contextlib.suppress(pickle.UnpicklingError):
            torch.load(checkpoint)
        assert _counts(monitor, "torch_load") == {"outcomes": {"skipped": 1}, "reasons": {"ineligible": 1}}
    with _monitor(primary, targets=[live_targets.torch_load(trusted=True)]) as monitor:
        if primary == "upstream":
            assert torch.load(checkpoint)["settings"].rate == 0.5  # upstream lower-cases it: weights_only off
        else:
            with pytest.raises(pickle.UnpicklingError):  # legacy reads "TRUE" as unset: weights only
                torch.load(checkpoint)
        counts = _counts(monitor, "torch_load")
        signature = next(iter(monitor.stats()["torch_load"].signature_calls))
    assert counts == {"outcomes": {"error": 1}, "reasons": {"exception": 1}}
    assert signature.endswith("env=mixed-case")
    assert any(fnmatch.fnmatch(signature, p) for p in live_targets.torch_load().risky_signatures)


def test_a_weights_only_failure_is_the_same_exception_with_another_text(patched, tmp_path) -> None:
    """torch_npu's copy catches RuntimeError around the weights-only unpickler, which raises UnpicklingError now:
    its failure reaches the caller unexplained where upstream adds how to load the file."""
    checkpoint = tmp_path / "settings.pt"
    torch.save({"settings": Settings(0.5)}, checkpoint)
    with _monitor() as monitor:
        with pytest.raises(pickle.UnpicklingError) as raised:
            torch.load(checkpoint)
        counts = _counts(monitor, "torch_load")
    assert "Weights only load failed" not in str(raised.value)  # (legacy's, unexplained)
    assert counts == {"outcomes": {"close": 1}, "reasons": {}}


def test_a_buffer_is_read_twice_and_left_where_legacy_left_it(patched) -> None:
    buffer = io.BytesIO()
    buffer.write(b"header")
    torch.save({"a": torch.arange(3)}, buffer)
    buffer.write(b"trailer")
    buffer.seek(6)
    alone = io.BytesIO(buffer.getvalue())
    alone.seek(6)
    expected = patched.patches["torch_load"](alone)
    with _monitor() as monitor:
        loaded = torch.load(buffer)
        counts = _counts(monitor, "torch_load")
    assert torch.equal(loaded["a"], expected["a"]) and buffer.tell() == alone.tell()
    assert counts == {"outcomes": {"match": 1}, "reasons": {}}


class _OneWay(io.RawIOBase):
    """A stream that cannot seek back (a pipe, a socket)."""

    def __init__(self, data: bytes) -> None:
        self._data = io.BytesIO(data)

    def readable(self) -> bool:
        return True

    def readinto(self, target: Any) -> int:
        chunk = self._data.read(len(target))
        target[: len(chunk)] = chunk
        return len(chunk)


def test_a_stream_that_cannot_seek_back_is_skipped_as_ineligible(patched) -> None:
    buffer = io.BytesIO()
    torch.save([1, 2], buffer, _use_new_zipfile_serialization=False)
    with pytest.raises(io.UnsupportedOperation) as alone:
        patched.patches["torch_load"](_OneWay(buffer.getvalue()))
    with _monitor() as monitor:
        with pytest.raises(io.UnsupportedOperation) as raised:  # (legacy's own exception: it reads once, and fails)
            torch.load(_OneWay(buffer.getvalue()))
        counts = _counts(monitor, "torch_load")
    assert str(raised.value) == str(alone.value)
    assert counts == {"outcomes": {"skipped": 1}, "reasons": {"ineligible": 1}}


@pytest.mark.parametrize("soc", ["Ascend910B1", "Ascend910A"])
def test_the_foreach_devices_say_what_deleting_the_patch_turns_on(patched, monkeypatch, soc) -> None:
    """torch_npu's list has npu on the 910B family only; upstream's always has it (and mtia, which an npu host
    does not have: no difference here)."""
    monkeypatch.setenv("NPU_SHADOW_EMULATED_SOC", soc)
    seen = collections.deque(maxlen=1)

    class Keep:
        def export(self, observation: Any) -> None:
            seen.append(observation)

    monitor = shadow.install(targets=["foreach_devices"], sample_rate=1.0, exporters=[Keep()], budget=None)
    try:
        optimizer = importlib_optimizer()
        legacy = optimizer._get_foreach_kernels_supported_devices()
    finally:
        monitor.uninstall()
    observation = seen[0]
    if soc == "Ascend910B1":
        assert "npu" in legacy and observation.outcome == "match"
    else:
        assert "npu" not in legacy
        assert observation.outcome == "mismatch" and observation.reasons == ("custom",)
        assert "deleting the patch turns the foreach (multi-tensor) optimizer kernels on for npu" in observation.detail


def importlib_optimizer() -> Any:
    import importlib

    return importlib.import_module("torch.optim.optimizer")


def test_a_sampled_module_move_leaves_the_module_as_the_unwrapped_call_does(patched) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv3d(2, 3, 2), torch.nn.BatchNorm3d(3))
    twin = torch.nn.Sequential(torch.nn.Conv3d(2, 3, 2), torch.nn.BatchNorm3d(3))
    twin.load_state_dict(model.state_dict())
    patched.patches["module_to"](twin, "npu:1", memory_format=torch.channels_last_3d)
    rng = torch.get_rng_state()
    with _monitor() as monitor:
        model.to("npu:1", memory_format=torch.channels_last_3d)
        assert monitor.stats()["module_to"].mismatch == 1
    assert _same_state(_state(model), _state(twin))
    assert all(p.is_leaf and p.requires_grad for p in model.parameters())
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(p.grad is None and p.grad_fn is None for p in model.parameters())


def _run_in_place(function: Any) -> tuple[Any, torch.nn.Linear, torch.Tensor]:
    """One sampled call of ``function(module)`` shadowed by itself, with the module's state as what is compared."""

    class Holder:
        scale = staticmethod(function)

    target = Target(
        name="in_place", owner=Holder, attribute="scale", upstream=function, legacy=function,
        snapshot=live_targets.module_state, exact=True,
    )  # fmt: skip
    model = torch.nn.Linear(2, 2)
    before = model.weight.detach().clone()
    with shadow.install(targets=[target], sample_rate=1.0, budget=None) as monitor:
        Holder.scale(model)
        return monitor.stats()["in_place"], model, before


def test_upstream_starts_from_the_state_before_the_call() -> None:
    """The shadow run of an in-place method sees the module as legacy found it, not as legacy left it: here legacy
    doubles a parameter by rebinding it, and upstream, doubling it too, must find the original."""

    def double(module: torch.nn.Module) -> torch.nn.Module:
        module.weight.data = module.weight.data * 2
        return module

    stats, model, before = _run_in_place(double)
    assert stats.match == 1 and not stats.by_reason
    assert torch.equal(model.weight, before * 2)  # doubled once: the caller's call only


def test_legacy_writing_a_parameter_in_place_is_skipped_not_compared() -> None:
    def scale_in_place(module: torch.nn.Module) -> torch.nn.Module:
        with torch.no_grad():
            module.weight.mul_(2)
        return module

    stats, model, before = _run_in_place(scale_in_place)
    assert dict(stats.by_reason) == {"inplace": 1}
    assert torch.equal(model.weight, before * 2)


def test_a_custom_comparison_decides_and_its_failure_is_a_counted_skip() -> None:
    class Holder:
        @staticmethod
        def storage(t: torch.Tensor) -> torch.UntypedStorage:
            return t.untyped_storage()

    def upstream(t: torch.Tensor) -> torch.UntypedStorage:
        return t.clone().untyped_storage()

    sizes = Target(
        name="storage",
        owner=Holder,
        attribute="storage",
        upstream=upstream,
        isolate=False,
        compare=lambda a, b: None if a.nbytes() == b.nbytes() else f"{a.nbytes()} vs {b.nbytes()} bytes",
    )
    with shadow.install(targets=[sizes], sample_rate=1.0, budget=None) as monitor:
        Holder.storage(torch.ones(4))
        Holder.storage(torch.ones(8)[:4])  # (legacy's view keeps the whole storage; upstream's clone does not)
        stats = monitor.stats()["storage"]
    assert stats.match == 1 and dict(stats.by_reason) == {"custom": 1}

    def broken(a: Any, b: Any) -> str:
        raise RuntimeError("the comparison's own bug")

    failing = Target(
        name="failing", owner=Holder, attribute="storage", upstream=upstream, isolate=False, compare=broken
    )
    with shadow.install(targets=[failing], sample_rate=1.0, budget=None) as monitor:
        Holder.storage(torch.ones(4))  # the caller never sees it
        stats = monitor.stats()["failing"]
    assert dict(stats.by_reason) == {"comparator": 1}


def test_targets_that_are_not_plain_functions_skip_the_extra_runs(patched) -> None:
    with shadow.install(sample_rate=1.0, budget=None, aa_rate=1.0, backward_rate=1.0, oracle=1.0) as monitor:
        torch.nn.Linear(2, 2).to("npu:0")
        stats = monitor.stats()["module_to"]
    assert stats.match == 1 and stats.oracle_runs == 0 and stats.backward_runs == 0
    assert not monitor.experiment("module_to").noise_floor()


def test_the_emulated_affinity_follows_torch_npus_conf(monkeypatch) -> None:
    from shadow.npu.emulated import affinity

    assert affinity.parse(None, 2, 8) == (0, [(0, 3), (4, 7)])
    assert affinity.parse("1", 2, 8)[0] == 1
    assert affinity.parse("mode:2,npu1:2-7", 2, 8) == (2, [(0, 3), (2, 7)])
    assert affinity.core_range(2, (0, 7), "other") == (4, 7)
    assert affinity.core_range(2, (0, 7), "main") == (0, 0)
    assert affinity.core_range(2, (0, 3), "main") == (0, 3)  # (fewer than five cores: all of them)
    assert affinity.core_range(1, (4, 7), "other") == (4, 7)
    assert os.sched_getaffinity(0)  # (the emulator binds with the kernel's own call)


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _launch(tmp_path: Any, job: str, *options: str, env: dict | None = None) -> tuple[Any, Any]:
    """``npu-shadow run --emulate-npu 2 --legacy-from <2.13.0 wheel> --sample-rate 1 --journal J OPTIONS -- job``:
    the finished process and the journal's path."""
    journal = tmp_path / "j.jsonl"
    done = npu_shadow(
        "run",
        "--emulate-npu",
        "2",
        "--legacy-from",
        wheel("2.13.0"),
        "--sample-rate",
        "1",
        "--journal",
        str(journal),
        *options,
        "--",
        sys.executable,
        "-c",
        job,
        str(tmp_path / "model.pt"),
        env=env,
        timeout=300,
    )
    return done, journal


_LIVE_JOB = """
import sys, torch
model = torch.nn.Linear(3, 2)
try:
    model.npu(torch.device("npu:1"))
except TypeError as exc:
    print("caught TypeError:", exc)
conv = torch.nn.Conv3d(2, 4, 3)
conv.to(memory_format=torch.channels_last_3d)
print("channels_last_3d:", conv.weight.is_contiguous(memory_format=torch.channels_last_3d))
torch.save(model.state_dict(), sys.argv[1])
print("loaded:", sorted(torch.load(sys.argv[1])))
"""


@pytest.mark.slow
def test_under_the_launcher_the_job_gets_legacys_results_and_the_evidence_names_each_difference(tmp_path) -> None:
    done, journal = _launch(tmp_path, _LIVE_JOB, "--budget", "off", "--journal-all")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "caught TypeError: device(): argument 'index'" in done.stdout  # legacy's exception, as the job had it
    said = "torch_npu 2.13.0 has no parallel_apply, data_parallel, tensor_type, lstm_forward patch"
    assert done.stderr.count(said) == 1
    assert "channels_last_3d: False" in done.stdout and "loaded: ['bias', 'weight']" in done.stdout
    lines = [json.loads(line) for line in journal.read_text().splitlines()]
    found = {(r["target"], r["outcome"], tuple(r["reasons"])) for r in lines if "outcome" in r}
    assert found == {
        ("module_npu", "error", ("exception",)),
        ("module_to", "mismatch", ("stride",)),
        ("torch_load", "match", ()),
        ("torch_save", "match", ()),
    }
    verdict = npu_shadow_here("verdict", "--journal", str(journal), "--format", "json")
    decided = {t["target"]: (t["decision"], t["divergent"]) for t in json.loads(verdict.stdout)["targets"]}
    assert decided["module_npu"] == ("rollback", 1) and decided["module_to"] == ("rollback", 1)
    assert decided["torch_load"] == ("inconclusive", 0)
    report = npu_shadow("report", "--journal", str(journal), "--markdown", str(tmp_path / "r.md"))
    text = (tmp_path / "r.md").read_text()
    assert report.returncode == 0 and "| module_to | rollback | 1 | 1 |" in text and "| module_npu | rollback |" in text
    assert "torch_npu 2.13.0 source" in text


# --------------------------------------------------------------------------- LSTM.forward (torch_npu 2.12)


@pytest.fixture
def patched_212(torch_npu_legacy: torch_npu_source.TorchNpuLegacy) -> Iterator[torch_npu_source.TorchNpuLegacy]:
    yield from installed(torch_npu_legacy)


def test_the_lstm_forward_of_212_differs_on_a_packed_sequence_of_unequal_lengths_only(patched_212) -> None:
    torch.manual_seed(0)
    model = torch.nn.LSTM(3, 4, bidirectional=True).to("npu:0")
    x = torch.randn(5, 2, 3, device="npu:0")
    expected = patched_212.patches["lstm_forward"](model, torch.nn.utils.rnn.pack_padded_sequence(x, [5, 3]))
    with shadow.install(targets=["lstm_forward"], sample_rate=1.0, budget=None, backward_rate=1.0) as monitor:
        output, _ = model(x)
        output.sum().backward()  # (the job's own backward, through legacy's graph)
        equal = model(torch.nn.utils.rnn.pack_padded_sequence(x, [5, 5]))
        unequal = model(torch.nn.utils.rnn.pack_padded_sequence(x, [5, 3]))
        stats = monitor.stats()["lstm_forward"]
        signatures = dict(stats.signature_calls)
    assert torch.equal(unequal[0].data, expected[0].data) and unequal[0].data.shape == (10, 8)  # legacy's, to the job
    assert equal[0].data.shape == (10, 8)
    assert stats.match == 2 and stats.mismatch == 1 and dict(stats.by_reason) == {"shape": 1, "value": 1}
    assert stats.backward_runs == 2 and all(p.grad is not None for p in model.parameters())  # (not the diverged)
    assert signatures == {"packed=no/batched=yes/hx=none/bidirectional=yes": 1,
                          "packed=yes/batched=yes/hx=none/bidirectional=yes": 2}  # fmt: skip


_OPTIMIZER_JOB = """
import torch
model = torch.nn.Linear(2, 2).to("npu:0")
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model(torch.ones(1, 2, device="npu:0")).sum().backward()
optimizer.step()
print("stepped")
"""


@pytest.mark.slow
def test_an_optimizer_on_an_older_soc_shows_what_deleting_the_foreach_patch_turns_on(tmp_path) -> None:
    done, journal = _launch(tmp_path, _OPTIMIZER_JOB, env={**os.environ, "NPU_SHADOW_EMULATED_SOC": "Ascend910A"})
    assert done.returncode == 0 and "stepped" in done.stdout, done.stderr[-3000:]
    lines = [json.loads(line) for line in journal.read_text().splitlines()]
    (line,) = [r for r in lines if r.get("target") == "foreach_devices" and "outcome" in r]
    assert (
        line["reasons"] == ["custom"]
        and "turns the foreach (multi-tensor) optimizer kernels on for npu" in (line["detail"])
    )
    verdict = npu_shadow_here("verdict", "--journal", str(journal))
    row = next(r for r in verdict.stdout.splitlines() if r.startswith("foreach_devices"))
    assert "rollback" in row and "hard mismatches: 1 custom (deleting the patch changes whether the optimizers" in row


def test_a_module_whose_second_copy_would_not_fit_is_skipped_for_memory(patched, monkeypatch) -> None:
    from shadow.core.support import memory

    monkeypatch.setattr(memory, "free_bytes", lambda device: 8 << 20)  # (the copy takes at most half of it)
    model = torch.nn.Linear(1024, 2048)  # 8 MiB of parameters
    with _monitor() as monitor:
        model.to("npu:0")
        counts = _counts(monitor, "module_to")
    assert model.weight.device == torch.device("npu:0")  # legacy's move, as ever
    assert counts == {"outcomes": {"skipped": 1}, "reasons": {"oom": 1}}


def test_a_dtype_only_move_is_sized_in_the_dtype_it_makes(patched, monkeypatch) -> None:
    """``.to(torch.float64)`` makes copies twice the size of the float32 tensors it has: 8 MiB now, 16 MiB made, which
    do not fit in half of 24 MiB free (the copy sized at the current dtype would have)."""
    from shadow.core.support import memory

    monkeypatch.setattr(memory, "free_bytes", lambda device: 24 << 20)
    model = torch.nn.Linear(1024, 2048)
    with _monitor() as monitor:
        model.to(torch.float64)
        counts = _counts(monitor, "module_to")
    assert model.weight.dtype == torch.float64
    assert counts == {"outcomes": {"skipped": 1}, "reasons": {"oom": 1}}


def test_the_shadows_failed_host_allocation_is_an_oom_skip_never_its_error() -> None:
    def allocates(x):
        torch.empty(1 << 50, dtype=torch.uint8)  # (the host allocator: "can't allocate memory")
        return x

    ops = types.SimpleNamespace(op=lambda x: x)
    with _monitor(targets=[Target("op", ops, "op", allocates)]) as monitor:
        assert torch.equal(ops.op(torch.ones(2)), torch.ones(2))
        assert _counts(monitor, "op") == {"outcomes": {"skipped": 1}, "reasons": {"oom": 1}}


def test_clean_says_what_the_evidence_keeps_of_a_result() -> None:
    kept = []

    class Keep:
        def export(self, observation: Any) -> None:
            if observation.evidence is not None:
                kept.append(observation.evidence)

    class Holder:
        @staticmethod
        def load(x: torch.Tensor) -> dict:
            return {"weights": x * 2, "optimizer": list(range(1000))}

    target = Target(
        name="load",
        owner=Holder,
        attribute="load",
        upstream=lambda x: {"weights": x * 3, "optimizer": list(range(1000))},
        clean=lambda result: result["weights"],
    )
    with shadow.install(targets=[target], sample_rate=1.0, budget=None, exporters=[Keep()]):
        assert Holder.load(torch.ones(2))["optimizer"][-1] == 999  # (the caller's result is whole)
    (evidence,) = kept
    assert torch.equal(evidence.legacy, torch.full((2,), 2.0)) and torch.equal(evidence.upstream, torch.full((2,), 3.0))


def test_a_snapshot_that_fails_is_a_counted_skip_never_a_divergence() -> None:
    calls = []

    def snapshot(result: Any, args: tuple, kwargs: dict) -> Any:
        calls.append(1)
        if len(calls) == 2:  # (the shadow run's)
            raise RuntimeError("cannot read the module")
        return live_targets.module_state(result, args, kwargs)

    class Holder:
        @staticmethod
        def same(module: torch.nn.Module) -> torch.nn.Module:
            return module

    target = Target(name="same", owner=Holder, attribute="same", upstream=Holder.same, snapshot=snapshot)
    with shadow.install(targets=[target], sample_rate=1.0, budget=None) as monitor:
        Holder.same(torch.nn.Linear(2, 2))
        stats = monitor.stats()["same"]
    assert (stats.error, stats.skipped, dict(stats.by_reason)) == (0, 1, {"comparator": 1})


def test_an_npu_type_name_on_another_accelerator_is_a_risky_signature_of_its_own(monkeypatch):
    """On a GPU host, ``.type('torch.npu.FloatTensor')`` moves the tensor under legacy and raises under upstream:
    a known path of its own (risky, the verdict names it), never an unexplained divergence on an unmarked signature.
    On the npu (and with no accelerator), the signature is as before."""
    import fnmatch

    from shadow.core.model import targets

    monkeypatch.setattr(targets, "_KINDS", {})
    x = torch.ones(2)
    on_npu = targets.tensor_type_signature((x, "torch.npu.FloatTensor"), {})
    monkeypatch.setattr(targets, "_ACCELERATOR", ["cuda"])
    monkeypatch.setattr(targets, "_KINDS", {})
    for destination, kind in (("torch.npu.FloatTensor", "npu_name"), (torch.npu.FloatTensor, "npu_class")):
        signature = targets.tensor_type_signature((x, destination), {})
        assert signature.startswith(f"{kind}_elsewhere/"), signature
        assert any(fnmatch.fnmatchcase(signature, p) for p in targets.TENSOR_TYPE_RISKY), signature
    assert on_npu.startswith("npu_name/") and not on_npu.startswith("npu_name_elsewhere")


def test_the_exit_summary_says_the_iterators_canary_runs_only_with_upstream_primary(patched) -> None:
    """Under the defaults the DataLoader iterator's A/B never runs, and nothing said so."""
    from shadow.launcher.launch import summary

    with _monitor("legacy") as monitor:
        assert monitor.idle_canaries == ("dataloader_init",) and monitor.arms is None
        said = summary(monitor.stats(), idle_canaries=monitor.idle_canaries)
    assert "dataloader_init not compared: a canary A/B (it cannot run twice), run only with --primary upstream" in (
        " ".join(said.split())
    )
    with _monitor("upstream") as monitor:
        assert monitor.idle_canaries == () and monitor.arms is not None
