"""Which calls get shadowed.

The unsampled path of a wrapper is ``next(gate, False)``: the gate is an ``itertools.repeat(True, n)``
holding the n unsampled calls before the next sampled one. ``next`` on it is a C call that takes no
lock, reads no clock, draws no random number and allocates nothing (it returns the shared ``True``).
When the gate is empty, the call "arrives" at the sampler, which under the engine's lock draws the
next gap from a geometric distribution and opens a new gate.

The number of calls is derived, not counted: calls that passed earlier gates, plus calls that
arrived, plus what the current gate has handed out (``operator.length_hint``).
"""

from __future__ import annotations

import itertools
import math
import operator
import os
import random
import sys
from collections.abc import Callable

from shadow.core.support import forks
from shadow.core.support.rates import check_rate

#: Coverage guidance's default: the first calls of every signature that are compared whatever the rate.
DEFAULT_FIRST_PER_SIGNATURE = 30

Gate = itertools.repeat

_NEVER = sys.maxsize


class Sampler:
    """Sampling for one target at ``rate`` (0 never, 1 every call), with its own random stream.

    ``publish`` receives every new gate; the wrapper reads the gate it was last given.
    Not thread-safe by itself: the engine calls :meth:`arrive` and :meth:`calls` under its lock.
    """

    def __init__(self, rate: float, seed: int | None, stream: str, publish: Callable[[Gate], None]):
        self.rate = check_rate(rate, "sample rate")
        self._seed = seed
        self._stream = stream
        self._publish = publish
        self._rng = self._new_rng()
        self._passed = 0
        self._open_gate()
        forks.register(self)

    def _new_rng(self, forked: bool = False) -> random.Random:
        if self._seed is None:
            return random.Random()  # seeded from os.urandom
        key = f"{self._seed}/{self._stream}"
        return random.Random(f"{key}/fork{os.getpid()}" if forked else key)

    def _gap(self) -> int:
        """Calls until (and including) the next sampled one: geometric with success rate ``rate``."""
        if self.rate >= 1.0:
            return 1
        if self.rate <= 0.0:
            return _NEVER
        u = 1.0 - self._rng.random()  # in (0, 1]
        gap = math.log(u) / math.log1p(-self.rate)  # inf for the tiniest rates (1e-310: log1p is subnormal)
        return 1 + int(gap) if gap < _NEVER - 1 else _NEVER

    def _open_gate(self) -> None:
        self._gate_size = self._gap() - 1
        self._gate = itertools.repeat(True, self._gate_size)
        self._publish(self._gate)

    def arrive(self) -> bool:
        """A call found the gate closed. True when it is the sampled one."""
        self._passed += 1
        if operator.length_hint(self._gate):
            return False  # another thread reopened the gate between this call's check and now
        self._passed += self._gate_size
        self._open_gate()
        return True

    def uncount(self) -> None:
        """Take back one counted call (a nested call made by the wrapped function itself)."""
        self._passed -= 1

    def calls(self) -> int:
        """Calls seen so far, sampled or not."""
        return self._passed + self._gate_size - operator.length_hint(self._gate)

    def _after_fork_in_child(self) -> None:
        # A forked child gets its own stream, not a copy of the parent's, and counts from zero.
        self._rng = self._new_rng(forked=True)
        self._passed = 0
        self._open_gate()
