"""A real model under the launcher's defaults: torchvision's ResNet-18 in DataParallel on 2 emulated npus.

The job: ResNet-18 (``benchmarks/resnet18.py``, torchvision's layout) in ``nn.DataParallel`` over npu:0 and npu:1,
SGD with momentum, a batch of 16 images of 3x64x64 cast to the npu by type name and class as legacy code does,
every built-in target shadowed over ``shadow.npu.reference``'s legacy. Every figure is a ratio measured in this one
run, the configurations interleaved in rounds (rotating their order) so drift and a busy machine touch them alike:

1. A short job's first comparisons, with the launcher's defaults (coverage guidance: the first 30 calls of every
   signature compared whatever the rate; budget 0.2; oracle 0.1; A/A 0.05; backward 0.05; truth 0.25): how many
   steps and calls until every signature's first comparisons are done, and the shadow side's time over them.
2. Step time after the first comparisons, launcher defaults (rate 0.01) / unwrapped (goal <= 1.05), and at rate
   1.0 (every call compared, no budget, the launcher's oracle and A/A rates, no backward comparison) / unwrapped
   (goal <= 1.5).
3. The budget over every 10 s window of the defaults' run, first comparisons included: the shadow side's time as
   measured here (the shadow side's plan, its run after legacy and the classifying, each timed around the
   engine's own methods, independently of the budget's own accounting) over each window (goal <= 0.2 + 0.05).
4. Peak RSS of one step at rate 1.0 against one unwrapped step (goal <= 1.3).

Run: ``python benchmarks/bench_resnet.py`` (``--quick`` for a smoke run; the first run builds the emulated npu).
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import dataclasses
import functools
import gc
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator

import torch
from bench_step import _status_kib  # (the same /proc reading as the example step's benchmark)
from resnet18 import ResNet18
from torch import nn

import shadow
from shadow.core.calls.gate import coverage
from shadow.core.calls.gate.budget import WINDOW_SECONDS
from shadow.core.calls.sampled import call
from shadow.launcher.config import Config
from shadow.npu import emulated

DEVICES = [0, 1]


class Job:
    """ResNet-18 in DataParallel, its optimizer and a fixed batch."""

    def __init__(self, batch: int, size: int) -> None:
        torch.manual_seed(0)
        self.net = ResNet18(num_classes=10).to("npu:0")
        self.model = nn.DataParallel(self.net, device_ids=DEVICES)
        self.optimizer = torch.optim.SGD(self.net.parameters(), lr=0.01, momentum=0.9)
        self.images = torch.randn(batch, 3, size, size)
        self.labels = torch.randint(0, 10, (batch,))

    def step(self) -> None:
        images = self.images.type("torch.npu.FloatTensor")
        labels = self.labels.type(torch.npu.LongTensor)
        loss = nn.functional.cross_entropy(self.model(images), labels)
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        loss.item()


def launcher_defaults() -> dict:
    """``shadow.install`` arguments of ``npu-shadow run`` with no settings (shadow.launcher.config's defaults)."""
    config = Config()
    return {
        "sample_rate": config.sample_rate,
        "oracle": config.oracle,
        "budget": config.budget,
        "deadline": config.deadline,
        "first_per_signature": config.first_per_signature,
        "aa_rate": config.aa_rate,
        "backward_rate": config.backward_rate,
        "truth_rate": config.truth_rate,
    }


def every_call(seed: int) -> shadow.Monitor:
    """Rate 1.0: every call compared (uniform, no budget), the launcher's oracle and A/A rates (no backward
    comparison: its cost is bench_step's)."""
    overrides = {"sample_rate": 1.0, "budget": None, "first_per_signature": 0, "backward_rate": 0.0}
    return shadow.install(**{**launcher_defaults(), **overrides})


@dataclasses.dataclass
class ShadowClock:
    """The shadow side's time, measured around the engine's own methods: (start, seconds) of each stretch."""

    stretches: list[tuple[float, float]] = dataclasses.field(default_factory=list)
    _depth: threading.local = dataclasses.field(default_factory=threading.local)

    @contextlib.contextmanager
    def timing(self) -> Iterator[None]:
        patched = [
            (call, "plan"),  # (a sampled call's plan, as the call reads it)
            (call.SampledCall, "_shadow_side"),
            (coverage.Classifier, "classify"),
        ]
        originals = [(owner, name, vars(owner)[name]) for owner, name in patched]
        for owner, name in patched:
            setattr(owner, name, self._timed(getattr(owner, name)))
        try:
            yield
        finally:
            for owner, name, original in originals:
                setattr(owner, name, original)

    def _timed(self, function: Callable) -> Callable:
        @functools.wraps(function)
        def timed(*args, **kwargs):
            depth = getattr(self._depth, "n", 0)
            self._depth.n = depth + 1
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self._depth.n = depth
                if not depth:  # (the outermost: a nested call's time is in it already)
                    self.stretches.append((start, time.perf_counter() - start))

        return timed

    def seconds(self) -> float:
        return sum(seconds for _, seconds in self.stretches)

    def worst_window(self, start: float, end: float, window: float = WINDOW_SECONDS) -> tuple[float, float]:
        """(greatest share of a ``window``-second window of [start, end] spent on the shadow side, the window)."""
        window = min(window, end - start)
        starts = [s for s, _ in self.stretches]
        totals = [0.0]
        for _, seconds in self.stretches:
            totals.append(totals[-1] + seconds)
        worst = 0.0
        for first in starts:  # (every window that begins at a stretch's start: the worst is among them)
            first = min(first, end - window)
            i, j = bisect.bisect_left(starts, first), bisect.bisect_left(starts, first + window)
            worst = max(worst, (totals[j] - totals[i]) / window)
        return worst, window


def _steps(job: Job, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        job.step()
    return time.perf_counter() - start


def peak_rss(job: Job, monitor: Callable[[], contextlib.AbstractContextManager]) -> int | None:
    """The RSS high-water mark of one step, in KiB, or None where it cannot be reset."""
    with monitor():
        job.step()  # (warm: the monitor's first sampled call allocates what it keeps)
        gc.collect()
        try:
            with open("/proc/self/clear_refs", "w") as clear:
                clear.write("5")  # reset the peak RSS (VmHWM) to the current RSS
        except OSError:
            return None
        job.step()
        return _status_kib("VmHWM")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a smoke run: few steps, small images")
    args = parser.parse_args()
    rounds, steps, contiguous, size = (2, 3, 40, 32) if args.quick else (8, 25, 200, 64)
    warnings.filterwarnings("ignore", "PyTorch is not compiled with NCCL support")
    emulated.install(2)
    from shadow.npu import reference

    patches = reference.patch_torch()  # the legacy here: shadow.npu.reference (torch_npu where it is imported)
    try:
        job = Job(batch=16, size=size)
        _steps(job, 2)  # warm up
        print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; ResNet-18, batch 16 of 3x{size}x{size}")

        clock = ShadowClock()
        defaults = shadow.install(**launcher_defaults())
        with clock.timing():
            # 1, 3: the defaults alone, contiguous, from install: the first comparisons, then on to `contiguous` steps
            began = time.perf_counter()
            done_after = None
            for step in range(1, contiguous + 1):
                job.step()
                if done_after is None and all(defaults.experiment(n).first_comparisons_done for n in defaults.targets):
                    done_after = (step, time.perf_counter() - began, clock.seconds(), defaults.stats())
            ended = time.perf_counter()
        if done_after is None:
            print(f"first comparisons, launcher defaults: not done after {contiguous} steps")
        else:
            first_steps, first_seconds, first_shadow, stats = done_after
            print(
                f"first comparisons, launcher defaults: done after {first_steps} steps, "
                f"{sum(s.calls for s in stats.values())} calls, {sum(s.compared for s in stats.values())} compared, "
                f"{sum(s.by_reason.get('budget', 0) for s in stats.values())} skipped for the budget; "
                f"{first_seconds:.1f} s of job time, {first_shadow:.1f} s of it on the shadow side "
                f"({first_shadow / first_seconds:.3f}; budget {launcher_defaults()['budget']})"
            )
        worst, window = clock.worst_window(began, ended)
        goal = launcher_defaults()["budget"] + 0.05
        print(
            f"budget, launcher defaults over {contiguous} steps from install ({ended - began:.0f} s): the worst "
            f"{window:.0f} s window spent {worst:.3f} of it on the shadow side, first comparisons included "
            f"(goal <= {goal:.2f}) {'ok' if worst <= goal else 'OVER GOAL'}"
        )

        # 2: after the first comparisons, the defaults (the same monitor), unwrapped and rate 1.0, interleaved
        times: dict[str, list[float]] = {"unwrapped": [], "defaults": [], "rate 1.0": []}
        names = list(times)
        for trial in range(rounds):
            for name in names[trial % 3 :] + names[: trial % 3]:
                if name == "defaults":
                    times[name].append(_steps(job, steps))
                    continue
                defaults.uninstall()
                with every_call(trial) if name == "rate 1.0" else contextlib.nullcontext():
                    times[name].append(_steps(job, steps))
                defaults._patch()
        defaults.uninstall()
        base = sum(times["unwrapped"])
        print(
            f"step time, unwrapped: {base / (rounds * steps) * 1e3:.1f} ms/step ({rounds} rounds of {steps} steps "
            f"per configuration, interleaved)"
        )
        for name, goal, what in (
            ("defaults", 1.05, "launcher defaults (rate 0.01) after its first comparisons"),
            ("rate 1.0", 1.5, "rate 1.0 (every call compared)"),
        ):
            ratio = sum(times[name]) / base
            verdict = "ok" if ratio <= goal else "OVER GOAL"
            print(f"step time, {what} / unwrapped = {ratio:.3f} (goal <= {goal}) {verdict}")
        plain, sampled = peak_rss(job, contextlib.nullcontext), peak_rss(job, lambda: every_call(0))
        if plain is None or sampled is None:
            print("peak RSS: unavailable (cannot reset the high-water mark on this system)")
        else:
            ratio = sampled / plain
            print(
                f"peak RSS of a step, rate 1.0 / unwrapped = {ratio:.3f} (goal <= 1.3) "
                f"{'ok' if ratio <= 1.3 else 'OVER GOAL'}; {sampled / 1024:.0f} vs {plain / 1024:.0f} MiB"
            )
    finally:
        patches.undo()


if __name__ == "__main__":
    sys.exit(main())
