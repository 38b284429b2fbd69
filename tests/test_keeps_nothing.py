"""A sampled call drops every reference it made when it ends: the shadow run's argument copies, its result and the
backward comparison's graphs are gone once the call returns, however many sampled calls follow."""

from __future__ import annotations

import gc
import time
import types
import warnings
import weakref

import pytest
import torch

import shadow


def _live_storage_bytes() -> int:
    gc.collect()
    storages: dict[int, int] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (a deprecated torch attribute met on the way)
        for obj in gc.get_objects():
            if type(obj) in (torch.Tensor, torch.nn.Parameter):
                storage = obj.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def test_the_shadow_runs_copies_and_result_are_gone_when_the_call_returns() -> None:
    made: list[weakref.ref] = []

    def upstream(x: torch.Tensor) -> torch.Tensor:
        made.append(weakref.ref(x))  # (the isolation's copy of the argument)
        result = x * 2
        made.append(weakref.ref(result))
        return result

    ops = types.SimpleNamespace(op=lambda x: x * 2)
    target = shadow.Target("op", ops, "op", upstream)
    with shadow.install([target], sample_rate=1.0, seed=0, budget=None, deadline=None) as monitor:
        for _ in range(6):
            ops.op(torch.ones(1 << 16))
        assert monitor.stats()["op"].match == 6
        assert len(made) == 12 and _dropped(made)


def _dropped(made: list[weakref.ref], seconds: float = 10.0) -> bool:
    """Whether every object ``made`` refers to is gone, waited for a little (a worker thread returns from its run
    a moment after the caller has its result)."""
    deadline = time.monotonic() + seconds
    while True:
        gc.collect()
        if all(ref() is None for ref in made) or time.monotonic() > deadline:
            return all(ref() is None for ref in made)
        time.sleep(0.01)


def _forward(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return module(x)


@pytest.mark.parametrize("backward_rate", [0.0, 1.0])
def test_sampled_calls_leave_no_tensor_alive_that_the_unwrapped_calls_do_not(backward_rate) -> None:
    ops = types.SimpleNamespace(op=_forward)
    torch.manual_seed(0)
    model, x = torch.nn.Linear(512, 512), torch.randn(4, 512)
    before = _live_storage_bytes()
    ops.op(model, x).sum().backward()
    model.zero_grad(set_to_none=True)
    unwrapped = _live_storage_bytes() - before
    target = shadow.Target("op", ops, "op", _forward)
    options = {"sample_rate": 1.0, "seed": 0, "budget": None, "deadline": None, "backward_rate": backward_rate}
    with shadow.install([target], **options) as monitor:
        for _ in range(6):
            ops.op(model, x).sum().backward()
            model.zero_grad(set_to_none=True)
        deadline = time.monotonic() + 10  # (a worker returns from its run a moment after the caller has its result)
        while (shadowed := _live_storage_bytes() - before) != unwrapped and time.monotonic() < deadline:
            time.sleep(0.01)
        assert monitor.stats()["op"].backward_runs == (6 if backward_rate else 0)
    assert shadowed == unwrapped == 0


def test_noise_pending_differences_are_bounded_in_bytes_not_only_in_number() -> None:
    """150 held differences of 1,000 leaves each took 36 MB: now what is held stays within MAX_PENDING_BYTES, as
    tracemalloc measures it."""
    import tracemalloc

    from shadow.core.calls.record.held import MAX_PENDING_BYTES, HeldDifferences
    from shadow.core.model.observation import Observation, Outcome

    held = HeldDifferences()
    tracemalloc.start()
    try:
        before, _ = tracemalloc.get_traced_memory()
        kept = 0
        for call in range(150):
            leaves = tuple((f"['layer{i}']['weight'][{call}]", float(i)) for i in range(1000))
            observation = Observation("op", Outcome.MISMATCH, ("value",), leaf_errors=leaves, noise_pending=True)
            if not held.hold(observation):
                break
            kept += 1
        del leaves, observation
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert 0 < kept < 150 and len(held) == kept
    assert grown <= MAX_PENDING_BYTES * 1.1, (grown, kept)
    assert len(held.release()) == kept and held.hold(Observation("op", Outcome.MISMATCH, ("value",)))
