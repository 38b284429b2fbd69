"""One at-fork hook for every object that must not carry parent state into a forked child."""

from __future__ import annotations

import os
import weakref
from typing import Protocol


class ForkAware(Protocol):
    def _after_fork_in_child(self) -> None: ...


class ForkHooks:
    """Objects to reset in a forked child, held weakly (an object that is gone needs no reset)."""

    def __init__(self) -> None:
        self._objects: weakref.WeakSet[ForkAware] = weakref.WeakSet()

    def register(self, obj: ForkAware) -> None:
        """Call ``obj._after_fork_in_child()`` in every forked child while ``obj`` is alive."""
        self._objects.add(obj)

    def run(self) -> None:
        for obj in list(self._objects):
            obj._after_fork_in_child()


#: The process's hooks, run by os.register_at_fork (one registration per process, so one instance).
FORK_HOOKS = ForkHooks()


def register(obj: ForkAware) -> None:
    """Call ``obj._after_fork_in_child()`` in every forked child while ``obj`` is alive."""
    FORK_HOOKS.register(obj)


class _Forked:
    """How many children this process has forked (a DataLoader's workers, say): their calls are counted in
    their own monitors, which this process's summary cannot see."""

    count = 0

    @classmethod
    def one_more(cls) -> None:
        cls.count += 1

    @classmethod
    def reset(cls) -> None:
        cls.count = 0


def forked_children() -> int:
    """How many children this process has forked since it started (a child starts again from 0)."""
    return _Forked.count


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=FORK_HOOKS.run)
    os.register_at_fork(after_in_parent=_Forked.one_more, after_in_child=_Forked.reset)
