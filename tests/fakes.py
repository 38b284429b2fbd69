"""Fakes the tests share: a clock that moves only when told, targets over a namespace, an exporter that keeps
what it hears."""

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


def op_target(upstream: Callable, name: str = "op", **options: Any) -> tuple[types.SimpleNamespace, shadow.Target]:
    """A namespace whose ``op`` (legacy: ``x * 2``) is shadowed by ``upstream``: (the namespace, its target)."""
    ops = types.SimpleNamespace(op=lambda x: x * 2)
    return ops, shadow.Target(name, ops, "op", upstream, **options)
