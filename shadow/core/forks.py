"""One at-fork hook for every object that must not carry parent state into a forked child."""

from __future__ import annotations

import os
import weakref
from typing import Protocol


class ForkAware(Protocol):
    def _after_fork_in_child(self) -> None: ...


_objects: weakref.WeakSet[ForkAware] = weakref.WeakSet()


def register(obj: ForkAware) -> None:
    """Call ``obj._after_fork_in_child()`` in every forked child while ``obj`` is alive."""
    _objects.add(obj)


def _run_hooks() -> None:
    for obj in list(_objects):
        obj._after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_run_hooks)
