"""PromQL over counters whose series appear at their first event.

A job exports a series only once it has something to count (docs/fleet.md: the series budget), so a series' first
sample is already past zero. ``increase()`` and ``rate()`` see only what changed between samples inside the
window: a series that appeared with a hard mismatch at 1 and stayed there increases by 0, and an alert on it never
fires. The forms here count a series that is new in the window (present now, absent at the window's start) from
zero, its whole value, and every other series as ``increase()`` does. The rules, the dashboard and the verdict's
``--window`` read counters through them.

A Prometheus that was down for longer than the window reads the series it scrapes again as new, and counts their
whole values once (docs/fleet.md says so where it matters: a hard mismatch pages again).
"""

from __future__ import annotations

import re

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def window_seconds(window: str) -> float:
    """The seconds of a PromQL duration such as ``15m`` or ``1h30m``."""
    parts = re.findall(r"(\d+(?:\.\d+)?)([smhdw])", window)
    if not parts or "".join(n + u for n, u in parts) != window:
        raise ValueError(f"not a PromQL duration: {window!r}")
    return sum(float(number) * _UNITS[unit] for number, unit in parts)


def increase(selector: str, window: str) -> str:
    """PromQL: each series' increase over ``window``, a series new in the window counted from zero."""
    return f"(({selector} unless {selector} offset {window}) or increase({selector}[{window}]))"


def rate(selector: str, window: str) -> str:
    """PromQL: :func:`increase` per second of ``window``."""
    return f"({increase(selector, window)} / {window_seconds(window):g})"
