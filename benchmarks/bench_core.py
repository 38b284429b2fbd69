"""Core costs, as ratios measured in one process (absolute times depend on the machine).

1. Unsampled ``Tensor.type`` through the shadow wrapper, against a bare pass-through Python wrapper
   of the same legacy function (goal: ratio <= 1.15).
2. The comparator's time (``Observation.compare_seconds``) against ``torch.testing.assert_close`` on
   the same 16M-element float32 pair, within tolerance but not bitwise equal (goal: ratio <= 1.0).

Run: ``python benchmarks/bench_core.py`` (``--quick`` for a smoke run).
"""

from __future__ import annotations

import argparse
import statistics
import time
import types

import torch

import shadow
from shadow import reference


def bench_unsampled(trials: int, calls: int) -> float:
    legacy = reference.npu_type

    def bare(*args, **kwargs):
        return legacy(*args, **kwargs)

    torch.Tensor.type = legacy
    with shadow.install(["tensor_type"], sample_rate=0.0) as monitor:
        wrapper = torch.Tensor.type
    x = torch.ones(4)
    dtype = torch.float32
    loop = range(calls)

    def timed(function) -> float:
        torch.Tensor.type = function
        start = time.perf_counter()
        for _ in loop:
            x.type(dtype)
        return time.perf_counter() - start

    ratios, bare_times = [], []
    try:
        timed(bare), timed(wrapper)  # warm up
        for i in range(trials):
            # interleave, alternating the order, so drift and turbo affect both alike
            if i % 2:
                b, w = timed(bare), timed(wrapper)
            else:
                w, b = timed(wrapper), timed(bare)
            ratios.append(w / b)
            bare_times.append(b)
    finally:
        del torch.Tensor.type
    ratio = statistics.median(ratios)
    print(
        f"unsampled .type(): shadow wrapper / bare wrapper = {ratio:.3f} (median of {trials} interleaved trials of "
        f"{calls} calls; bare wrapper {statistics.median(bare_times) / calls * 1e9:.0f} ns/call here; "
        f"calls counted: {monitor.stats()['tensor_type'].calls})"
    )
    return ratio


def bench_comparator(trials: int, numel: int) -> float:
    generator = torch.Generator().manual_seed(0)
    legacy_out = torch.randn(numel, generator=generator)
    upstream_out = legacy_out + legacy_out.abs() * 1e-7 * torch.randn(numel, generator=generator)
    assert not torch.equal(legacy_out, upstream_out)
    torch.testing.assert_close(upstream_out, legacy_out)

    ops = types.SimpleNamespace(op=lambda: legacy_out)
    observations = []
    exporter = types.SimpleNamespace(export=observations.append)
    target = shadow.Target("pair", ops, "op", lambda: upstream_out, isolate=False)

    ours, theirs = [], []
    with shadow.install([target], sample_rate=1.0, exporters=[exporter]):
        ops.op()  # warm up both
        torch.testing.assert_close(upstream_out, legacy_out)
        for _ in range(trials):
            ops.op()
            ours.append(observations[-1].compare_seconds)
            start = time.perf_counter()
            torch.testing.assert_close(upstream_out, legacy_out)
            theirs.append(time.perf_counter() - start)
    last = observations[-1]
    ratio = statistics.median(ours) / statistics.median(theirs)
    print(
        f"comparator on {numel:,} float32: compare_seconds / assert_close = {ratio:.3f} "
        f"(median {statistics.median(ours) * 1e3:.1f} ms vs {statistics.median(theirs) * 1e3:.1f} ms, "
        f"{trials} runs; "
        f"outcome {last.outcome}, max abs {last.max_abs_error:.3g}, max rel {last.max_rel_error:.3g}, "
        f"{last.mismatched} out of tolerance, NaN/inf positions checked, bitwise match checked)"
    )
    return ratio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a few small runs, to check the script works")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    if args.quick:
        bench_unsampled(trials=3, calls=2_000)
        bench_comparator(trials=2, numel=1 << 16)
    else:
        bench_unsampled(trials=41, calls=100_000)
        bench_comparator(trials=7, numel=16 * 1024 * 1024)


if __name__ == "__main__":
    main()
