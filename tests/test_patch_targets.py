"""The function patches of torch_npu 2.14 that can run twice, shadowed with legacy from the 2.14.0 wheel's own code
on the emulated npu: ``Tensor.__repr__`` (``tensor_repr``), ``torch.save`` over torch_npu's ``_save`` and
``_legacy_save`` (``torch_save``), ``UntypedStorage.cpu`` (``storage_cpu``) and ``TypedStorage._deepcopy``
(``storage_deepcopy``). Each real difference torch_npu's source shows is caught; the calls where they agree match; the
caller gets legacy's result and its files and streams as the unwrapped call leaves them."""

from __future__ import annotations

import contextlib
import copy
import io
import os
import re
from typing import Any

import pytest
import torch
from conftest import installed
from torch_npu_wheels import wheel

import shadow
from shadow.core.model import live_targets, saving
from shadow.core.model.target import Alike, Target
from shadow.npu import torch_npu_source
from shadow.npu.emulated import formats
from shadow.npu.patching import replace

NEW = ("tensor_repr", "torch_save", "storage_cpu", "storage_deepcopy")

#: This test's own storages read ``TypedStorage`` properties, which warn once a process that it is deprecated.
_TYPED_STORAGE_WARNS = pytest.mark.filterwarnings("ignore:TypedStorage is deprecated:UserWarning")


@pytest.fixture(scope="module")
def legacy_214() -> torch_npu_source.TorchNpuLegacy:
    return torch_npu_source.load(wheel("2.14.0"))


@pytest.fixture
def patched(legacy_214: torch_npu_source.TorchNpuLegacy):
    yield from installed(legacy_214)


def _monitor(targets: Any = NEW, **options: Any) -> shadow.Monitor:
    return shadow.install(targets=list(targets), sample_rate=1.0, seed=3, budget=None, deadline=None, **options)


def _outcomes(monitor: shadow.Monitor, target: str) -> dict[str, Any]:
    stats = monitor.stats()[target]
    found = {k: getattr(stats, k) for k in ("match", "close", "mismatch", "error", "skipped") if getattr(stats, k)}
    return {**found, **({"reasons": dict(stats.by_reason)} if stats.by_reason else {})}


# --------------------------------------------------------------------------- the release's source


def test_the_214_wheel_gives_the_four_patches_and_loading_them_installs_nothing(legacy_214) -> None:
    """The repr patch is a function torch_npu defines inside the function that installs it: it is taken with the
    values it closes over (upstream's repr as ``_orig_repr``), and the installer's assignment never runs."""
    assert set(NEW) <= set(legacy_214.patches)
    before = vars(torch.Tensor)["__repr__"]
    again = torch_npu_source.load(wheel("2.14.0"))
    assert vars(torch.Tensor)["__repr__"] is before
    assert torch.serialization._legacy_save.__module__ == "torch.serialization"
    legacy_repr = again.patches["tensor_repr"]
    closed_over = dict(zip(legacy_repr.__code__.co_freevars, (c.cell_contents for c in legacy_repr.__closure__)))
    assert closed_over["_orig_repr"] is before
    assert legacy_214.helpers[("torch.serialization", "_legacy_save")].__name__ == "_npu_legacy_save"


def test_the_repr_patch_closes_over_upstreams_repr_even_where_a_monitor_is_installed(legacy_214) -> None:
    patches = legacy_214.patch_torch()
    try:
        with _monitor(["tensor_repr"]):
            loaded = torch_npu_source.load(wheel("2.14.0")).patches["tensor_repr"]
    finally:
        patches.undo()
    cells = dict(zip(loaded.__code__.co_freevars, (c.cell_contents for c in loaded.__closure__)))
    assert cells["_orig_repr"] is live_targets.upstream("tensor_repr")


def test_the_213_wheel_has_them_too_and_the_212_wheel_lacks_the_repr_patch() -> None:
    assert "tensor_repr" in torch_npu_source.load(wheel("2.13.0")).patches
    older = torch_npu_source.load(wheel("2.12.0"))
    assert "tensor_repr" not in older.patches and "apply_npu_internal_format_repr_patch" in older.missing["tensor_repr"]


# --------------------------------------------------------------------------- tensor_repr


def test_an_internal_format_tensor_prints_through_its_host_copy_and_the_difference_is_caught(patched) -> None:
    """torch_npu 2.13/2.14 print an npu tensor in an internal format (FRACTAL_NZ, NC1HWC0) through ``.cpu()``: the
    device and the autograd state vanish from the string. The job gets legacy's string; the call is a mismatch, in
    a risky signature; an ND tensor's repr matches."""
    weight = torch.ones(2, 3, device="npu", requires_grad=True)
    nz = formats.cast(weight, formats.Format.FRACTAL_NZ)
    expected = patched.patches["tensor_repr"](nz)
    with _monitor(["tensor_repr"]) as monitor:
        assert repr(nz) == expected == "tensor([[1., 1., 1.],\n        [1., 1., 1.]])"
        assert repr(weight) == "tensor([[1., 1., 1.],\n        [1., 1., 1.]], device='npu:0', requires_grad=True)"
    assert _outcomes(monitor, "tensor_repr") == {"match": 1, "mismatch": 1, "reasons": {"value": 1}}
    calls = monitor.stats()["tensor_repr"].signature_calls
    assert calls == {"device=npu/format=internal/grad=graph/contents=none": 1,
                     "device=npu/format=nd/grad=leaf/contents=none": 1}  # fmt: skip
    assert live_targets.tensor_repr().risky_signatures == ("*/format=internal/*",)


def test_a_repr_of_a_tensor_with_a_graph_is_compared_with_its_grad_fn(patched) -> None:
    """The shadow run prints the caller's tensor itself (a new leaf over it would print ``requires_grad=True``)."""
    x = torch.ones(2, device="npu", requires_grad=True) * 3
    with _monitor(["tensor_repr"]) as monitor:
        assert "grad_fn=<MulBackward0>" in repr(x)
    assert _outcomes(monitor, "tensor_repr") == {"match": 1}
    assert x.grad_fn is not None and x.grad_fn.next_functions  # (the caller's graph, as it was)


# --------------------------------------------------------------------------- torch_save


def _saved(directory: Any, obj: Any, **kwargs: Any) -> bytes:
    directory.mkdir()
    torch.save(obj, directory / "c.pt", **kwargs)
    return (directory / "c.pt").read_bytes()


@pytest.mark.parametrize("zipped", [True, False], ids=["zip", "legacy-format"])
def test_saves_to_a_path_match_and_the_file_is_the_unwrapped_calls(patched, tmp_path, zipped) -> None:
    state = {"weight": torch.randn(3, 4, device="npu"), "step": 7, "host": torch.arange(3)}
    unwrapped = _saved(tmp_path / "plain", state, _use_new_zipfile_serialization=zipped)
    with _monitor(["torch_save"]) as monitor:
        shadowed = _saved(tmp_path / "shadowed", state, _use_new_zipfile_serialization=zipped)
    assert shadowed == unwrapped
    assert _outcomes(monitor, "torch_save") == {"match": 1}
    kind = "zip" if zipped else "legacy"
    assert monitor.stats()["torch_save"].signature_calls == {f"dest=path/format={kind}/tensors=mixed/npu_formats=nd": 1}


def test_a_save_into_a_stream_leaves_it_where_legacy_left_it(patched) -> None:
    tensor = torch.randn(5, device="npu")
    plain = io.BytesIO(b"header")
    plain.seek(6)
    torch.save([tensor], plain)
    stream = io.BytesIO(b"header")
    stream.seek(6)
    with _monitor(["torch_save"]) as monitor:
        torch.save([tensor], stream)
    assert stream.tell() == plain.tell() and stream.getvalue() == plain.getvalue()
    assert _outcomes(monitor, "torch_save") == {"match": 1}


def test_a_save_into_a_write_only_file_is_read_back_through_a_descriptor_of_our_own(patched, tmp_path) -> None:
    with _monitor(["torch_save"]) as monitor, open(tmp_path / "w.pt", "wb") as handle:
        handle.write(b"x" * 10)
        torch.save({"a": torch.ones(2, device="npu")}, handle)
        at = handle.tell()
    assert at == (tmp_path / "w.pt").stat().st_size and _outcomes(monitor, "torch_save") == {"match": 1}


def test_an_object_whose_pickling_runs_the_jobs_code_is_saved_once_unless_trusted(patched, tmp_path) -> None:
    model = torch.nn.Linear(2, 2).to("npu")
    with _monitor(["torch_save"]) as monitor:
        torch.save(model, tmp_path / "model.pt")
    assert _outcomes(monitor, "torch_save") == {"skipped": 1, "reasons": {"ineligible": 1}}
    with _monitor(["torch_save"], trusted_checkpoints=True) as monitor:
        torch.save(model, tmp_path / "model.pt")
    assert _outcomes(monitor, "torch_save") == {"match": 1}


def test_a_save_whose_two_outputs_would_not_fit_on_the_host_is_skipped_as_oom(patched, tmp_path, monkeypatch) -> None:
    from shadow.core.support import memory

    big = {"w": torch.zeros(3 << 20, device="npu")}  # (12 MiB: what a sampled save holds, 60)
    monkeypatch.setattr(memory, "host_free_bytes", lambda: 40 << 20)  # (at most half of it is taken: 20 MiB)
    with _monitor(["torch_save"]) as monitor:
        torch.save(big, tmp_path / "big.pt")
    assert _outcomes(monitor, "torch_save") == {"skipped": 1, "reasons": {"oom": 1}}
    assert torch.equal(torch.load(tmp_path / "big.pt")["w"].cpu(), big["w"].cpu())  # (the job's file, whole)


def test_a_stream_that_cannot_be_read_back_is_refused_before_the_save() -> None:
    class Sink:
        def __init__(self) -> None:
            self.data = b""

        def write(self, data: bytes) -> int:
            self.data += bytes(data)
            return len(data)

        def flush(self) -> None:
            pass

    why = saving.refusal((torch.ones(1), Sink()), {})
    assert why is not None and "cannot be read back" in why


def _legacy_save_that(change: str):
    """A stand-in for torch_npu's ``_save`` that writes the same content in another layout (no byte-order record)
    or different content (every tensor doubled)."""
    own = live_targets.upstream("torch_save") and torch.serialization._save

    def _save(obj, zip_file, pickle_module, pickle_protocol, _disable_byteorder_record):
        if change == "layout":
            return own(obj, zip_file, pickle_module, pickle_protocol, True)
        doubled = {k: v * 2 for k, v in obj.items()}
        return own(doubled, zip_file, pickle_module, pickle_protocol, _disable_byteorder_record)

    _save.__npu_shadow_legacy_origin__ = "test"
    return _save


@pytest.mark.parametrize("change", ["layout", "content"])
def test_a_difference_in_layout_is_close_and_one_in_content_is_a_mismatch(tmp_path, change) -> None:
    patches = replace([(torch.serialization, "_save", _legacy_save_that(change))])
    try:
        with _monitor(["torch_save"]) as monitor:
            torch.save({"w": torch.arange(4.0)}, tmp_path / "c.pt")
        assert torch.load(tmp_path / "c.pt")["w"][1] == (1.0 if change == "layout" else 2.0)  # (legacy's file)
    finally:
        patches.undo()
    stats = monitor.stats()["torch_save"]
    if change == "layout":
        assert (stats.close, stats.mismatch) == (1, 0)
    else:
        assert (stats.close, stats.mismatch, dict(stats.by_reason)) == (0, 1, {"custom": 1})


def test_the_comparison_reads_records_and_loads_only_where_they_differ() -> None:
    def written(obj: Any, **kwargs: Any) -> saving.Written:
        buffer = io.BytesIO()
        torch.save(obj, buffer, **kwargs)
        return saving.written(None, (obj, buffer), {})

    same = written({"a": torch.ones(2)})
    assert saving.difference(same, written({"a": torch.ones(2)})) is None
    layout = saving.difference(same, written({"a": torch.ones(3)[1:]}))  # (a view: its whole storage is saved)
    assert isinstance(layout, Alike) and "data.pkl" in layout.note and "same content" in layout.note
    content = saving.difference(same, written({"a": torch.zeros(2)}))
    assert isinstance(content, str) and "different content at ['a']" in content
    assert "a pickle stream" in repr(saving.written(None, (1, _legacy_stream()), {}))


def _legacy_stream() -> io.BytesIO:
    buffer = io.BytesIO()
    torch.save(1, buffer, _use_new_zipfile_serialization=False)
    return buffer


def test_internal_formats_make_the_risky_signatures_of_saves_and_storage_copies(monkeypatch) -> None:
    """Where torch_npu's source parts from torch's: a storage in an internal format (sized, copied and converted
    through its NPU descriptor). The emulated npu's storages have none; an NPU host's torch_npu says which do."""
    import fnmatch
    import sys
    import types

    nz = formats.cast(torch.ones(2, 2, device="npu"), formats.Format.FRACTAL_NZ)
    signature = live_targets.torch_save_signature(({"w": nz}, io.BytesIO()), {})
    assert fnmatch.fnmatch(signature, *live_targets.torch_save().risky_signatures), signature
    assert live_targets.storage_cpu_signature((nz.untyped_storage(),), {}) == "device=npu/format=nd"  # (rehearsal)
    on_an_npu = types.SimpleNamespace(
        _C=types.SimpleNamespace(_tensor_construct_from_storage=lambda storage: nz), get_npu_format=formats.get
    )
    monkeypatch.setitem(sys.modules, "torch_npu", on_an_npu)
    signature = live_targets.storage_cpu_signature((nz.untyped_storage(),), {})
    assert signature == "device=npu/format=internal"
    assert fnmatch.fnmatch(signature, *live_targets.storage_cpu().risky_signatures)


# --------------------------------------------------------------------------- storage_cpu, storage_deepcopy


@_TYPED_STORAGE_WARNS
def test_storage_copies_match_and_the_job_gets_legacys(patched) -> None:
    x = torch.arange(6.0, device="npu")
    with _monitor(["storage_cpu", "storage_deepcopy"]) as monitor:
        host = x.untyped_storage().cpu()
        copied = copy.deepcopy([x, x[2:]])
    assert bytes(host) == bytes(x.cpu().untyped_storage())
    assert copied[1].untyped_storage().data_ptr() == copied[0].untyped_storage().data_ptr()  # (one storage, once)
    assert torch.equal(copied[1].cpu(), x[2:].cpu())
    assert _outcomes(monitor, "storage_cpu") == {"match": 1}
    # (the second tensor's storage is the memo's: refused, since the shadow run would read legacy's entry)
    assert _outcomes(monitor, "storage_deepcopy") == {"match": 1, "skipped": 1, "reasons": {"ineligible": 1}}


@_TYPED_STORAGE_WARNS
def test_a_deepcopy_of_a_model_compares_its_buffers_copies(patched) -> None:
    """The memo of ``copy.deepcopy(model)`` holds the new module half-built: the call reads only the storage."""
    model = torch.nn.BatchNorm1d(3).to("npu")
    with _monitor(["storage_deepcopy"]) as monitor:
        twin = copy.deepcopy(model)
    assert torch.equal(twin.running_var.cpu(), model.running_var.cpu())
    assert _outcomes(monitor, "storage_deepcopy") == {"match": 3}  # running_mean, running_var, num_batches_tracked


@_TYPED_STORAGE_WARNS
def test_differences_in_a_storage_copy_are_named() -> None:
    a = torch.arange(4, dtype=torch.uint8).untyped_storage()
    b = torch.tensor([0, 1, 2, 9], dtype=torch.uint8).untyped_storage()
    assert live_targets.storage_difference(a, a.clone()) is None
    assert live_targets.storage_difference(a, b) == "the copies hold different bytes"
    typed = torch.ones(2).storage()
    assert "torch.float32" in live_targets.storage_difference(typed, torch.ones(2, dtype=torch.int32).storage())
    assert "TypedStorage" in live_targets.storage_difference(typed, a)


# --------------------------------------------------------------------------- the census


def test_the_census_names_the_targets_that_shadow_each_patch() -> None:
    from shadow.analysis import census

    found = {p.name: p.shadowed_by for p in census.take(wheel("2.14.0")).patches}
    assert found["torch.Tensor.__repr__"] == "tensor_repr"
    assert found["torch.serialization._save"] == found["torch.serialization._legacy_save"] == "torch_save"
    assert found["torch.storage.UntypedStorage.cpu"] == "storage_cpu"
    assert found["torch.storage.TypedStorage._deepcopy"] == "storage_deepcopy"
    assert os.path.basename(wheel("2.14.0")).startswith("torch_npu-2.14.0")


# --------------------------------------------------------------------------- any function patch, by name


def test_a_generic_target_shadows_a_function_patch_by_name_with_legacy_from_the_release() -> None:
    target = shadow.patch_target("2.14.0", "torch._utils._get_available_device_type")
    assert target.legacy.__name__ == "_patch_get_available_device_type" and target.upstream.__module__ == "torch._utils"
    with _monitor([target]) as monitor:
        assert torch._utils._get_available_device_type() == "npu"  # (legacy's answer, on the emulated npu)
    assert _outcomes(monitor, "torch._utils._get_available_device_type") == {"match": 1}


def test_flex_attentions_device_check_is_a_real_difference_on_an_npu() -> None:
    """torch_npu lets npu tensors through flex attention's device check; torch 2.13's refuses every device but its
    own few: deleting the patch breaks flex attention on an NPU, and the generic target says so."""
    name = "torch.nn.attention.flex_attention._validate_device"
    target = shadow.patch_target("2.14.0", name)
    q = torch.ones(1, 1, 4, 8, device="npu")
    with _monitor([target]) as monitor:
        assert torch.nn.attention.flex_attention._validate_device(q, q, q) is None  # (legacy's: the job goes on)
    stats = monitor.stats()[name]
    assert (stats.error, dict(stats.by_reason)) == (1, {"exception": 1})


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("torch.utils.dlpack.to_dlpack", "a DLPack capsule can be consumed once"),
        ("torch.distributed.distributed_c10d.rendezvous", "it connects to the job's store"),
        ("torch.distributed.fsdp._fully_shard._fsdp_collectives.foreach_reduce", "talks to the job's other ranks"),
        ("torch.utils.data.DataLoader.__iter__", "worker processes again"),
        ("torch.load", "the built-in target torch_load shadows it"),
        ("torch.nn.Module.to", "the built-in target module_to shadows it"),
        ("torch.serialization.save", "the result of code run at import"),
        ("torch.nn.functional.layer_norm", "sets _SilentFaultDetector() by code, not data"),
        ("torch.Generator", "torch has a class there"),
        ("torch.no_such_thing", "is no function patch of torch_npu 2.14.0"),
    ],
)
def test_a_patch_that_cannot_have_a_generic_target_is_refused_saying_why(name, why) -> None:
    from shadow.launcher import patch_targets

    found = patch_targets.refusal("2.14.0", name)
    assert found is not None and why in found
    with pytest.raises(patch_targets.PatchRefused, match=re.escape(why)):
        shadow.patch_target("2.14.0", name)


@pytest.mark.slow
def test_shadow_patch_under_the_launcher_and_its_refusals_at_start_up(tmp_path) -> None:
    import json
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    job = "import torch; print([torch._utils._get_available_device_type() for _ in range(3)])"
    journal = tmp_path / "j.jsonl"

    def run(*options: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "shadow", "run", "--emulate-npu", "2", *options, "--", sys.executable, "-c", job],
            capture_output=True, text=True, timeout=300, cwd=root,
        )  # fmt: skip

    done = run("--legacy-from", "2.14.0", "--shadow-patch", "torch._utils._get_available_device_type",
               "--sample-rate", "1", "--journal", str(journal))  # fmt: skip
    assert done.returncode == 0 and "['npu', 'npu', 'npu']" in done.stdout, done.stderr
    counts = [json.loads(r) for r in journal.read_text().splitlines() if '"event":"counts"' in r]
    (record,) = [r for r in counts if r["target"] == "torch._utils._get_available_device_type"]
    assert record["outcomes"] == {"call": {"match": 3}}, record
    refused = run("--legacy-from", "2.14.0", "--shadow-patch", "torch.utils.dlpack.to_dlpack")
    assert refused.returncode == 2 and "--shadow-patch: torch.utils.dlpack.to_dlpack: not shadowed" in refused.stderr
    alone = run("--shadow-patch", "torch._utils._get_available_device_type")
    assert alone.returncode == 2 and "--shadow-patch (NPU_SHADOW_SHADOW_PATCHES) needs --legacy-from" in alone.stderr


def test_on_a_real_devices_properties_the_new_targets_find_no_false_divergence_and_add_no_wait(patched) -> None:
    """An asynchronous queue and nondeterministic reductions: the repr, the save and the host copy read the tensors
    the job made (nothing recomputed), so they still match; a sampled repr reads the device on the caller's thread
    no more often than the job's own repr did (the shadow run prints the same values: the queue is drained)."""
    from shadow.npu import emulated

    model = torch.nn.Conv2d(2, 2, 3).to("npu")
    emulated.set_nondeterministic(1e-3)
    emulated.set_kernel_time(0.001)
    try:
        out = model(torch.randn(1, 2, 5, 5, device="npu"))
        before = emulated.host_syncs()
        text = repr(out)
        plain = tuple(a - b for a, b in zip(emulated.host_syncs(), before))
        with _monitor(["tensor_repr", "torch_save", "storage_cpu"]) as monitor:
            out = model(torch.randn(1, 2, 5, 5, device="npu"))
            before = emulated.host_syncs()
            shadowed_text = repr(out)
            shadowed = tuple(a - b for a, b in zip(emulated.host_syncs(), before))
            torch.save({"out": out.detach()}, io.BytesIO())
            out.detach().untyped_storage().cpu()
    finally:
        emulated.set_kernel_time(0.0)
        emulated.set_nondeterministic(0.0)
    assert text.startswith("tensor(") and shadowed_text.startswith("tensor(")
    assert shadowed[0] <= plain[0], (shadowed, plain)  # (waits on the caller's thread: the job's own)
    for name in ("tensor_repr", "torch_save", "storage_cpu"):  # (the save copies its storage to the host too)
        assert set(_outcomes(monitor, name)) == {"match"}, (name, _outcomes(monitor, name))


# --------------------------------------------------------------------------- torch_save: what the job sees once


class _FullDisk(io.BytesIO):
    """A file of the job's on a full file system: writes past ``room`` bytes fail as the disk's would."""

    def __init__(self, room: int) -> None:
        super().__init__()
        self.room = room

    def write(self, data: Any) -> int:
        if self.tell() + len(data) > self.room:
            raise OSError(28, "No space left on device")
        return super().write(data)


def test_a_save_the_environment_fails_is_skipped_never_a_divergence(patched, tmp_path) -> None:
    """Upstream saves into memory, legacy to the job's destination: a full disk or a missing folder fails legacy
    alone. Such a call is not compared (reason ineligible, the environment named), and the job gets its OSError."""
    state = {"w": torch.randn(64, device="npu")}
    failures = []
    with _monitor(["torch_save"]) as monitor:
        for index in range(8):
            destination = _FullDisk(room=100) if index % 2 else tmp_path / "missing" / f"{index}.pt"
            try:
                torch.save(state, destination)
            except (OSError, RuntimeError) as exc:  # (torch's archive writer says RuntimeError for either)
                failures.append(exc)
        torch.save(state, tmp_path / "fine.pt")
    assert len(failures) == 8  # (the job's own exceptions, as unwrapped)
    assert _outcomes(monitor, "torch_save") == {"match": 1, "skipped": 8, "reasons": {"ineligible": 8}}


def test_a_save_the_environment_fails_never_rolls_back_the_verdict(patched, tmp_path) -> None:
    from exporters import JsonlExporter
    from shadow.analysis import sources, verdict

    journal = tmp_path / "j.jsonl"
    with _monitor(["torch_save"], exporters=[JsonlExporter(str(journal))]) as monitor:
        for index in range(40):  # (the job catches the saves the full disk fails, as in a real run)
            with contextlib.suppress(OSError, RuntimeError):
                torch.save({"w": torch.ones(64, device="npu")}, _FullDisk(room=100 if index % 2 else 10**6))
    assert monitor.stats()["torch_save"].error == 0
    (decision,) = verdict.decide_all(sources.from_journal([str(journal)]), 0.001, {}, 30)
    assert decision.decision != "rollback", decision


class _Reduced:
    """Counts how often its pickling runs (the job's code, run by a save)."""

    runs = 0

    def __reduce__(self):
        type(self).runs += 1
        return (_Reduced, ())


class _Text(str):
    runs = 0

    def __reduce__(self):
        type(self).runs += 1
        return (_Text, (str(self),))


class _Key:
    runs = 0

    def __hash__(self) -> int:
        return 1

    def __reduce__(self):
        type(self).runs += 1
        return (_Key, ())


def _with_attribute() -> Any:
    tensor = torch.ones(2)
    tensor.note = _Reduced()
    return {"t": tensor}


@pytest.mark.parametrize(
    "make, counter",
    [
        (lambda: {"name": _Text("layer"), "w": torch.ones(2)}, _Text),
        (lambda: {_Key(): torch.ones(2)}, _Key),
        (_with_attribute, _Reduced),
    ],
    ids=["str-subclass-leaf", "object-dict-key", "tensor-attribute"],
)
def test_what_pickling_would_run_of_the_jobs_code_runs_once(patched, tmp_path, make, counter) -> None:
    obj = make()
    counter.runs = 0
    with _monitor(["torch_save"]) as monitor:
        torch.save(obj, tmp_path / "c.pt")
    assert counter.runs == 1  # (as unwrapped: the shadow save never ran it)
    assert _outcomes(monitor, "torch_save") == {"skipped": 1, "reasons": {"ineligible": 1}}


def test_a_pickle_module_of_the_jobs_runs_once(patched, tmp_path) -> None:
    import pickle
    import types as types_module

    made = []

    class Pickler(pickle.Pickler):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            made.append(1)
            super().__init__(*args, **kwargs)

    module = types_module.ModuleType("job_pickle")
    vars(module).update({k: getattr(pickle, k) for k in dir(pickle) if not k.startswith("__")}, Pickler=Pickler)
    with _monitor(["torch_save"]) as monitor:
        torch.save({"w": torch.ones(2)}, tmp_path / "c.pt", pickle_module=module)
    assert len(made) == 1 and _outcomes(monitor, "torch_save") == {"skipped": 1, "reasons": {"ineligible": 1}}


def test_a_job_recording_its_warnings_sees_each_once(patched, tmp_path) -> None:
    """A warning a shadow run raises never reaches the job's record: a save whose pickling warns (legacy's and
    upstream's alike) is recorded once, as unwrapped; an upstream that warns on every call is never seen."""
    import warnings

    class Warns(str):  # (a leaf of the job's that warns as it is pickled: the job sees its warning once)
        def __reduce__(self):
            warnings.warn("pickled", UserWarning, stacklevel=1)
            return (str, (str(self),))

    with warnings.catch_warnings(record=True) as seen, _monitor(["torch_save"], trusted_checkpoints=True) as monitor:
        warnings.simplefilter("always")
        torch.save({"w": torch.ones(2), "name": Warns("x")}, tmp_path / "c.pt")
    assert [str(w.message) for w in seen] == ["pickled"] and _outcomes(monitor, "torch_save") == {"match": 1}

    def upstream(x: Any) -> Any:
        warnings.warn("upstream's own warning", UserWarning, stacklevel=1)
        return x * 2

    ops = type("Ops", (), {"op": staticmethod(lambda x: x * 2)})
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with shadow.install([Target("op", ops, "op", upstream)], sample_rate=1.0, budget=None) as monitor:
            for _ in range(3):
                ops.op(torch.ones(2))
    assert seen == [] and monitor.stats()["op"].match == 3


def test_a_stream_opened_to_append_and_rewound_matches(patched, tmp_path) -> None:
    """Writes into a file opened ``"a+b"`` land at its end wherever it was rewound to: what the save wrote is read
    from there."""
    path = tmp_path / "appended.pt"
    path.write_bytes(b"earlier lines\n")
    with _monitor(["torch_save"]) as monitor, open(path, "a+b") as stream:
        stream.seek(0)
        torch.save({"w": torch.arange(4.0, device="npu")}, stream)
    assert _outcomes(monitor, "torch_save") == {"match": 1}
    data = path.read_bytes()
    assert data.startswith(b"earlier lines\n") and torch.load(io.BytesIO(data[14:]))["w"].tolist() == [0, 1, 2, 3]


def test_a_sampled_save_is_compared_only_where_what_it_holds_fits(tmp_path, monkeypatch) -> None:
    """What a sampled save holds on the host (measured by tracemalloc: the shadow's buffer, both outputs read back)
    is within saving.HOLDS times the checkpoint; a save whose HOLDS times does not fit in the host's share is
    skipped for memory (twice its size fit, and a save held about 4x)."""
    import tracemalloc

    from shadow.core.support import memory

    state = {"w": torch.randn(2 << 20)}  # (8 MiB)
    size = 8 << 20
    tracemalloc.start()
    try:
        with _monitor(["torch_save"]) as monitor:
            tracemalloc.reset_peak()
            torch.save(state, tmp_path / "measured.pt")
            peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert _outcomes(monitor, "torch_save") == {"match": 1} and peak <= saving.HOLDS * size, peak / size
    monkeypatch.setattr(memory, "host_free_bytes", lambda: 2 * 3 * size)  # (half of it may be taken: 3 sizes)
    with _monitor(["torch_save"]) as monitor:
        torch.save(state, tmp_path / "refused.pt")
    assert _outcomes(monitor, "torch_save") == {"skipped": 1, "reasons": {"oom": 1}}


class _Fresh:
    """An object whose pickling makes a new storage every time (a clone): the legacy format keys storages by their
    address, so two saves of it differ in a key and nothing else."""

    def __init__(self, data: torch.Tensor) -> None:
        self.data = data

    def __reduce__(self):
        return (_Fresh, (self.data.clone(),))


@pytest.mark.parametrize("zipped", [False, True], ids=["legacy-format", "zip"])
def test_saves_that_differ_only_in_a_storage_key_are_compared_by_what_they_load_back_to(tmp_path, zipped) -> None:
    """With --trusted-checkpoints: the same content is never a mismatch (the legacy format's keys are addresses)."""
    with _monitor(["torch_save"], trusted_checkpoints=True) as monitor:
        torch.save({"fresh": _Fresh(torch.arange(4.0))}, tmp_path / "c.pt", _use_new_zipfile_serialization=zipped)
    stats = monitor.stats()["torch_save"]
    assert stats.mismatch == 0 and stats.match + stats.close == 1, stats


def test_saves_that_cannot_be_loaded_back_to_compare_are_skipped_never_a_mismatch() -> None:
    from shadow.core.model.target import CannotCompare

    first, second = saving.Written(b"not a checkpoint", None), saving.Written(b"another", None)
    with pytest.raises(CannotCompare, match="cannot be loaded weights-only"):
        saving.difference(first, second)


def test_a_skipped_whole_model_save_says_why_and_what_compares_it(patched, tmp_path) -> None:
    from fakes import Recorder

    recorder = Recorder()
    with _monitor(["torch_save"], exporters=[recorder]):
        torch.save(torch.nn.Linear(2, 2), tmp_path / "model.pt")
    (observation,) = recorder.observations
    assert observation.reasons == ("ineligible",)
    assert "a whole module (torch.nn.modules.linear.Linear)" in observation.detail
    assert "the job's own classes" in observation.detail and "--trusted-checkpoints" in observation.detail
