"""Core costs, as ratios measured in one process (absolute times depend on the machine).

1. Unsampled ``Tensor.type`` through the shadow wrapper, against a bare pass-through Python wrapper
   of the same legacy function (goal: ratio <= 1.15), and the same through the coverage-guided wrapper, which
   classifies every call by its signature (reported: the price of coverage guidance, not held to that goal).
2. The comparator's time (``Observation.compare_seconds``) against ``torch.testing.assert_close`` on
   the same 16M-element float32 pair, within tolerance but not bitwise equal, on an idle machine and with every
   core kept busy by spinning processes (goals: ratio <= 0.5 idle, <= 1.0 busy).
3. The same on the host's accelerator (the emulated npu where there is none), ``shadow.compare`` against
   ``assert_close`` on a float32 and a bfloat16 pair, each ended by a synchronize: with the device's one fused pass
   per leaf, and with torch's eager kernels in its place (goal on a GPU: <= 0.5 with the fused pass).

Run: ``python benchmarks/bench_core.py`` (``--quick`` for a smoke run).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import multiprocessing
import os
import statistics
import time
import types
from collections.abc import Iterator
from unittest import mock

import torch

import shadow
from shadow.npu import reference


def bench_unsampled(trials: int, calls: int, first_per_signature: int = 0) -> float:
    legacy = reference.npu_type

    def bare(*args, **kwargs):
        return legacy(*args, **kwargs)

    torch.Tensor.type = legacy
    with shadow.install(["tensor_type"], sample_rate=0.0, first_per_signature=first_per_signature) as monitor:
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
    which = "coverage-guided wrapper" if first_per_signature else "shadow wrapper"
    print(
        f"unsampled .type(): {which} / bare wrapper = {ratio:.3f} (median of {trials} interleaved trials of "
        f"{calls} calls; bare wrapper {statistics.median(bare_times) / calls * 1e9:.0f} ns/call here; "
        f"calls counted: {monitor.stats()['tensor_type'].calls})"
    )
    return ratio


def _spin() -> None:
    while True:
        pass


@contextlib.contextmanager
def every_core_busy() -> Iterator[int]:
    """One spinning process per core for the duration (they are killed afterwards)."""
    cores = os.cpu_count() or 1
    spinners = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(cores)]
    for spinner in spinners:
        spinner.start()
    try:
        time.sleep(0.5)
        yield cores
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.join()


def bench_comparator(trials: int, numel: int, label: str = "idle") -> float:
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
    with shadow.install([target], sample_rate=1.0, exporters=[exporter]) as monitor:
        ops.op()  # warm up both
        torch.testing.assert_close(upstream_out, legacy_out)
        for _ in range(trials):
            ops.op()
            monitor.deliver()
            ours.append(observations[-1].compare_seconds)
            start = time.perf_counter()
            torch.testing.assert_close(upstream_out, legacy_out)
            theirs.append(time.perf_counter() - start)
    last = observations[-1]
    ratio = statistics.median(ours) / statistics.median(theirs)
    print(
        f"comparator on {numel:,} float32, {label}: compare_seconds / assert_close = {ratio:.3f} "
        f"(median {statistics.median(ours) * 1e3:.1f} ms vs {statistics.median(theirs) * 1e3:.1f} ms, "
        f"{trials} runs; "
        f"outcome {last.outcome}, max abs {last.max_abs_error:.3g}, max rel {last.max_rel_error:.3g}, "
        f"{last.mismatched} out of tolerance, NaN/inf positions checked, bitwise match checked)"
    )
    return ratio


def bench_device_comparator(numel: int) -> None:
    from shadow.core.judging import fused
    from shadow.launcher import validate

    device = validate.find_device()
    sizes = dataclasses.replace(validate.FULL, comparator_elements=numel)
    eager = mock.patch.object(fused, "kernel_for", lambda device_type: None)
    for label, reduction in (("one fused pass", contextlib.nullcontext()), ("torch's eager kernels", eager)):
        with reduction:
            figures = validate.check_comparator(device, sizes)
        for dtype, found in figures.items():
            print(
                f"comparator on {device.label}, {numel:,} {dtype}, {label}: compare / assert_close = "
                f"{found['ratio']:.3f} (median {found['compare'] * 1e3:.2f} ms vs "
                f"{found['assert_close'] * 1e3:.2f} ms; {found['pass']})"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a few small runs, to check the script works")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    trials, numel = (2, 1 << 16) if args.quick else (7, 16 * 1024 * 1024)
    for first in (0, 30):  # (the first 30 calls of the one signature are compared: not in the timed loops)
        if args.quick:
            bench_unsampled(trials=3, calls=2_000, first_per_signature=first)
        else:
            bench_unsampled(trials=41, calls=100_000, first_per_signature=first)
    idle = bench_comparator(trials, numel)
    with every_core_busy() as cores:
        busy = bench_comparator(trials, numel, f"{cores} cores busy")
    print(
        f"comparator goals: idle {idle:.3f} <= 0.5 {'ok' if idle <= 0.5 else 'MISSED'}; "
        f"busy {busy:.3f} <= 1.0 {'ok' if busy <= 1.0 else 'MISSED'}"
    )
    bench_device_comparator(max(numel, 1 << 18))  # (leaves of SMALL_ON_HOST elements or fewer go to the host)


if __name__ == "__main__":
    main()
