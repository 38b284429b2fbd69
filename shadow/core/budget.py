"""The overhead budget: the share of wall time the shadow side of one target may use, over every 10 s window.

A token bucket (Tanenbaum, *Computer Networks*, 5th ed., 5.4.2; the leaky-bucket shaping of traffic): allowance
accrues at ``fraction`` seconds per second, up to ``BURST`` seconds; a sampled call's shadow side may start while
the allowance covers what the target's last sampled call cost (at most ``BURST``) and is charged what it took (the
allowance may go below zero). So over any window of W seconds the shadow side uses at most ``BURST + fraction * W``
plus what the last call started in it overran its expected cost: ``fraction + 0.05`` of a 10 s window. (Starting
whenever the allowance is above zero, the old rule, let a ResNet comparison that costs 0.3 s start on 1 ms of
allowance: 0.273 of a window at budget 0.2.) Since install alone (the old rule) a job idle for an hour could spend the
hour's share in one burst.

What every call pays outside a comparison (a guided target's signature function) is charged too, so comparisons
give way to it; it also has a bucket of its own, the same size: while classifying alone has used the budget, calls
are not classified (they count as "unclassified", a signature never compared). One comparison that overran never
stops the classifying.
"""

from __future__ import annotations

import time

#: The window the budget holds over, and the allowance a target may save up (the 0.05 of a window it may exceed).
WINDOW_SECONDS = 10.0
BURST_SECONDS = 0.05 * WINDOW_SECONDS

#: The seconds the shadow side of one sampled call may take by default (``install(deadline=...)``, ``--deadline``).
DEFAULT_DEADLINE = 60.0


class Budget:
    """A target's allowance of shadow-side time (``fraction`` of wall time)."""

    def __init__(self, fraction: float) -> None:
        self.fraction = fraction
        self._allowance = BURST_SECONDS
        self._at = time.monotonic()

    def _refill(self) -> float:
        now = time.monotonic()
        self._allowance = min(BURST_SECONDS, self._allowance + self.fraction * (now - self._at))
        self._at = now
        return self._allowance

    def allows(self, expected: float = 0.0) -> bool:
        """Whether a sampled call's shadow side that is ``expected`` to take that many seconds may start now."""
        allowance = self._refill()
        return allowance > 0 and allowance >= min(expected, BURST_SECONDS)

    def charge(self, seconds: float) -> None:
        """Seconds the shadow side used."""
        self._allowance -= seconds
