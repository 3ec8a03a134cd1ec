"""Small SVG charts written directly, so plotting needs no matplotlib: a scatter plot (log x
axis, labelled points, a marked front), a line chart (one polyline per series) and a
horizontal bar chart (groups of bars, each with an optional lighter second bar)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import pairwise
from xml.sax.saxutils import escape, quoteattr

_W, _H = 540, 400  # one panel, in px
_LEFT, _RIGHT, _TOP, _BOTTOM = 72, 24, 44, 56
_FRONT, _OTHER = "#c0392b", "#2c6fbb"
PALETTE = ("#2c6fbb", "#c0392b", "#27ae60", "#8e44ad", "#d35400", "#16a085", "#7f8c8d",
           "#b7950b", "#e84393", "#2d3436")
"""Series colours, in order; :func:`color` cycles through them."""


def color(i: int) -> str:
    """The ``i``-th series colour."""
    return PALETTE[i % len(PALETTE)]


@dataclass
class Point:
    label: str
    x: float
    """> 0 for the log axis; a point at 0 is drawn on the left edge."""
    y: float
    yerr: float = 0.0
    """Half-height of the error bar (e.g. the std over seeds); 0 draws none."""
    front: bool = False
    """On the front: filled, and joined to the other front points by a staircase."""


@dataclass
class Panel:
    title: str
    y_label: str
    points: list[Point]


@dataclass
class Series:
    """One line of :func:`line_svg`: (x, y) points in x order."""
    label: str
    points: list[tuple[float, float]]
    color: str = _OTHER


@dataclass
class Bar:
    """One bar of :func:`bar_svg`, with an optional lighter ``second`` bar right below it
    (e.g. the bytes before compression beside the bytes sent)."""
    label: str
    value: float
    color: str = _OTHER
    text: str = ""
    """Written after the bar's end; empty: the formatted value."""
    second: float | None = None
    second_text: str = ""


@dataclass
class BarGroup:
    name: str
    bars: list[Bar]


@dataclass
class _Frame:
    """A plot area: top-left corner (x0, y0), width pw, height ph."""
    x0: float
    y0: float
    pw: float
    ph: float


def _nice_step(span: float, base: int = 10) -> float:
    """About a fifth of ``span`` rounded to 1, 2 or 5 times a power of ten (times a power
    of ``base`` first when that is not 10: 1024 gives 50 KiB, 2 MiB, ...)."""
    raw = span / 5
    unit = 1.0
    if base != 10 and raw >= base:
        unit = float(base) ** math.floor(math.log(raw) / math.log(base))
        raw /= unit
    mag = 10 ** math.floor(math.log10(raw))
    return unit * mag * next(s for s in (1, 2, 5, 10) if s * mag >= raw * (1 - 1e-9))


def _ticks(lo: float, hi: float, base: int = 10) -> list[float]:
    """Multiples of a nice step from ``lo`` to ``hi``."""
    step = _nice_step(hi - lo, base)
    return [k * step for k in range(math.ceil(lo / step - 1e-9), math.floor(hi / step + 1e-9) + 1)]


def _padded(lo: float, hi: float) -> tuple[float, float, list[float]]:
    """``lo`` and ``hi`` 8 % apart further (or a little around one value), with ticks."""
    pad = 0.08 * (hi - lo) if hi > lo else max(1e-3, 0.01 * abs(lo))
    lo, hi = lo - pad, hi + pad
    return lo, hi, _ticks(lo, hi)


def _y_range(points: list[Point]) -> tuple[float, float, list[float]]:
    return _padded(min(p.y - p.yerr for p in points), max(p.y + p.yerr for p in points))


def _decimals(ticks: list[float]) -> int:
    """Enough decimals to tell the ticks apart."""
    return max(0, -math.floor(math.log10(ticks[1] - ticks[0]))) if len(ticks) > 1 else 4


def _x_range(points: list[Point], base: int) -> tuple[float, float, list[float]]:
    """log10 range and ticks at m * base**k: the coarsest set of m (1; 1, 10, 100; all)
    that gives at least 3 ticks. ``base`` = 1024 puts byte ticks on KiB, MiB, ..."""
    logs = [math.log10(p.x) for p in points if p.x > 0] or [0.0]
    pad = max(0.1 * (max(logs) - min(logs)), 0.15)
    lo, hi = min(logs) - pad, max(logs) + pad
    per = math.log10(base)
    mults = (1, 2, 5) if base == 10 else (1, 2, 5, 10, 20, 50, 100, 200, 500)
    every = sorted(m * float(base) ** k for k in range(math.floor(lo / per) - 1,
                                                       math.ceil(hi / per) + 1)
                   for m in mults if lo <= math.log10(m) + k * per <= hi)
    for keep in ({1}, {1, 10, 100}):
        ticks = [t for t in every if round(t / base ** math.floor(math.log10(t) / per + 1e-9))
                 in keep]
        if len(ticks) >= 3:
            return lo, hi, ticks
    return lo, hi, every


def _border(f: _Frame) -> str:
    return (f'<rect x="{f.x0}" y="{f.y0}" width="{f.pw}" height="{f.ph}" fill="none" '
            'stroke="#444"/>')


def _empty(f: _Frame, message: str) -> str:
    return (f'<text x="{f.x0 + f.pw / 2:.1f}" y="{f.y0 + f.ph / 2:.1f}" text-anchor="middle">'
            f"{escape(message)}</text>")


def _grid(f: _Frame, axis: str, ticks: list[float], at: Callable[[float], float],
          fmt: Callable[[float], str]) -> list[str]:
    """A grid line and a label per tick: across the frame at x = ``at(t)`` with the label
    below (``axis`` "x"), or at y = ``at(t)`` with the label on the left ("y")."""
    out = []
    for t in ticks:
        p = at(t)
        if axis == "x":
            line = (p, f.y0, p, f.y0 + f.ph)
            label = f'x="{p:.1f}" y="{f.y0 + f.ph + 16}" text-anchor="middle"'
        else:
            line = (f.x0, p, f.x0 + f.pw, p)
            label = f'x="{f.x0 - 6}" y="{p + 4:.1f}" text-anchor="end"'
        x1, y1, x2, y2 = (f"{v:.1f}" if isinstance(v, float) else str(v) for v in line)
        out.append(f'<line x1="{x1}" y1="{y1}" x2="{x2}" y2="{y2}" stroke="#ddd"/>'
                   f'<text {label} font-size="11">{escape(fmt(t))}</text>')
    return out


def _axis_labels(f: _Frame, x_label: str, y_label: str, y_label_x: float) -> str:
    out = (f'<text x="{f.x0 + f.pw / 2:.1f}" y="{f.y0 + f.ph + 40}" text-anchor="middle" '
           f'font-size="12">{escape(x_label)}</text>')
    if y_label:
        out += (f'<text transform="translate({y_label_x},{f.y0 + f.ph / 2:.1f}) rotate(-90)" '
                f'text-anchor="middle" font-size="12">{escape(y_label)}</text>')
    return out


def _panel(panel: Panel, ox: float, oy: float, x_label: str,
           x_format: Callable[[float], str], x_base: int) -> list[str]:
    """SVG elements of one panel whose top-left corner is (ox, oy)."""
    f = _Frame(ox + _LEFT, oy + _TOP, _W - _LEFT - _RIGHT, _H - _TOP - _BOTTOM)
    out = [(f'<g class="panel"><text x="{f.x0 + f.pw / 2:.1f}" y="{oy + 26}" '
            f'text-anchor="middle" font-size="14" font-weight="bold">{escape(panel.title)}</text>'),
           _border(f)]
    if not panel.points:
        return [*out, _empty(f, "no finished runs") + "</g>"]
    xlo, xhi, xticks = _x_range(panel.points, x_base)
    ylo, yhi, yticks = _y_range(panel.points)

    def px(x: float) -> float:
        return f.x0 + f.pw * ((math.log10(x) if x > 0 else xlo) - xlo) / (xhi - xlo)

    def py(y: float) -> float:
        return f.y0 + f.ph * (1 - (y - ylo) / (yhi - ylo))

    if all(p.x <= 0 for p in panel.points):  # nothing to place on a log scale
        xticks = []
    if any(p.x <= 0 for p in panel.points):
        out.append(f'<text x="{f.x0}" y="{f.y0 + f.ph + 16}" text-anchor="middle" '
                   f'font-size="11">{escape(x_format(0))}</text>')
    decimals = _decimals(yticks)
    out += _grid(f, "x", xticks, px, x_format)
    out += _grid(f, "y", yticks, py, lambda t: f"{t:.{decimals}f}")
    out.append(_axis_labels(f, x_label, panel.y_label, ox + 18))
    front = sorted((p for p in panel.points if p.front), key=lambda p: p.x)
    if len(front) > 1:  # staircase: each front point holds its y until the next one
        pts = [(px(front[0].x), py(front[0].y))]
        for a, b in pairwise(front):
            pts += [(px(b.x), py(a.y)), (px(b.x), py(b.y))]
        out.append('<polyline class="front" fill="none" stroke="' + _FRONT + '" '
                   'stroke-dasharray="4 3" points="'
                   + " ".join(f"{x:.1f},{y:.1f}" for x, y in pts) + '"/>')
    placed: list[tuple[float, float, float]] = []
    for p in sorted(panel.points, key=lambda p: py(p.y)):
        out += _point(p, px(p.x), py(p.y), py(p.y - p.yerr), py(p.y + p.yerr), placed, f.x0 + f.pw)
    out.append("</g>")
    return out


def _label_y(x: float, y: float, width: float, placed: list[tuple[float, float, float]]) -> float:
    """Moves a label down until it overlaps none placed before (x, y, width each);
    points at the same place get their labels stacked instead of overprinted."""
    while any(abs(y - py) < 11 and x < px + pw and px < x + width for px, py, pw in placed):
        y += 11
    placed.append((x, y, width))
    return y


def _point(p: Point, cx: float, cy: float, lo: float, hi: float,
           placed: list[tuple[float, float, float]], right: float) -> list[str]:
    """A circle with its error bar and its label: right of the point, or left of it where
    the label would cross the panel's ``right`` edge."""
    color = _FRONT if p.front else _OTHER
    out = []
    if p.yerr > 0:
        out.append(f'<line x1="{cx:.1f}" y1="{lo:.1f}" x2="{cx:.1f}" y2="{hi:.1f}" '
                   f'stroke="{color}"/>')
    cls = "point front" if p.front else "point"
    out.append(f'<circle class="{cls}" data-label={quoteattr(p.label)} cx="{cx:.1f}" '
               f'cy="{cy:.1f}" r="4.5" stroke="{color}" stroke-width="1.5" '
               f'fill="{color if p.front else "white"}">'
               f"<title>{escape(p.label)}: x={p.x:g}, y={p.y:g}</title></circle>")
    width = 6 * len(p.label)
    left = cx + 7 + width > right
    lx = cx - 7 - width if left else cx + 7
    ty = _label_y(lx, cy - 7, width, placed)
    anchor = ' text-anchor="end"' if left else ""
    out.append(f'<text x="{cx - 7 if left else cx + 7:.1f}" y="{ty:.1f}" font-size="10"'
               f"{anchor}>{escape(p.label)}</text>")
    return out


def _document(width: float, height: float, title: str, body: list[str], note: str) -> str:
    """The SVG document: a white page, ``title`` on top, ``body``, ``note`` at the bottom
    (20 px more when there is one)."""
    height += 20 if note else 0
    out = ['<?xml version="1.0" encoding="UTF-8"?>',
           (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" font-family="sans-serif">'),
           f'<rect width="{width}" height="{height}" fill="white"/>',
           (f'<text x="{width / 2:.1f}" y="22" text-anchor="middle" font-size="16">'
            f"{escape(title)}</text>"), *body]
    if note:
        out.append(f'<text x="12" y="{height - 8}" font-size="11" fill="#555">'
                   f"{escape(note)}</text>")
    out.append("</svg>")
    return "\n".join(out) + "\n"


def scatter_svg(panels: list[Panel], *, title: str, x_label: str,
                x_format: Callable[[float], str] = "{:g}".format, x_base: int = 10,
                note: str = "") -> str:
    """Panels side by side sharing a log x axis label; returns the SVG document.

    Every point is a ``<circle class="point ...">`` with its label in ``data-label``.
    """
    body = []
    for i, panel in enumerate(panels):
        body += _panel(panel, _W * i, 30, x_label, x_format, x_base)
    return _document(_W * max(1, len(panels)), _H + 36, title, body, note)


def _legend(entries: Sequence[tuple[str, str, bool]], x: float, y: float,
            width: float) -> tuple[list[str], float]:
    """Swatches and labels (label, colour, light) in rows from (x, y) within ``width``;
    returns the elements and the height used. A light swatch is drawn like a second bar."""
    out, cx, cy = [], x, y
    for label, col, light in entries:
        w = 26 + 6.5 * len(label)
        if cx > x and cx + w > x + width:
            cx, cy = x, cy + 16
        fill = f'fill="{col}" fill-opacity="0.3" stroke="{col}"' if light else f'fill="{col}"'
        out.append(f'<rect class="legend" x="{cx:.1f}" y="{cy - 9:.1f}" width="14" height="10" '
                   f'{fill}/><text x="{cx + 18:.1f}" y="{cy:.1f}" font-size="11">'
                   f"{escape(label)}</text>")
        cx += w + 12
    return out, (cy - y + 16 if entries else 0)


def _thin(points: list[tuple[float, float]], most: int) -> list[tuple[float, float]]:
    """At most about ``most`` points in x order: each of ``most / 2`` runs of neighbours
    keeps its lowest and its highest point, so spikes stay visible."""
    if len(points) <= most:
        return points
    size = math.ceil(len(points) / (most // 2))
    out = []
    for i in range(0, len(points), size):
        run = points[i:i + size]
        lo, hi = min(run, key=lambda p: p[1]), max(run, key=lambda p: p[1])
        out += sorted({lo, hi})
    return [points[0], *out[1:-1], points[-1]] if len(out) > 2 else out


def line_svg(series: list[Series], *, title: str, x_label: str, y_label: str,
             y_format: Callable[[float], str] | None = None, note: str = "",
             empty: str = "no data", x_min: float | None = None,
             last_format: Callable[[float], str] | None = None, most_points: int = 1500,
             markers_below: int = 40, width: int = 660, height: int = 300) -> str:
    """One panel with a linear x and y axis (x from ``x_min``, else from the first point)
    and a ``<polyline class="series">`` per series that has points (labelled in
    ``data-label``; over ``most_points`` points are thinned); circles mark the points of a
    series with fewer than ``markers_below``, and ``last_format`` writes each series' last
    y beside its last point. A legend below."""
    f = _Frame(_LEFT, 44, width - _LEFT - _RIGHT, height)
    legend, legend_h = _legend([(s.label, s.color, False) for s in series], _LEFT,
                               f.y0 + f.ph + 62, f.pw)
    body = [_border(f)]
    drawn = [s for s in series if s.points]
    if not drawn:
        body.append(_empty(f, empty))
        return _document(width, f.y0 + f.ph + 62 + legend_h, title, body + legend, note)
    xs = [x for s in drawn for x, _ in s.points]
    ys = [y for s in drawn for _, y in s.points]
    xlo = min(xs) if x_min is None else min(x_min, *xs)
    xhi = max(xs) if max(xs) > xlo else xlo + 1
    xticks = _ticks(xlo, xhi)
    xhi += 0.03 * (xhi - xlo)  # room for the last marker
    ylo, yhi, yticks = _padded(min(ys), max(ys))
    decimals = _decimals(yticks)

    def px(x: float) -> float:
        return f.x0 + f.pw * (x - xlo) / (xhi - xlo)

    def py(y: float) -> float:
        return f.y0 + f.ph * (1 - (y - ylo) / (yhi - ylo))

    body += _grid(f, "x", xticks, px, "{:g}".format)
    body += _grid(f, "y", yticks, py, y_format or (lambda t: f"{t:.{decimals}f}"))
    body.append(_axis_labels(f, x_label, y_label, 18))
    for s in drawn:
        pts = _thin(s.points, most_points)
        body.append(f'<polyline class="series" data-label={quoteattr(s.label)} fill="none" '
                    f'stroke="{s.color}" stroke-width="1.6" stroke-linejoin="round" points="'
                    + " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in pts)
                    + f'"><title>{escape(s.label)}</title></polyline>')
        if len(s.points) < markers_below:
            body += [f'<circle class="marker" cx="{px(x):.1f}" cy="{py(y):.1f}" r="3" '
                     f'fill="{s.color}"><title>{escape(s.label)}: x={x:g}, y={y:g}</title>'
                     "</circle>" for x, y in s.points]
        if last_format is not None:
            x, y = s.points[-1]
            body.append(f'<text class="last" x="{px(x) - 4:.1f}" y="{py(y) - 6:.1f}" '
                        f'text-anchor="end" font-size="10" fill="{s.color}">'
                        f"{escape(last_format(y))}</text>")
    return _document(width, f.y0 + f.ph + 62 + legend_h, title, body + legend, note)


def bar_svg(groups: list[BarGroup], *, title: str, x_label: str,
            x_format: Callable[[float], str] = "{:g}".format, x_base: int = 10,
            legend: Sequence[tuple[str, str, bool]] = (), note: str = "",
            empty: str = "no data", width: int = 760) -> str:
    """Horizontal bars from a common zero, one group per row block (its name on the left),
    each bar a ``<rect class="bar">`` (``data-label``, ``data-group``) with its text after
    its end and, where it has one, a lighter ``<rect class="bar second">`` right below.
    ``legend``: (label, colour, light) entries under the axis."""
    left = max(110, 16 + 6.5 * max((len(g.name) for g in groups), default=0))
    right = 230  # the texts after the bars
    rows = 8 + sum(7 + sum(15 + (9 if b.second is not None else 0) for b in g.bars)
                   for g in groups)  # the heights the loop below steps through
    f = _Frame(left, 30 + 14, width - left - right, max(rows, 60))
    body = [_border(f)]
    if not groups:
        body.append(_empty(f, empty))
        return _document(width, f.y0 + f.ph + 20, title, body, note)
    hi = max([b.value for g in groups for b in g.bars]
             + [b.second for g in groups for b in g.bars if b.second is not None])
    hi = hi if hi > 0 else 1.0
    ticks = _ticks(0, hi, x_base)
    xhi = max(hi, ticks[-1])

    def px(x: float) -> float:
        return f.x0 + f.pw * x / xhi

    body += _grid(f, "x", ticks, px, x_format)
    y = f.y0 + 8
    for g in groups:
        top = y
        for b in g.bars:
            attrs = f"data-label={quoteattr(b.label)} data-group={quoteattr(g.name)}"
            body.append(f'<rect class="bar" {attrs} x="{f.x0}" y="{y:.1f}" '
                        f'width="{max(px(b.value) - f.x0, 0.5):.1f}" height="10" '
                        f'fill="{b.color}"><title>{escape(g.name)}, {escape(b.label)}: '
                        f"{escape(b.text or x_format(b.value))}</title></rect>"
                        f'<text x="{px(b.value) + 4:.1f}" y="{y + 9:.1f}" font-size="10">'
                        f"{escape(b.text or x_format(b.value))}</text>")
            y += 12
            if b.second is not None:
                text = b.second_text or x_format(b.second)
                body.append(f'<rect class="bar second" {attrs} x="{f.x0}" y="{y:.1f}" '
                            f'width="{max(px(b.second) - f.x0, 0.5):.1f}" height="7" '
                            f'fill="{b.color}" fill-opacity="0.3" stroke="{b.color}" '
                            f'stroke-width="0.6"><title>{escape(g.name)}, {escape(b.label)}: '
                            f"{escape(text)}</title></rect>"
                            f'<text x="{px(b.second) + 4:.1f}" y="{y + 7:.1f}" font-size="9" '
                            f'fill="#555">{escape(text)}</text>')
                y += 9
            y += 3
        body.append(f'<text x="{f.x0 - 6}" y="{(top + y - 3) / 2 + 4:.1f}" text-anchor="end" '
                    f'font-size="11">{escape(g.name)}</text>')
        if g is not groups[-1]:
            body.append(f'<line x1="{f.x0}" y1="{y + 2:.1f}" x2="{f.x0 + f.pw}" y2="{y + 2:.1f}" '
                        'stroke="#eee"/>')
        y += 7
    body.append(_axis_labels(f, x_label, "", 0))
    items, legend_h = _legend(legend, f.x0, f.y0 + f.ph + 62, width - f.x0 - 12)
    return _document(width, f.y0 + f.ph + 50 + legend_h + 10, title, body + items, note)
