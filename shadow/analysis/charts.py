"""Small inline SVG charts for the report's HTML: no script, no external resource, readable without colour.

Each function returns one ``<svg>`` element (a string) or "" when there is nothing to draw.
"""

from __future__ import annotations

import html
import math
from collections.abc import Mapping, Sequence

WIDTH, HEIGHT = 640, 220
LEFT, RIGHT, TOP, BOTTOM = 70, 20, 28, 42

#: Colours by what they show (the Chromium test looks for them).
RATE = "#e8590c"
COVERED = "#2f9e44"
MISSING = "#f08c00"
ERRORS = "#7048e8"
NOISE = "#1c7ed6"
THRESHOLD = "#c92a2a"
AXIS = "#495057"


def _svg(title: str, body: list[str], height: int = HEIGHT) -> str:
    e = html.escape
    return (
        f'<svg width="{WIDTH}" height="{height}" role="img" '
        f'aria-label="{e(title)}" font-family="system-ui, sans-serif" font-size="11">'
        f'<title>{e(title)}</title><text x="{LEFT}" y="16" font-size="13" font-weight="600">{e(title)}</text>'
        + "".join(body)
        + "</svg>"
    )


def _axes(height: int = HEIGHT) -> list[str]:
    bottom = height - BOTTOM
    return [
        f'<line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{bottom}" stroke="{AXIS}"/>',
        f'<line x1="{LEFT}" y1="{bottom}" x2="{WIDTH - RIGHT}" y2="{bottom}" stroke="{AXIS}"/>',
    ]


def rate_over_time(points: Sequence[tuple[float, float, int]], thresholds: Mapping[str, float], title: str) -> str:
    """Divergence rate per time window (start time, rate, comparisons) as bars, with the alert thresholds as
    dashed lines. The y axis is linear from 0 to the largest of the rates and thresholds."""
    points = [p for p in points if p[2] > 0]
    if not points:
        return ""
    top = max([r for _, r, _ in points] + list(thresholds.values()) + [1e-12])
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    step = plot_w / len(points)
    body = _axes()
    for i, (_, rate, count) in enumerate(points):
        h = plot_h * rate / top
        x = LEFT + i * step
        body.append(
            f'<rect x="{x + 1:.1f}" y="{TOP + plot_h - h:.1f}" width="{max(step - 2, 1):.1f}" height="{max(h, 0):.1f}" '
            f'fill="{RATE}"><title>{rate:.3g} over {count:,} comparisons</title></rect>'
        )
        if rate == 0:  # (a clean window still shows: a thin mark on the axis)
            body.append(
                f'<rect x="{x + 1:.1f}" y="{TOP + plot_h - 2:.1f}" width="{max(step - 2, 1):.1f}" height="2" '
                f'fill="{RATE}"/>'
            )
    for name, value in thresholds.items():
        y = TOP + plot_h - plot_h * value / top
        body.append(
            f'<line x1="{LEFT}" y1="{y:.1f}" x2="{WIDTH - RIGHT}" y2="{y:.1f}" stroke="{THRESHOLD}" '
            f'stroke-dasharray="5 3"/><text x="{WIDTH - RIGHT - 4}" y="{y - 3:.1f}" text-anchor="end" '
            f'fill="{THRESHOLD}">{html.escape(name)} {value:.3g}</text>'
        )
    body.append(f'<text x="{LEFT - 6}" y="{TOP + 4}" text-anchor="end">{top:.3g}</text>')
    body.append(f'<text x="{LEFT - 6}" y="{TOP + plot_h}" text-anchor="end">0</text>')
    body.append(
        f'<text x="{LEFT}" y="{HEIGHT - 12}">{len(points)} windows, oldest left; bar: divergent / compared</text>'
    )
    return _svg(title, body)


def horizontal_bars(
    rows: Sequence[tuple[str, float]], title: str, colour: str, needed: float | None = None, log: bool = False
) -> str:
    """One labelled bar per row; ``needed`` draws the goal as a dashed line and colours the bars short of it;
    ``log``: a log10 axis (for values spanning decades)."""
    if not rows:
        return ""
    height = TOP + BOTTOM + 22 * len(rows)
    values = [v for _, v in rows] + ([needed] if needed else [])
    if log:
        low = math.floor(math.log10(min(v for v in values if v > 0) if any(v > 0 for v in values) else 1e-9))
        high = math.ceil(math.log10(max(values))) if max(values) > 0 else low + 1
        high = max(high, low + 1)

        def scale(v: float) -> float:
            return 0.0 if v <= 0 else (math.log10(v) - low) / (high - low)
    else:
        top = max(values) or 1.0

        def scale(v: float) -> float:
            return v / top

    label_w = 250
    plot_w = WIDTH - label_w - RIGHT - 60
    body = []
    for i, (label, value) in enumerate(rows):
        y = TOP + 8 + 22 * i
        w = max(plot_w * max(scale(value), 0.0), 2.0)
        fill = MISSING if needed is not None and value < needed else colour
        body.append(
            f'<text x="{label_w - 6}" y="{y + 12}" text-anchor="end">{html.escape(label[:44])}</text>'
            f'<rect x="{label_w}" y="{y}" width="{w:.1f}" height="16" fill="{fill}"><title>{value:.3g}</title></rect>'
            f'<text x="{label_w + w + 4:.1f}" y="{y + 12}">{value:,.3g}</text>'
        )
    if needed is not None:
        x = label_w + plot_w * scale(needed)
        body.append(
            f'<line x1="{x:.1f}" y1="{TOP}" x2="{x:.1f}" y2="{height - BOTTOM + 8}" stroke="{THRESHOLD}" '
            f'stroke-dasharray="5 3"/><text x="{x:.1f}" y="{height - BOTTOM + 22}" text-anchor="middle" '
            f'fill="{THRESHOLD}">needed {needed:g}</text>'
        )
    return _svg(title, body, height)


def histogram(buckets: Mapping[int, int], title: str, colour: str) -> str:
    """Counts by decade (``buckets``: exponent -> count, ``None`` exponent: exactly 0) as vertical bars."""
    if not buckets:
        return ""
    keys = sorted(buckets)
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    step = plot_w / len(keys)
    top = max(buckets.values())
    body = _axes()
    for i, key in enumerate(keys):
        h = plot_h * buckets[key] / top
        x = LEFT + i * step
        label = "0" if key == ZERO else f"1e{key}"
        body.append(
            f'<rect x="{x + 2:.1f}" y="{TOP + plot_h - h:.1f}" width="{max(step - 4, 1):.1f}" height="{h:.1f}" '
            f'fill="{colour}"><title>{label}: {buckets[key]:,}</title></rect>'
            f'<text x="{x + step / 2:.1f}" y="{HEIGHT - BOTTOM + 14}" text-anchor="middle">{label}</text>'
        )
    body.append(f'<text x="{LEFT - 6}" y="{TOP + 4}" text-anchor="end">{top:,}</text>')
    return _svg(title, body)


#: The histogram's key for an error of exactly 0 (bitwise equal), drawn first.
ZERO = -99


def decade(value: float) -> int:
    """The histogram key of a non-negative error: ZERO, else floor(log10), clamped to -12..6."""
    if not value > 0 or not math.isfinite(value):
        return ZERO if value == 0 else 6
    return max(-12, min(6, math.floor(math.log10(value))))
