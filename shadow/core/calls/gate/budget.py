"""The overhead budget: the share of wall time the shadow side of a monitor's targets may use, together, over every 10
s window.

A token bucket (Tanenbaum, *Computer Networks*, 5th ed., 5.4.2; the leaky-bucket shaping of traffic): allowance
accrues at ``fraction`` seconds per second, up to ``BURST`` seconds; a sampled call's shadow side may start while
the allowance covers what the target's last sampled call cost (at most ``BURST``) and is charged what it took (the
allowance may go below zero). So over any window of W seconds the shadow side uses at most ``BURST + fraction * W``
plus what the last call started in it overran its expected cost: ``fraction + 0.05`` of a 10 s window. A call may
not start on less allowance than its expected cost (a ResNet comparison that costs 0.3 s would otherwise spend 0.273
of a window at budget 0.2), and idle time accrues no more than the burst (a job idle for an hour would otherwise
spend the hour's share at once). One allowance is shared by every target of a monitor (:class:`Budgets`): with one
each, a job shadowing DataParallel and its casts could spend twice the budget in one window. Shared, it must not be
taken from under a target that waits for it: a call refused for its cost reserves that much (the first refused, or
one that needs more than twice what is reserved; until its target starts a call, or until the allowance is full and
waiting gains it nothing), and while the allowance does not cover that reservation and its own cost too, no other
target's call starts (a cheap target called often would otherwise keep an expensive one from ever starting).

What every call pays outside a comparison (a guided target's signature function) is charged too, so comparisons give
way to it; it also has a bucket of its own, the same size: while classifying alone has used the budget, calls are
not classified (they count as "unclassified", a signature never compared). One comparison that overran never stops
the classifying.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable

from shadow.core.support import forks

#: The window the budget holds over, and the allowance a target may save up (the 0.05 of a window it may exceed).
WINDOW_SECONDS = 10.0
BURST_SECONDS = 0.05 * WINDOW_SECONDS

#: What a call is expected to cost before its target's first sampled call was measured: a quarter of the burst,
#: so that at most four such calls start together.
UNKNOWN_COST = BURST_SECONDS / 4

#: The seconds the shadow side of one sampled call may take by default (``install(deadline=...)``, ``--deadline``).
DEFAULT_DEADLINE = 60.0


#: A clock of seconds: allowance accrues on it and what the shadow side costs is measured on it.
Clock = Callable[[], float]


class Budget:
    """An allowance of shadow-side time (``fraction`` of wall time), drawn on from any thread by any target.

    Args:
        fraction: the share of wall time the shadow side may use.
        clock: where time is read, for accrual (tests inject one that only moves when they say).
    """

    def __init__(self, fraction: float, clock: Clock = time.perf_counter) -> None:
        self.fraction, self.clock = fraction, clock
        self._after_fork_in_child()
        forks.register(self)

    def _after_fork_in_child(self) -> None:  # (the parent's lock may have been held at fork; its spending is its own)
        self._lock = threading.Lock()
        self._allowance = BURST_SECONDS
        self._at = self.clock()
        self._reserved: tuple[object, float] | None = None  # (who waits for the allowance, how much)

    def allows(self, expected: float = 0.0, who: object = None) -> bool:
        """Whether a sampled call of ``who``'s (a target) whose shadow side is ``expected`` to take that many seconds
        may start now."""
        with self._lock:
            return self._allows(min(expected, BURST_SECONDS), who)

    def _allows(self, expected: float, who: object) -> bool:
        """:meth:`allows`, under the lock, for a call expected to take ``expected`` (at most BURST) seconds."""
        now = self.clock()
        allowance = self._allowance = min(BURST_SECONDS, self._allowance + self.fraction * (now - self._at))
        self._at = now
        reserved = self._reserved
        if reserved is not None and (reserved[0] is who or allowance >= BURST_SECONDS):
            reserved = self._reserved = None  # (its holder is here, or it waited for all there is)
        needed = expected if reserved is None else min(expected + reserved[1], BURST_SECONDS)
        allowed = allowance > 0 and allowance >= needed
        if not allowed and (reserved is None or 2 * reserved[1] < expected):
            self._reserved = (who, expected)  # (first come, unless its need is far smaller)
        return allowed

    def take(self, expected: float, who: object = None) -> float | None:
        """Like :meth:`allows`, for a call that starts at once: its expected cost (at most ``BURST``;
        ``UNKNOWN_COST`` while its target has no measured cost yet) is taken from the allowance now, so that calls
        starting together on other threads see it spent (16 threads starting at once no longer all pass). Returns
        what was taken, to give back with :meth:`charge` (``-taken``) once the call's real cost is charged; None
        where the call may not start."""
        held = UNKNOWN_COST if expected <= 0 else min(expected, BURST_SECONDS)
        with self._lock:
            allowed = self._allows(held, who)
            if allowed:
                self._allowance -= held
        return held if allowed else None

    def charge(self, seconds: float) -> None:
        """Seconds the shadow side used."""
        with self._lock:
            self._allowance -= seconds


@dataclasses.dataclass(frozen=True)
class Budgets:
    """A monitor's allowances, shared by its targets: the shadow side's, and classifying's own share of it."""

    shadow: Budget
    classifying: Budget

    @property
    def clock(self) -> Clock:
        """The clock both allowances accrue on, and the shadow side's costs are measured on."""
        return self.shadow.clock

    @classmethod
    def of(cls, fraction: float, clock: Clock = time.perf_counter) -> Budgets:
        """Both allowances at ``fraction`` of wall time, on one ``clock``."""
        return cls(Budget(fraction, clock), Budget(fraction, clock))


class ShadowCost:
    """What one target's shadow side costs: timed on the budget's clock and charged to its allowance; the last
    sampled call's whole cost is what the next one is expected to cost.

    Args:
        budgets: the monitor's allowances (None: no limit; costs are still timed).
    """

    def __init__(self, budgets: Budgets | None) -> None:
        self.budget = budgets.shadow if budgets is not None else None
        self.clock: Clock = budgets.clock if budgets is not None else time.perf_counter
        self.last = 0.0  # (the last sampled call's plan and shadow side, once both were done)
        self.planned = 0.0  # (the sampled call under way: its plan)

    def take(self, who: object) -> float | None:
        """What a sampled call of ``who``'s may take from the allowance now (:meth:`Budget.take`), or None where
        it may not start; 0.0 without a budget."""
        return self.budget.take(self.last, who) if self.budget is not None else 0.0

    def charge(self, seconds: float) -> None:
        """Seconds the shadow side used (negative: given back)."""
        if self.budget is not None:
            self.budget.charge(seconds)
