"""``torch_load`` compares what it loaded and runs nothing twice: a loaded object is compared as what it holds (a
whole model by its state, an object by its fields), the shadow load reads the bytes the primary read (never the path
again, never the job's code again), its memory is sized from the archive's records, and nothing about a call that is
not sampled opens a file that is not a regular one. Legacy is torch_npu 2.13.0's own ``torch.load``."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import os
import threading
import types
import zipfile
from typing import Any

import pytest
import torch

import shadow
from shadow.core.judging.compare import compare
from shadow.core.model import live_targets, loaded
from shadow.core.support import memory


def _monitor(targets: Any = None, rate: float = 1.0) -> shadow.Monitor:
    return shadow.install(targets=targets, sample_rate=rate, seed=3, budget=None, deadline=None)


def _counts(monitor: shadow.Monitor, target: str = "torch_load") -> dict[str, Any]:
    stats = monitor.stats()[target]
    outcomes = {k: getattr(stats, k) for k in ("match", "close", "mismatch", "noise", "error", "skipped")}
    return {"outcomes": {k: v for k, v in outcomes.items() if v}, "reasons": dict(stats.by_reason)}


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    layers = torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(), torch.nn.Linear(2, 2)
    return torch.nn.Sequential(*layers)


# --------------------------------------------------------------------------- 1. compared as what it is


def test_whole_model_checkpoints_match_when_trusted_and_are_skipped_untrusted(patched, tmp_path) -> None:
    path = tmp_path / "model.pt"
    torch.save(_net(), path)
    with _monitor([live_targets.torch_load(trusted=True)]) as monitor:
        models = [torch.load(path, weights_only=False) for _ in range(20)]
        assert _counts(monitor) == {"outcomes": {"match": 20}, "reasons": {}}
    with _monitor() as monitor:
        torch.load(path, weights_only=False)
        assert _counts(monitor) == {"outcomes": {"skipped": 1}, "reasons": {"ineligible": 1}}
    assert all(torch.equal(m[0].weight, models[0][0].weight) for m in models)


def test_a_linear_a_namespace_and_a_dataclass_loaded_once_match(patched, tmp_path) -> None:
    path = tmp_path / "ckpt.pt"
    torch.save({"model": torch.nn.Linear(3, 2), "args": argparse.Namespace(lr=0.1, arch="resnet18"),
                "point": _Point(1, torch.ones(2))}, path)  # fmt: skip
    with _monitor([live_targets.torch_load(trusted=True)]) as monitor:
        torch.load(path, weights_only=False)
        assert _counts(monitor) == {"outcomes": {"match": 1}, "reasons": {}}


@dataclasses.dataclass
class _Point:
    x: int
    weights: torch.Tensor


class _Opaque:
    __slots__ = ()


class _Slotted:
    __slots__ = "value"  # (a single slot named by a string)

    def __init__(self, value: int) -> None:
        self.value = value


def test_a_loaded_object_is_compared_by_its_state_type_and_structure() -> None:
    first, second = _net(), _net()
    assert compare(loaded.comparable(first), loaded.comparable(second), exact=True).outcome == "match"
    with torch.no_grad():
        second[3].weight[0, 0] += 1
    found = compare(loaded.comparable(first), loaded.comparable(second), exact=True)
    assert (found.outcome, found.reasons) == ("mismatch", ("value",))
    assert "['_modules']['3']['_parameters']['weight']" in found.detail
    swapped = _net()
    swapped[2] = torch.nn.GELU()
    found = compare(loaded.comparable(first), loaded.comparable(swapped), exact=True)
    assert found.outcome == "mismatch" and "ReLU" in found.detail
    shared = torch.nn.Linear(2, 2)
    twice = loaded.comparable(torch.nn.Sequential(shared, shared))
    assert twice["_modules"]["1"] == "<the object at ._modules['0']>"
    assert loaded.comparable(_Slotted(3)) == {"__class__": f"{__name__}._Slotted", "value": 3}
    with pytest.raises(loaded.Uncomparable, match="_Opaque"):
        loaded.comparable({"x": _Opaque()})


def test_what_cannot_be_compared_is_a_comparator_skip_never_a_mismatch(patched, tmp_path) -> None:
    path = tmp_path / "opaque.pt"
    torch.save({"opaque": _Opaque()}, path)
    with _monitor([live_targets.torch_load(trusted=True)]) as monitor:
        torch.load(path, weights_only=False)
        assert _counts(monitor) == {"outcomes": {"skipped": 1}, "reasons": {"comparator": 1}}


# --------------------------------------------------------------------------- 4. read once, no code run twice


def _racing(path: os.PathLike, next_version: dict[str, bytes | None]) -> Any:
    """A torch.load whose file is republished by an atomic rename right after it read it (a trainer's latest.pt)."""

    def load(f: Any, *args: Any, **kwargs: Any) -> Any:
        result = torch.serialization.load(f, *args, **kwargs)
        if next_version["bytes"] is not None:
            staged = f"{path}.tmp"
            with open(staged, "wb") as out:
                out.write(next_version["bytes"])
            os.replace(staged, path)
        return result

    return load


def test_a_checkpoint_republished_by_rename_is_never_a_divergence(tmp_path) -> None:
    path = tmp_path / "latest.pt"
    versions = []
    for step in range(2):
        buffer = io.BytesIO()
        torch.save({"w": torch.full((3,), float(step))}, buffer)
        versions.append(buffer.getvalue())
    next_version: dict[str, bytes | None] = {"bytes": None}
    owner = types.SimpleNamespace(load=_racing(path, next_version))
    target = dataclasses.replace(live_targets.torch_load(), owner=owner, attribute="load")
    with _monitor([target]) as monitor:
        for step in range(60):
            path.write_bytes(versions[step % 2])
            next_version["bytes"] = versions[(step + 1) % 2]
            assert owner.load(path)["w"][0] == step % 2  # (each load consistent for the job)
        assert _counts(monitor) == {"outcomes": {"skipped": 60}, "reasons": {"ineligible": 60}}
        next_version["bytes"] = None
        owner.load(path)
        assert _counts(monitor)["outcomes"] == {"skipped": 60, "match": 1}


#: What the job's own registry saw: a class whose unpickling registers it, and refuses a second registration.
REGISTRY: list[str] = []


def _register(name: str) -> str:
    if name in REGISTRY:
        raise RuntimeError(f"{name} is registered already")
    REGISTRY.append(name)
    return name


class _Registered:
    def __reduce__(self) -> tuple:
        return _register, ("plugin",)


def test_a_pickles_code_runs_once_and_a_callable_map_location_is_called_once(patched, tmp_path) -> None:
    path = tmp_path / "plugin.pt"
    torch.save({"plugin": _Registered(), "w": torch.ones(2)}, path)
    REGISTRY.clear()
    calls: list[str] = []

    def location(storage: Any, where: str) -> Any:
        calls.append(where)
        return storage

    with _monitor() as monitor:
        assert torch.load(path, weights_only=False)["plugin"] == "plugin"
        REGISTRY.clear()
        torch.load(path, map_location=location, weights_only=False)
        counts = _counts(monitor)
    assert REGISTRY == ["plugin"] and calls == ["cpu"]
    assert counts == {"outcomes": {"skipped": 2}, "reasons": {"ineligible": 2}}


def test_a_weights_only_checkpoint_is_compared_whatever_weights_only_says(patched, tmp_path) -> None:
    path = tmp_path / "state.pt"
    torch.save({"w": torch.arange(4.0), "step": 3}, path)
    torch.save({"w": torch.arange(4.0)}, tmp_path / "old.pt", _use_new_zipfile_serialization=False)
    with _monitor() as monitor:
        torch.load(path, weights_only=False)
        torch.load(path, map_location="cpu")
        torch.load(tmp_path / "old.pt", weights_only=False)
        assert _counts(monitor) == {"outcomes": {"match": 3}, "reasons": {}}


# --------------------------------------------------------------------------- 5. sized from the archive's records


def _deflated_checkpoint(path: os.PathLike, megabytes: int) -> None:
    buffer = io.BytesIO()
    torch.save({"w": torch.zeros(megabytes << 18)}, buffer)
    with zipfile.ZipFile(io.BytesIO(buffer.getvalue())) as source, zipfile.ZipFile(path, "w") as out:
        for info in source.infolist():
            out.writestr(info.filename, source.read(info), zipfile.ZIP_DEFLATED)


def test_a_small_deflated_checkpoint_is_sized_by_what_it_loads_to(patched, tmp_path, monkeypatch) -> None:
    path = tmp_path / "deflated.pt"
    _deflated_checkpoint(path, 64)
    assert path.stat().st_size < (1 << 20)
    monkeypatch.setattr(memory, "host_free_bytes", lambda: 100 << 20)  # (64 MiB do not fit in half of 100)
    with _monitor() as monitor:
        assert torch.load(path)["w"].numel() == 64 << 18
        assert _counts(monitor) == {"outcomes": {"skipped": 1}, "reasons": {"oom": 1}}
    monkeypatch.setattr(memory, "host_free_bytes", lambda: 1 << 40)
    with _monitor() as monitor:
        torch.load(path)
        assert _counts(monitor) == {"outcomes": {"match": 1}, "reasons": {}}


# --------------------------------------------------------------------------- 6. nothing opened that is not a file


def _unblocked(path: str, body: Any, seconds: float = 30) -> Any:
    """``body()`` on a thread of its own; where it blocks on the FIFO past ``seconds``, a writer that writes nothing
    lets its open return (the suite goes on) and the test fails."""
    outcome: list[Any] = [None]

    def run() -> None:
        try:
            outcome[0] = body()
        except BaseException as exc:
            outcome[0] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        with open(path, "wb"):
            pass
        thread.join(seconds)
        pytest.fail(f"{body} blocked on the FIFO")
    return outcome[0]


def _load_from_fifo(path: str, data: bytes) -> Any:
    def write() -> None:
        with contextlib.suppress(BrokenPipeError), open(path, "wb") as pipe:
            pipe.write(data)  # (the load gives up before the end: the pipe breaks)

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    failure = _unblocked(path, lambda: torch.load(path))
    writer.join(30)
    return failure


@pytest.mark.parametrize("rate", [1.0, 1e-9])
def test_a_fifo_is_never_opened_by_the_signature_or_the_shadow_side(patched, tmp_path, rate) -> None:
    buffer = io.BytesIO()
    torch.save({"w": torch.ones(2)}, buffer)
    fifo = str(tmp_path / "pipe.pt")
    os.mkfifo(fifo)
    unwrapped = _load_from_fifo(fifo, buffer.getvalue())
    with _monitor(rate=rate) as monitor:
        shadowed = _load_from_fifo(fifo, buffer.getvalue())
        counts = _counts(monitor)
    assert isinstance(unwrapped, BaseException)
    assert type(shadowed) is type(unwrapped) and str(shadowed) == str(unwrapped)
    if rate == 1.0:
        assert counts == {"outcomes": {"skipped": 1}, "reasons": {"ineligible": 1}}
    assert _unblocked(fifo, lambda: live_targets.checkpoint_format(fifo), seconds=5) == "special"


@pytest.mark.parametrize("variable, outcome", [("1", "match"), ("0", "skipped")])
def test_the_launchers_setting_trusts_the_checkpoints(patched, tmp_path, variable, outcome) -> None:
    from shadow.launcher import config as cfg

    path = tmp_path / "model.pt"
    torch.save(torch.nn.Linear(2, 2), path)
    settings = cfg.from_sources({"NPU_SHADOW_TRUSTED_CHECKPOINTS": variable}).monitor_settings(rolled_back=False)
    with shadow.install(["torch_load"], sample_rate=1.0, settings=settings) as monitor:
        torch.load(path, weights_only=False)
        assert _counts(monitor)["outcomes"] == {outcome: 1}


@pytest.mark.parametrize("isolate", [True, False])
def test_a_replay_gives_the_shadow_run_its_arguments_whether_or_not_the_target_isolates(isolate) -> None:
    seen: list[str] = []
    owner = types.SimpleNamespace(op=lambda x: x)

    def upstream(x: str) -> str:
        seen.append(x)
        return x

    def replay(args: tuple, kwargs: dict) -> Any:
        return lambda: (("read once",), {})

    target = shadow.Target("op", owner, "op", upstream, isolate=isolate, replay=replay)
    with _monitor([target]):
        assert owner.op("the caller's") == "the caller's"
    assert seen == ["read once"]


# --------------------------------------------------------------------------- real code, round 7


class _LanguageModel(torch.nn.Module):
    """word_language_model's RNN model in small: an embedding, an LSTM (its ``_flat_weight_refs`` are weak
    references to its parameters), a decoder."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder, self.rnn, self.decoder = torch.nn.Embedding(10, 4), torch.nn.LSTM(4, 4), torch.nn.Linear(4, 10)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.rnn(self.encoder(tokens))[0])


@pytest.mark.parametrize("rnn", [torch.nn.LSTM, torch.nn.GRU, torch.nn.RNN])
def test_a_whole_model_holding_an_rnn_matches_its_second_load(patched, tmp_path, rnn) -> None:
    """Both loads have the same class and a bitwise-equal state: a match. (Comparing the RNN's weak references by
    ``==`` compared its parameters and raised: a false ``mismatch(value)`` that rolled word_language_model back.)"""
    model = _LanguageModel()
    model.rnn = rnn(4, 4)
    torch.save(model, tmp_path / "model.pt")
    with _monitor([live_targets.torch_load(trusted=True)]) as monitor:
        loaded_model = torch.load(tmp_path / "model.pt", weights_only=False)
    assert _counts(monitor) == {"outcomes": {"match": 1}, "reasons": {}}
    assert torch.equal(loaded_model.rnn.weight_hh_l0, model.rnn.weight_hh_l0)


def test_a_weak_reference_is_read_as_what_it_refers_to_in_its_own_graph() -> None:
    import weakref

    class Holder:
        pass

    first, second = Holder(), Holder()
    first.value, second.value = torch.ones(2), torch.ones(2)
    first.refs, second.refs = [weakref.ref(first)], [weakref.ref(second)]
    assert compare(loaded.comparable(first), loaded.comparable(second), exact=True).outcome == "match"
    second.value = torch.zeros(2)
    assert compare(loaded.comparable(first), loaded.comparable(second), exact=True).outcome == "mismatch"


def _without_byteorder(obj: Any) -> bytes:
    """A checkpoint written without its byte-order record (as older torch wrote them)."""
    buffer, out = io.BytesIO(), io.BytesIO()
    torch.save(obj, buffer)
    source = zipfile.ZipFile(io.BytesIO(buffer.getvalue()))
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as rewritten:
        for info in source.infolist():
            if not info.filename.endswith("/byteorder"):
                rewritten.writestr(info, source.read(info))
    return out.getvalue()


def test_a_load_under_a_threads_own_serialization_settings_runs_its_shadow_under_them(patched) -> None:
    """``set_default_load_endianness`` is per thread in torch 2.13 (a context variable), as are the mmap options,
    and ``torch.serialization.skip_data`` is a thread-local: the shadow load, on a thread of its own, runs under the
    caller's. (It read the other byte order: a false ``mismatch(value)``; 10 of PyTorch's own
    ``test_serialization_load_bom_data*`` tests flipped under strict.)"""
    data = _without_byteorder({"w": torch.arange(4, dtype=torch.int32)})
    torch.serialization.set_default_load_endianness(torch.serialization.LoadEndianness.BIG)
    try:
        swapped = torch.load(io.BytesIO(data))["w"]
        with _monitor() as monitor:
            got = torch.load(io.BytesIO(data))["w"]
    finally:
        torch.serialization.set_default_load_endianness(None)
    assert torch.equal(got, swapped) and swapped[1] == 1 << 24
    assert _counts(monitor) == {"outcomes": {"match": 1}, "reasons": {}}


def test_the_shadow_runs_context_variables_and_serialization_locals_are_the_callers() -> None:
    import contextvars

    setting = contextvars.ContextVar("setting", default="unset")
    seen = []

    def upstream(x: Any) -> Any:
        seen.append((setting.get(), torch.serialization._serialization_tls.skip_data))
        setting.set("upstream's own")  # (in a copy: never the caller's)
        return x * 2

    ops = types.SimpleNamespace(op=lambda x: x * 2)
    token = setting.set("the caller's")
    torch.serialization._serialization_tls.skip_data = True
    try:
        with _monitor([shadow.Target("op", ops, "op", upstream)]):
            ops.op(torch.ones(2))
        assert setting.get() == "the caller's"
    finally:
        torch.serialization._serialization_tls.skip_data = False
        setting.reset(token)
    assert seen == [("the caller's", True)]
