"""The overhead budget over 10 s windows, and the deadline of one call's shadow side, as fractions of wall time.

1. A signature function of 5 ms on every call of a guided target, unsampled calls for 20 s at budget 0.1: the
   share of the worst 10 s window spent in it (goal <= budget + 0.05; before the windowed budget, every call was
   classified: about 0.96).
2. A job idle for an hour (a simulated clock), then 100 calls with a 20 ms shadow side over 5 s of job time at
   budget 0.1: calls compared (goal <= (0.5 s saved up + 0.1 x 5 s) / 20 ms + 1 = 51; since install, all 100).
3. An upstream that never returns, deadline 0.3 s: how long the caller waited (goal: the deadline, within 0.1 s).

Run: ``python benchmarks/bench_budget.py`` (``--quick``: 3 s instead of 20 in 1).
"""

from __future__ import annotations

import argparse
import bisect
import threading
import time
import types

import torch

import shadow
from shadow import Target
from shadow.core.calls.gate.budget import BURST_SECONDS, WINDOW_SECONDS

BUDGET = 0.1


def _target(upstream, **options) -> tuple[types.SimpleNamespace, Target]:
    ops = types.SimpleNamespace(op=lambda x: x * 2)
    return ops, Target("op", ops, "op", upstream, **options)


def signature_share(seconds: float) -> float:
    """The greatest share of a window (10 s, or the run where shorter) spent in a 5 ms signature function."""
    classified = [0]

    def signature(args, kwargs):
        classified[0] += 1
        time.sleep(0.005)
        return "call"

    ops, target = _target(lambda x: x * 2, signature=signature)
    marks, start, x = [], time.monotonic(), torch.ones(2)
    with shadow.install([target], sample_rate=0.0, budget=BUDGET, first_per_signature=1):
        while time.monotonic() - start < seconds:
            ops.op(x)
            marks.append((time.monotonic() - start, classified[0]))
    window = min(WINDOW_SECONDS, seconds)
    times, worst = [t for t, _ in marks], 0.0
    for t, count in marks:
        end = bisect.bisect_left(times, t + window)
        if end >= len(marks):
            break
        worst = max(worst, (marks[end][1] - count) * 0.005 / window)
    return worst


def compared_after_idle() -> int:
    real, clock = time.monotonic, [time.monotonic()]

    def slow(x):
        time.sleep(0.02)
        return x * 2

    ops, target = _target(slow)
    time.monotonic = lambda: clock[0]
    try:
        with shadow.install([target], sample_rate=1.0, budget=BUDGET) as monitor:
            clock[0] += 3600
            for _ in range(100):
                clock[0] += 0.05
                ops.op(torch.ones(2))
            return monitor.stats()["op"].compared
    finally:
        time.monotonic = real


def waited_for_a_hang(deadline: float = 0.3) -> float:
    release = threading.Event()
    ops, target = _target(lambda x: release.wait() or x)
    try:
        with shadow.install([target], sample_rate=1.0, deadline=deadline):
            start = time.monotonic()
            ops.op(torch.ones(2))
            return time.monotonic() - start
    finally:
        release.set()
        # (the abandoned run ends now: let it, before the interpreter exits under a thread still in torch's C++)
        for thread in threading.enumerate():
            if thread.name == "npu-shadow shadow side":
                thread.join(5.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run")
    seconds = 3.0 if parser.parse_args().quick else 20.0
    share = signature_share(seconds)
    goal = BUDGET + BURST_SECONDS / WINDOW_SECONDS
    window = min(WINDOW_SECONDS, seconds)
    print(f"signature function, worst {window:g} s window: {share:.3f} of it (goal over 10 s windows <= {goal:.2f})")
    print(f"after an hour idle, 100 calls of 20 ms in 5 s: {compared_after_idle()} compared (goal <= 51)")
    print(f"an upstream that never returns, deadline 0.3 s: the caller waited {waited_for_a_hang():.3f} s")


if __name__ == "__main__":
    main()
