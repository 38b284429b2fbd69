"""What a call counter at a release's patch costs (shadow.core.calls.patch_calls): each place's call, counted,
against the same call bare, as ratios measured in one run, the two interleaved (goal: <= 1.05x).

The places are function patches of torch_npu 2.14.0 a training job calls (npu-shadow census 2.14.0): a module's
forward (``Module.__call__``), printing a tensor (``Tensor.__repr__``), a save into memory (``serialization._save``),
a storage's copy to the host (``UntypedStorage.cpu``), and the cheapest call there is, one that returns at once (the
counter's own cost, for scale); a place this Python cannot count (all of them before Python 3.12: counting needs
``sys.monitoring``) says so. Then the same for the targets that shadow three of them (``tensor_repr``,
``torch_save``, ``storage_cpu``): their unsampled call (``sample_rate=0``, no first comparisons) against the bare call.
Run: ``python benchmarks/bench_patch_calls.py [--quick]``.
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys
import time
import types

import torch

import shadow

GOAL = 1.05


def _timed(call, repeat: int) -> float:
    started = time.perf_counter()
    for _ in range(repeat):
        call()
    return (time.perf_counter() - started) / repeat


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    args = parser.parse_args()
    rounds = 5 if args.quick else 21
    module = types.ModuleType("bench_places")
    module.noop = lambda: None
    sys.modules["bench_places"] = module
    linear, tensor = torch.nn.Linear(4, 4), torch.ones(4, 4)
    storage = tensor.untyped_storage()
    places = {
        "torch.nn.Module.__call__": (lambda: linear(tensor), 2_000),
        "torch.Tensor.__repr__": (lambda: repr(tensor), 200),
        "torch.serialization._save": (lambda: torch.save(tensor, io.BytesIO()), 200),
        "torch.storage.UntypedStorage.cpu": (lambda: storage.cpu(), 20_000),
        "bench_places.noop": (lambda: module.noop(), 200_000),
    }
    with shadow.install([], count_patches=list(places)) as monitor:  # (a C function, an older Python: not counted)
        uncounted = monitor.patches_uncounted()
    for name, why in uncounted.items():
        print(f"counted / bare call of {name}: not counted here ({why})")
    ratios: dict[str, list[float]] = {name: [] for name in places if name not in uncounted}
    for _ in range(rounds):
        for name in ratios:
            call, repeat = places[name]
            bare = _timed(call, repeat)
            with shadow.install([], count_patches=[name]) as monitor:
                counted = _timed(call, repeat)
                assert sum(monitor.patch_counts().values()) >= repeat
            ratios[name].append(counted / bare)
    for name, found in ratios.items():
        ratio = statistics.median(found)
        mark = "" if name == "bench_places.noop" else f" (goal <= {GOAL})"
        print(f"counted / bare call of {name}: {ratio:.3f}{mark}")
    _unsampled(places, rounds)


def _unsampled(places: dict, rounds: int) -> None:
    """The new targets' unsampled calls against the same calls bare."""
    from shadow.core.model import live_targets

    shadowed = {
        "tensor_repr": (live_targets.tensor_repr, places["torch.Tensor.__repr__"]),
        "torch_save": (live_targets.torch_save, places["torch.serialization._save"]),
        "storage_cpu": (live_targets.storage_cpu, places["torch.storage.UntypedStorage.cpu"]),
    }
    ratios: dict[str, list[float]] = {name: [] for name in shadowed}
    for _ in range(rounds):
        for name, (make, (call, repeat)) in shadowed.items():
            bare = _timed(call, repeat)
            with shadow.install([make()], sample_rate=0.0, first_per_signature=0) as monitor:
                wrapped = _timed(call, repeat)
                assert monitor.stats()[name].calls >= repeat and monitor.stats()[name].sampled == 0
            ratios[name].append(wrapped / bare)
    for name, found in ratios.items():
        print(f"unsampled / bare call of target {name}: {statistics.median(found):.3f}")


if __name__ == "__main__":
    main()
