"""Which of a target's calls arrive at its experiment, and which of those are sampled: the sampler's gate, and a
guided target's coverage (every signature's first calls compared) with its known signature keys.

The unsampled path of a wrapper is ``next(gate, False)``: the gate is an ``itertools.repeat(True, n)`` holding the n
unsampled calls before the next sampled one. ``next`` on it is a C call that takes no lock, reads no clock, draws no
random number and allocates nothing (it returns the shared ``True``). When the gate is empty, the call "arrives" at
the :class:`Sampler`, which under the engine's lock draws the next gap from a geometric distribution and opens a new
gate.

The number of calls is derived, not counted: calls that passed earlier gates, plus calls that arrived, plus what the
current gate has handed out (``operator.length_hint``).
"""

from __future__ import annotations

import itertools
import math
import operator
import os
import random
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any

from shadow.core.calls.gate.coin import Coin
from shadow.core.calls.gate.coverage import CLASSIFY_ONE_IN, Coverage
from shadow.core.model.targets import Target
from shadow.core.support import forks
from shadow.core.support.rates import check_rate

Gate = itertools.repeat

#: The gate of a wrapper whose every call arrives (a guided target classifying every call).
CLOSED: Gate = itertools.repeat(True, 0)

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


class ShadowSidesUnderWay:
    """The shadow sides under way in this process, and the samplings whose gates they close.

    A call that passes an open gate is counted as the job's without a look at which thread makes it: that is what
    makes the unsampled path one C call. While a shadow side is under way, its runs make calls of wrapped functions
    that are not the job's (upstream's own casts, a backward comparison's on the autograd threads), so every gate is
    closed meanwhile and each call arrives, where a nested one is told apart and not counted; a call of the job's on
    another thread then takes its place in the sampler's gate, as it would have."""

    def __init__(self) -> None:
        self.count = 0
        self._lock = threading.Lock()
        self._samplings: weakref.WeakSet[Sampling] = weakref.WeakSet()
        forks.register(self)

    def add(self, sampling: Sampling) -> None:
        with self._lock:
            self._samplings.add(sampling)

    def discard(self, sampling: Sampling) -> None:
        with self._lock:
            self._samplings.discard(sampling)

    def __contains__(self, sampling: Sampling) -> bool:
        """Whether a shadow side under way closes ``sampling``'s gate."""
        return sampling in self._samplings

    def hold(self) -> None:
        with self._lock:
            self.count += 1
            if self.count == 1:
                for sampling in self._samplings:
                    sampling.refresh_gate()

    def release(self) -> None:
        with self._lock:
            self.count -= 1
            if self.count == 0:
                for sampling in self._samplings:
                    sampling.refresh_gate()

    def _after_fork_in_child(self) -> None:  # (the parent's shadow sides are not under way in the child)
        self._lock = threading.Lock()
        self.count = 0


UNDER_WAY = ShadowSidesUnderWay()


class Sampling:
    """One target's sampling (read and written under its experiment's lock where said).

    Coverage guidance: the first calls of every signature are compared, later ones sampled at the rate
    (:mod:`shadow.core.calls.gate.coverage`: every call classified until each signature seen has had its first calls,
    then one in CLASSIFY_ONE_IN). It needs a signature function. Its sampler's gates end at the calls to classify;
    the sampled calls are drawn among those (a thinning: each call is still sampled at the rate).

    Args:
        target: whose calls (its signature function and key).
        sample_rate: the fraction of calls sampled.
        first_per_signature: each signature's calls compared whatever the rate (0: not guided).
        seed: the monitor's seed.
        lock: the experiment's lock.
    """

    def __init__(
        self, target: Target, sample_rate: float, first_per_signature: int, seed: int | None, lock: threading.Lock
    ) -> None:
        self.sample_rate = sample_rate
        self.first_per_signature = first_per_signature if target.signature is not None else 0
        self.coverage = Coverage(self.first_per_signature) if self.first_per_signature else None
        self._coin = Coin(sample_rate, seed, f"{target.name}/guided")
        #: A guided target's signature key, and the keys whose signature had its first calls (they take the gate).
        self.key = target.signature_key if self.coverage is not None else None
        self.known: set = set()
        rate = max(sample_rate, 1 / CLASSIFY_ONE_IN) if self.coverage is not None else sample_rate
        self._thinning = sample_rate / rate if rate else 0.0
        self._sampler_args = (rate, seed, target.name)
        self._lock = lock
        self._sampler_gate: Gate = CLOSED
        self._set_gate: Callable[[Gate], None] = lambda gate: None

    def attach(self, set_gate: Callable[[Gate], None]) -> None:
        """Start sampling into the wrapper whose gate ``set_gate`` sets."""
        self._set_gate = set_gate
        self.sampler = Sampler(*self._sampler_args, self._gate_opened)
        UNDER_WAY.add(self)

    def detach(self) -> None:
        """Stop closing this sampling's gate for shadow sides (its wrapper was uninstalled): a shadow side under way
        refreshes the gates of installed targets only."""
        UNDER_WAY.discard(self)

    def _gate_opened(self, gate: Gate) -> None:
        """The sampler's new gate: the wrapper's too, unless every call is classified now or a shadow side is under
        way."""
        self._sampler_gate = gate
        self.refresh_gate()

    def classifies_all(self) -> bool:
        return self.coverage is not None and self.coverage.classify_all

    def refresh_gate(self) -> None:
        """The wrapper's gate: closed while every call is classified or a shadow side is under way, else the
        sampler's."""
        self._set_gate(CLOSED if UNDER_WAY.count or self.classifies_all() else self._sampler_gate)

    @property
    def first_comparisons_done(self) -> bool:
        """Whether every signature seen has had its first calls (always so without coverage guidance, and while
        no call was seen)."""
        return self.coverage is None or self.coverage.done or not self.coverage.calls

    def uncount_nested(self, novel: bool) -> None:
        """A nested call that ended the gate: the gate moves on, the call is not the job's."""
        with self._lock:
            if not novel and not self.classifies_all():
                self.sampler.arrive()
                self.sampler.uncount()

    def passes_held_gate(self, novel: bool) -> bool:
        """Whether a call of the job's passes the sampler's gate while it is closed for a shadow side."""
        return not novel and bool(UNDER_WAY.count) and not self.classifies_all() and next(self._sampler_gate, False)

    def arrive(self) -> bool:
        """A call that is not classified: whether it is sampled."""
        with self._lock:
            return self.sampler.arrive()

    def classified(self, signature: str, alone: bool = False) -> tuple[bool, bool, bool]:
        """(among the first of its signature, sampled, its signature's first calls finished) for a classified call,
        counted. While every call is classified, each is sampled at the rate, and so is a call that came ``alone``
        (not through the gate: its key not known); after, a call that ends a gate is sampled with the thinning's
        probability. The wrapper's gate follows the coverage's mode."""
        coverage = self.coverage
        assert coverage is not None
        with self._lock:
            classified_all = coverage.classify_all
            if classified_all or alone:
                sampled = self._coin.random() < self.sample_rate
                first = coverage.count(signature, beside=alone)
            else:
                sampled = self.sampler.arrive() and (self._thinning >= 1.0 or self._coin.random() < self._thinning)
                first = coverage.count(signature, self.sampler.calls())
            if coverage.classify_all != classified_all:  # (a signature's first calls began or ended)
                self.refresh_gate()
            return first, sampled, self.key is not None and coverage.finished(signature)

    def know_key(self, args: tuple, kwargs: dict) -> None:
        """The call's signature key is known from now on (its signature had its first calls)."""
        try:
            key = self.key(args, kwargs)  # type: ignore[misc]
            if key is not None:
                self.known.add(key)
        except Exception:  # (the key function's failure: the calls with that key stay classified)
            pass

    def calls(self) -> int:
        """The target's calls so far (under the lock)."""
        return self.sampler.calls() + (self.coverage.counted_alone if self.coverage is not None else 0)

    def signature_calls(self) -> dict[str, int]:
        """A guided target's calls by signature (under the lock); {} for another."""
        return self.coverage.counts(self.sampler.calls()) if self.coverage is not None else {}

    def counted(self, flush: bool) -> dict[str, Any]:
        """The calls to report (under the lock): by signature for a guided target (the open gate's only when
        ``flush``: until then its last call may count them elsewhere), else under ""."""
        if self.coverage is None:
            return {"": self.sampler.calls()}
        return self.coverage.counts(self.sampler.calls(), flush=True) if flush else self.coverage.calls

    def after_fork(self, lock: threading.Lock) -> None:
        """A forked child's: a guided target's first calls are compared again (the child's own evidence)."""
        self._lock = lock
        if self.coverage is not None:
            self.coverage = Coverage(self.first_per_signature)
            self.known.clear()
            self._set_gate(CLOSED)
