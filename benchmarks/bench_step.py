"""The example job's training step on 2 emulated npu devices: unwrapped vs sample rate 0.01 vs 1.0.

Every figure is a ratio measured in this one process, the three configurations interleaved trial by
trial (rotating their order) so that drift and a busy machine touch them alike:

1. step time: (total time of the steps at rate r) / (total time unwrapped) over the trials, each trial
   sampling with its own seed; goals: 0.01 <= 1.02x, 1.0 <= 2.5x; and rate 0.01 coverage-guided once every
   signature's first 30 calls were compared (goal <= 1.03x); and rate 1.0 with the backward comparison on every
   sampled DataParallel call (its cost; no goal). A step is the example's: npu casts by
   type name and class, DataParallel forward over both devices (``data_parallel`` every fourth step),
   loss, backward, SGD step. Every built-in target is shadowed, over shadow.npu.reference's legacy.
2. peak memory: the RSS high-water mark of one step at rate 1.0 against one unwrapped step, each
   measured from a reset high-water mark (Linux ``/proc/self/clear_refs``), on a batch of 512 so that
   the step's own tensors show above the allocator's reuse; goal <= 1.3x. The growth above the RSS the
   step started from is printed too.

Run: ``python benchmarks/bench_step.py`` (``--quick`` for a smoke run; the first run builds the
emulated npu).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import os
import statistics
import sys
import time
import warnings

import torch
from torch import nn

from shadow.npu import emulated

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEVICES = [0, 1]


def _example_net() -> type[nn.Module]:
    spec = importlib.util.spec_from_file_location(
        "train_dataparallel", os.path.join(ROOT, "examples", "train_dataparallel.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.Net


class Job:
    """The example's model, optimizer and a fixed batch on the emulated npu."""

    def __init__(self, batch: int) -> None:
        torch.manual_seed(0)
        self.net = _example_net()().to("npu:0")
        self.model = nn.DataParallel(self.net, device_ids=DEVICES)
        self.optimizer = torch.optim.SGD(self.net.parameters(), lr=0.01, momentum=0.9)
        self.images = torch.randn(batch, 3, 16, 16)
        self.labels = torch.randint(0, 4, (batch,))
        self.count = 0

    def step(self) -> None:
        images = self.images.type("torch.npu.FloatTensor")
        labels = self.labels.type(torch.npu.LongTensor)
        if self.count % 4 == 3:
            logits = nn.parallel.data_parallel(self.net, images, device_ids=DEVICES)
        else:
            logits = self.model(images)
        loss = nn.functional.cross_entropy(logits, labels)
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        loss.type(torch.float64).item()
        self.count += 1


def _monitor(rate: float | None, seed: int = 0, backward_rate: float = 0.0):
    if rate is None:
        return contextlib.nullcontext()
    import shadow

    # uniform sampling: what the rate alone costs (coverage guidance is measured on its own below)
    return shadow.install(sample_rate=rate, seed=seed, first_per_signature=0, backward_rate=backward_rate)


def timed_steps(job: Job, rate: float | None, steps: int, seed: int = 0, backward_rate: float = 0.0) -> float:
    # a new seed each trial: at rate 0.01 which calls are sampled (a cheap cast or a DataParallel forward)
    # varies as in a real job, instead of one fixed pattern repeated in every trial
    with _monitor(rate, seed, backward_rate):
        start = time.perf_counter()
        for _ in range(steps):
            job.step()
        return time.perf_counter() - start


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def peak_rss(job: Job, rate: float | None) -> tuple[int, int] | None:
    """(RSS high-water mark of one step, RSS before it) in KiB, or None where it cannot be reset."""
    with _monitor(rate):
        job.step()  # warm: the monitor's first sampled call allocates what it keeps
        gc.collect()
        try:
            with open("/proc/self/clear_refs", "w") as clear:
                clear.write("5")  # reset the peak RSS (VmHWM) to the current RSS
        except OSError:
            return None
        before = _status_kib("VmRSS")
        job.step()
        return _status_kib("VmHWM"), before


def guided_steady_state(job: Job, trials: int, steps: int) -> None:
    """Rate 0.01 with coverage guidance, after the first 30 calls of every signature were compared (what a long
    job pays from then on), against unwrapped, interleaved."""
    import shadow

    guided, unwrapped = [], []
    with shadow.install(sample_rate=0.01, seed=0, first_per_signature=30) as monitor:
        first_steps = 0
        # every signature of the step past its first 30 calls (data_parallel's come one step in four)
        while not all(
            monitor.stats()[name].calls and monitor.experiment(name).first_comparisons_done for name in monitor.targets
        ):
            job.step()
            first_steps += 1
        first = sum(s.compared for s in monitor.stats().values())
        for trial in range(trials):
            if trial % 2:  # (the order rotated, as the other configurations': drift touches both alike)
                monitor.uninstall()
                unwrapped.append(timed_steps(job, None, steps))
                monitor._patch()
            start = time.perf_counter()
            for _ in range(steps):
                job.step()
            guided.append(time.perf_counter() - start)
            if not trial % 2:
                monitor.uninstall()
                unwrapped.append(timed_steps(job, None, steps))
                monitor._patch()
    ratio = sum(guided) / sum(unwrapped)
    print(
        f"step time, rate 0.01 coverage-guided after its first 30 calls per signature / unwrapped = {ratio:.3f} "
        f"(goal <= 1.03 {'ok' if ratio <= 1.03 else 'OVER GOAL'}; the {first} first comparisons, in the first "
        f"{first_steps} steps, are a one-off)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a smoke run: few trials, few steps")
    args = parser.parse_args()
    trials, steps = (2, 2) if args.quick else (21, 16)
    warnings.filterwarnings("ignore", "PyTorch is not compiled with NCCL support")
    emulated.install(2)
    from shadow.npu import reference

    patches = reference.patch_torch()  # the legacy here: shadow.npu.reference (torch_npu where it is imported)
    try:
        job = Job(batch=32)
        configurations = {
            "unwrapped": (None, 0.0),
            "rate 0.01": (0.01, 0.0),
            "rate 1.0": (1.0, 0.0),
            "rate 1.0 with backward comparison": (1.0, 1.0),
        }
        for rate, backward in configurations.values():
            timed_steps(job, rate, 2, backward_rate=backward)  # warm up
        times: dict[str, list[float]] = {name: [] for name in configurations}
        names = list(configurations)
        for trial in range(trials):
            turn = trial % len(names)
            for name in names[turn:] + names[:turn]:
                rate, backward = configurations[name]
                times[name].append(timed_steps(job, rate, steps, seed=trial, backward_rate=backward))
        base = times["unwrapped"]
        print(
            f"step time, unwrapped: median {statistics.median(base) / steps * 1e3:.1f} ms/step "
            f"({trials} trials of {steps} steps, interleaved)"
        )
        for name, goal in (("rate 0.01", 1.02), ("rate 1.0", 2.5)):
            # total over the trials: the expected cost, whichever calls each trial happened to sample
            ratio = sum(times[name]) / sum(base)
            verdict = "ok" if ratio <= goal else "OVER GOAL"
            print(f"step time, {name} / unwrapped = {ratio:.3f} (goal <= {goal}) {verdict}")
        name = "rate 1.0 with backward comparison"
        print(
            f"step time, {name} on every sampled DataParallel call / unwrapped = "
            f"{sum(times[name]) / sum(base):.3f} (no goal: its cost, in docs/benchmarks.md)"
        )
        # (blocks of 2 steps, 8 times as many: the two alternate often enough that drift touches both alike)
        guided_steady_state(job, trials * 8, max(1, steps // 8))
        big = Job(batch=64 if args.quick else 512)
        plain, sampled = peak_rss(big, None), peak_rss(big, 1.0)
        if plain is None or sampled is None:
            print("peak RSS: unavailable (cannot reset the high-water mark on this system)")
        else:
            ratio = sampled[0] / plain[0]
            verdict = "ok" if ratio <= 1.3 else "OVER GOAL"
            print(
                f"peak RSS of a step, rate 1.0 / unwrapped = {ratio:.3f} (goal <= 1.3) {verdict}; "
                f"{sampled[0] / 1024:.0f} vs {plain[0] / 1024:.0f} MiB, growth during the step "
                f"{(sampled[0] - sampled[1]) / 1024:.1f} vs {(plain[0] - plain[1]) / 1024:.1f} MiB"
            )
    finally:
        patches.undo()


if __name__ == "__main__":
    sys.exit(main())
