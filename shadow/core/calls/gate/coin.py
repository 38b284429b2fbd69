"""The random draws of an experiment: one biased coin per rate, each from a stream of its own."""

from __future__ import annotations

import random


class Coin:
    """True with probability ``rate`` at each :meth:`flip`, from a stream named ``stream``: with a ``seed`` the
    same flips in every run, and one coin's flips never move another's.

    Args:
        rate: the probability of True, in [0, 1] (checked by the settings that give it).
        seed: the monitor's seed; None draws from the operating system's randomness.
        stream: the coin's name within the seed (``"<target>/<what it decides>"``).
    """

    def __init__(self, rate: float, seed: int | None, stream: str) -> None:
        self.rate = rate
        self._random = random.Random(f"{seed}/{stream}" if seed is not None else None)
        #: A uniform draw in [0, 1) from the stream (at another probability than the rate: ``coin.random() < p``).
        self.random = self._random.random

    def flip(self) -> bool:
        """Whether this one is drawn (no draw at all while the rate is 0)."""
        return self.rate > 0 and self._random.random() < self.rate

    def bits(self, count: int) -> int:
        """``count`` random bits from the stream (seeds of what the draw decided)."""
        return self._random.getrandbits(count)
