"""Small inline SVG charts for the report's HTML: no script, no external resource, readable without colour.

Each function returns one ``<svg>`` element (a string) or "" when there is nothing to draw. Every chart has a
title and a subtitle saying where its numbers come from, titled axes, and text laid out so that no two pieces
overlap and none leaves the picture (the report's Chromium test measures it): long labels are cut at a word
boundary (the whole label is the tooltip), threshold labels are pushed apart, tick labels thinned.
"""

from __future__ import annotations

import html
import math
import time
from collections.abc import Mapping, Sequence

WIDTH, HEIGHT = 640, 240
LEFT, RIGHT, TOP, BOTTOM = 70, 20, 44, 48

#: The width of an average character at the charts' 11 px font (system-ui), with a margin: what labels are cut to.
CHAR_WIDTH = 6.6
LINE = 13  # the least vertical distance between two labels

#: Colours by what they show (the Chromium test looks for them).
RATE = "#e8590c"
COVERED = "#2f9e44"
MISSING = "#f08c00"
ERRORS = "#7048e8"
NOISE = "#1c7ed6"
THRESHOLD = "#c92a2a"
AXIS = "#495057"

e = html.escape


def fit(text: str, width: float) -> str:
    """``text`` cut to what ``width`` pixels hold, at a word boundary where there is one, marked with "…"."""
    worker = max(int(width / CHAR_WIDTH), 4)
    if len(text) <= worker:
        return text
    cut = text[: worker - 1]
    boundary = max(cut.rfind(c) for c in " /_-(")
    return (cut[:boundary] if boundary > worker // 2 else cut).rstrip(" /_-(") + "…"


def _svg(title: str, subtitle: str, body: list[str], height: int = HEIGHT) -> str:
    return (
        f'<svg width="{WIDTH}" height="{height}" role="img" aria-label="{e(title)}" '
        f'font-family="system-ui, sans-serif" font-size="11"><title>{e(title)}. {e(subtitle)}</title>'
        f'<text x="8" y="16" font-size="13" font-weight="600">{e(fit(title, (WIDTH - 16) * 11 / 13))}</text>'
        f'<text x="8" y="31" fill="{AXIS}">{e(fit(subtitle, WIDTH - 16))}</text>' + "".join(body) + "</svg>"
    )


def _axes(height: int, x_title: str, y_title: str) -> list[str]:
    bottom = height - BOTTOM
    middle = (TOP + bottom) / 2
    return [
        f'<line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{bottom}" stroke="{AXIS}"/>',
        f'<line x1="{LEFT}" y1="{bottom}" x2="{WIDTH - RIGHT}" y2="{bottom}" stroke="{AXIS}"/>',
        f'<text x="{(LEFT + WIDTH - RIGHT) / 2:.0f}" y="{height - 8}" text-anchor="middle">'
        f"{e(fit(x_title, WIDTH - LEFT - RIGHT))}</text>",
        f'<text x="14" y="{middle:.0f}" text-anchor="middle" transform="rotate(-90 14 {middle:.0f})">'
        f"{e(fit(y_title, bottom - TOP))}</text>",
    ]


def _apart(wanted: Sequence[float], low: float, high: float) -> list[float]:
    """Label baselines as near ``wanted`` as they can be while ``LINE`` apart and within [low, high]: pushed up
    from the bottom, then down from the top where the pile reached past it."""
    order = sorted(range(len(wanted)), key=lambda i: -wanted[i])
    placed: dict[int, float] = {}
    previous = high + LINE
    for i in order:
        previous = placed[i] = min(wanted[i], high, previous - LINE)
    floor = low - LINE
    for i in reversed(order):
        floor = placed[i] = max(placed[i], floor + LINE)
    return [placed[i] for i in range(len(wanted))]


def _clock(seconds: float, with_date: bool) -> str:
    return time.strftime("%m-%d %H:%M" if with_date else "%H:%M", time.gmtime(seconds))


def rate_over_time(
    points: Sequence[tuple[float, float, int]],
    thresholds: Mapping[str, float],
    title: str,
    subtitle: str = "",
    window_seconds: float = 60.0,
) -> str:
    """Divergence rate per time window (start time, rate, comparisons) as bars, with the alert thresholds as
    dashed lines. The y axis is linear from 0 to the largest of the rates and thresholds; the x axis is UTC time,
    its first and last window labelled."""
    points = [p for p in points if p[2] > 0]
    if not points:
        return ""
    top = max([r for _, r, _ in points] + list(thresholds.values()) + [1e-12])
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    step = plot_w / len(points)
    body = _axes(HEIGHT, "time (UTC); a bar per window: divergent / compared", "divergence rate")
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
    names = list(thresholds)
    lines = [TOP + plot_h - plot_h * thresholds[n] / top for n in names]
    labels = _apart([y - 3 for y in lines], TOP + 10, TOP + plot_h - 4)
    for name, y, label_y in zip(names, lines, labels, strict=True):
        body.append(
            f'<line x1="{LEFT}" y1="{y:.1f}" x2="{WIDTH - RIGHT}" y2="{y:.1f}" stroke="{THRESHOLD}" '
            f'stroke-dasharray="5 3"/><text x="{WIDTH - RIGHT - 4}" y="{label_y:.1f}" text-anchor="end" '
            f'fill="{THRESHOLD}" paint-order="stroke" stroke="#fff" stroke-width="3">'
            f"{e(name)} {thresholds[name]:.3g}</text>"
        )
    body.append(f'<text x="{LEFT - 6}" y="{TOP + 4}" text-anchor="end">{top:.3g}</text>')
    body.append(f'<text x="{LEFT - 6}" y="{TOP + plot_h}" text-anchor="end">0</text>')
    first, last = points[0][0], points[-1][0] + window_seconds
    with_date = time.gmtime(first)[:3] != time.gmtime(last)[:3]
    tick_y = HEIGHT - BOTTOM + 15
    body.append(f'<text x="{LEFT}" y="{tick_y}">{_clock(first, with_date)}</text>')
    body.append(f'<text x="{WIDTH - RIGHT}" y="{tick_y}" text-anchor="end">{_clock(last, with_date)}</text>')
    return _svg(title, subtitle, body)


def horizontal_bars(
    rows: Sequence[tuple[str, float]],
    title: str,
    colour: str,
    needed: float | None = None,
    log: bool = False,
    subtitle: str = "",
    x_title: str = "",
) -> str:
    """One labelled bar per row; ``needed`` draws the goal as a dashed line and colours the bars short of it;
    ``log``: a log10 axis (for values spanning decades)."""
    if not rows:
        return ""
    height = TOP + BOTTOM + 22 * len(rows) + (14 if needed is not None else 0)
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
    body = [f'<text x="{label_w + plot_w / 2:.0f}" y="{height - 8}" text-anchor="middle">{e(x_title)}</text>']
    for i, (label, value) in enumerate(rows):
        y = TOP + 4 + 22 * i
        w = max(plot_w * max(scale(value), 0.0), 2.0)
        fill = MISSING if needed is not None and value < needed else colour
        body.append(
            f'<text x="{label_w - 6}" y="{y + 12}" text-anchor="end"><title>{e(label)}</title>'
            f"{e(fit(label, label_w - 14))}</text>"
            f'<rect x="{label_w}" y="{y}" width="{w:.1f}" height="16" fill="{fill}"><title>{value:.3g}</title></rect>'
            f'<text x="{label_w + w + 4:.1f}" y="{y + 12}">{value:,.3g}</text>'
        )
    if needed is not None:
        x = label_w + plot_w * scale(needed)
        bottom = TOP + 4 + 22 * len(rows)
        body.append(
            f'<line x1="{x:.1f}" y1="{TOP}" x2="{x:.1f}" y2="{bottom:.0f}" stroke="{THRESHOLD}" '
            f'stroke-dasharray="5 3"/><text x="{x:.1f}" y="{bottom + 12:.0f}" text-anchor="middle" '
            f'fill="{THRESHOLD}">needed {needed:g}</text>'
        )
    return _svg(title, subtitle, body, height)


def histogram(buckets: Mapping[int, int], title: str, colour: str, subtitle: str = "") -> str:
    """Counts by decade (``buckets``: exponent -> count, ``ZERO``: exactly 0) as vertical bars, a tick label
    under every bar there is worker for."""
    if not buckets:
        return ""
    keys = sorted(buckets)
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    step = plot_w / len(keys)
    every = math.ceil(5.5 * CHAR_WIDTH / step)  # ("1e-12" is the widest label)
    top = max(buckets.values())
    body = _axes(HEIGHT, "greatest absolute error of the comparison (decade; 0: bitwise equal)", "comparisons")
    for i, key in enumerate(keys):
        h = plot_h * buckets[key] / top
        x = LEFT + i * step
        label = "0" if key == ZERO else f"1e{key}"
        body.append(
            f'<rect x="{x + 2:.1f}" y="{TOP + plot_h - h:.1f}" width="{max(step - 4, 1):.1f}" height="{h:.1f}" '
            f'fill="{colour}"><title>{label}: {buckets[key]:,}</title></rect>'
        )
        if i % every == 0:
            body.append(f'<text x="{x + step / 2:.1f}" y="{HEIGHT - BOTTOM + 15}" text-anchor="middle">{label}</text>')
    body.append(f'<text x="{LEFT - 6}" y="{TOP + 4}" text-anchor="end">{top:,}</text>')
    return _svg(title, subtitle, body)


#: The histogram's key for an error of exactly 0 (bitwise equal), drawn first.
ZERO = -99


def decade(value: float) -> int:
    """The histogram key of a non-negative error: ZERO, else floor(log10), clamped to -12..6."""
    if not value > 0 or not math.isfinite(value):
        return ZERO if value == 0 else 6
    return max(-12, min(6, math.floor(math.log10(value))))
