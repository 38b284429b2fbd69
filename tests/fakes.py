"""Fakes the tests share: a clock that moves only when told, targets over a namespace, exporters that keep what
they hear or fail, and a monitor with one."""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import shadow


class Clock:
    """Seconds that pass only when a test says: the budget's clock, injected (``Budgets.of(fraction, clock)``), so
    that what the shadow side costs and the job's time between calls are exact and take no real time."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def costing(self, seconds: float, spent: list[float] | None = None) -> Callable[[Any], Any]:
        """An upstream (``x * 2``) that takes ``seconds`` of this clock, each run's cost appended to ``spent``."""

        def upstream(x):
            self.advance(seconds)
            if spent is not None:
                spent.append(seconds)
            return x * 2

        return upstream


def twice(x: Any) -> Any:
    return x * 2


def op_target(upstream: Callable, name: str = "op", **options: Any) -> tuple[types.SimpleNamespace, shadow.Target]:
    """A namespace whose ``op`` (legacy: :func:`twice`) is shadowed by ``upstream``: (the namespace, its target)."""
    ops = types.SimpleNamespace(op=twice)
    return ops, shadow.Target(name, ops, "op", upstream, **options)


class Recorder:
    """An exporter that keeps every observation, for tests that look at what the monitor saw."""

    def __init__(self) -> None:
        self.observations: list[Any] = []

    def export(self, observation: Any) -> None:
        self.observations.append(observation)

    def of(self, target: str) -> list[Any]:
        return [o for o in self.observations if o.target == target]


class FailingExporter:
    """An exporter whose every export fails (a full disk)."""

    def export(self, observation: Any) -> None:
        raise OSError("disk full")


def shadowed(targets: Any, **options: Any) -> tuple[Any, Recorder]:
    """A monitor of ``targets`` at sample rate 1.0 with seed 0 (not yet entered), and its recorder."""
    recorder = Recorder()
    return shadow.install(targets, sample_rate=1.0, exporters=[recorder], seed=0, **options), recorder


def counts_of(stats):
    """The verdict's counts of a monitor's stats of one target (:func:`shadow.analysis.evidence.from_stats`)."""
    from shadow.analysis import evidence

    return evidence.from_stats(stats)


def each_comparison_its_own_cluster(monkeypatch: Any) -> None:
    """Every comparison its own cluster (a cluster window of 1e-9 s), and the process's time under the monitor
    running a million times as fast, so that the processes' time holds the blocks their clusters need (the verdict
    takes no more clusters than that): a test of rules, alerts or the verdict's arithmetic, not of how correlated
    one process's comparisons are."""
    import time

    from shadow.core.calls import monitor
    from shadow.core.calls.record import clusters

    monkeypatch.setattr(clusters, "WINDOW_SECONDS", 1e-9)
    monkeypatch.setattr(monitor, "time", types.SimpleNamespace(monotonic=lambda: time.monotonic() * 1e6))
