"""The one rule for a rate (sample rate, drill rate, oracle rate, budget, tolerated divergence rate)."""

from __future__ import annotations

import math
import numbers


def check_rate(value: object, setting: str, *, low: str = "[0", high: str = "1]") -> float:
    """``value`` as a float within the interval written by ``low`` and ``high`` (``"[0"``/``"(0"`` and
    ``"1]"``/``"1)"``; [0, 1] unless said otherwise). Raises ValueError naming ``setting`` and the interval.
    Text is not a number here: settings read from text go through :func:`parse_rate`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise _error(setting, low, high, value)
    try:
        number = float(value)
    except OverflowError:  # an int beyond any float (10**400)
        raise _error(setting, low, high, value) from None
    if not _within(number, low, high):
        raise _error(setting, low, high, value)
    return number


def parse_rate(text: str, setting: str, *, low: str = "[0", high: str = "1]") -> float:
    """A rate written as text (a variable, an option), checked by :func:`check_rate`."""
    try:
        number = float(text)
    except ValueError:
        number = math.nan
    if not _within(number, low, high):
        raise _error(setting, low, high, text)
    return number


def _error(setting: str, low: str, high: str, value: object) -> ValueError:
    given = repr(value)
    given = given if len(given) <= 40 else given[:37] + "..."
    return ValueError(f"{setting}: expected a number in {low}, {high}, got {given}")


def _within(number: float, low: str, high: str) -> bool:
    if not math.isfinite(number):
        return False
    above = number > 0.0 if low == "(0" else number >= 0.0
    below = number < 1.0 if high == "1)" else number <= 1.0
    return above and below
