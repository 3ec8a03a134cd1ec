"""A small SVG scatter plot (log x axis, labelled points, a marked front), written
directly so plotting needs no matplotlib."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from xml.sax.saxutils import escape, quoteattr

_W, _H = 540, 400  # one panel, in px
_LEFT, _RIGHT, _TOP, _BOTTOM = 72, 24, 44, 56
_FRONT, _OTHER = "#c0392b", "#2c6fbb"


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


def _nice_step(span: float) -> float:
    raw = span / 5
    mag = 10 ** math.floor(math.log10(raw))
    return mag * next(s for s in (1, 2, 5, 10) if s * mag >= raw * (1 - 1e-9))


def _y_range(points: list[Point]) -> tuple[float, float, list[float]]:
    lo = min(p.y - p.yerr for p in points)
    hi = max(p.y + p.yerr for p in points)
    pad = 0.08 * (hi - lo) if hi > lo else max(1e-3, 0.01 * abs(lo))
    lo, hi = lo - pad, hi + pad
    step = _nice_step(hi - lo)
    first = math.ceil(lo / step)
    ticks = [k * step for k in range(first, math.floor(hi / step) + 1)]
    return lo, hi, ticks


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


def _panel(panel: Panel, ox: float, oy: float, x_label: str,
           x_format: Callable[[float], str], x_base: int) -> list[str]:
    """SVG elements of one panel whose top-left corner is (ox, oy)."""
    pw, ph = _W - _LEFT - _RIGHT, _H - _TOP - _BOTTOM
    x0, y0 = ox + _LEFT, oy + _TOP
    out = [f'<g class="panel"><text x="{x0 + pw / 2:.1f}" y="{oy + 26}" text-anchor="middle" '
           f'font-size="14" font-weight="bold">{escape(panel.title)}</text>',
           f'<rect x="{x0}" y="{y0}" width="{pw}" height="{ph}" fill="none" stroke="#444"/>']
    if not panel.points:
        out.append(f'<text x="{x0 + pw / 2:.1f}" y="{y0 + ph / 2:.1f}" text-anchor="middle">'
                   "no finished runs</text></g>")
        return out
    xlo, xhi, xticks = _x_range(panel.points, x_base)
    ylo, yhi, yticks = _y_range(panel.points)

    def px(x: float) -> float:
        return x0 + pw * ((math.log10(x) if x > 0 else xlo) - xlo) / (xhi - xlo)

    def py(y: float) -> float:
        return y0 + ph * (1 - (y - ylo) / (yhi - ylo))

    if all(p.x <= 0 for p in panel.points):  # nothing to place on a log scale
        xticks = []
    if any(p.x <= 0 for p in panel.points):
        out.append(f'<text x="{x0}" y="{y0 + ph + 16}" text-anchor="middle" '
                   f'font-size="11">{escape(x_format(0))}</text>')
    decimals = max(0, -math.floor(math.log10(yticks[1] - yticks[0]))) if len(yticks) > 1 else 4
    for t in xticks:
        out.append(f'<line x1="{px(t):.1f}" y1="{y0}" x2="{px(t):.1f}" y2="{y0 + ph}" '
                   'stroke="#ddd"/>'
                   f'<text x="{px(t):.1f}" y="{y0 + ph + 16}" text-anchor="middle" '
                   f'font-size="11">{escape(x_format(t))}</text>')
    for t in yticks:
        out.append(f'<line x1="{x0}" y1="{py(t):.1f}" x2="{x0 + pw}" y2="{py(t):.1f}" '
                   'stroke="#ddd"/>'
                   f'<text x="{x0 - 6}" y="{py(t) + 4:.1f}" text-anchor="end" '
                   f'font-size="11">{t:.{decimals}f}</text>')
    out.append(f'<text x="{x0 + pw / 2:.1f}" y="{y0 + ph + 40}" text-anchor="middle" '
               f'font-size="12">{escape(x_label)}</text>'
               f'<text transform="translate({ox + 18},{y0 + ph / 2:.1f}) rotate(-90)" '
               f'text-anchor="middle" font-size="12">{escape(panel.y_label)}</text>')
    front = sorted((p for p in panel.points if p.front), key=lambda p: p.x)
    if len(front) > 1:  # staircase: each front point holds its y until the next one
        pts = [(px(front[0].x), py(front[0].y))]
        for a, b in zip(front, front[1:]):
            pts += [(px(b.x), py(a.y)), (px(b.x), py(b.y))]
        out.append('<polyline class="front" fill="none" stroke="' + _FRONT + '" '
                   'stroke-dasharray="4 3" points="'
                   + " ".join(f"{x:.1f},{y:.1f}" for x, y in pts) + '"/>')
    placed: list[tuple[float, float, float]] = []
    for p in sorted(panel.points, key=lambda p: py(p.y)):
        out += _point(p, px(p.x), py(p.y), py(p.y - p.yerr), py(p.y + p.yerr), placed, x0 + pw)
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


def scatter_svg(panels: list[Panel], *, title: str, x_label: str,
                x_format: Callable[[float], str] = "{:g}".format, x_base: int = 10,
                note: str = "") -> str:
    """Panels side by side sharing a log x axis label; returns the SVG document.

    Every point is a ``<circle class="point ...">`` with its label in ``data-label``.
    """
    width, height = _W * max(1, len(panels)), _H + 36 + (20 if note else 0)
    out = ['<?xml version="1.0" encoding="UTF-8"?>',
           f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-family="sans-serif">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="{width / 2:.1f}" y="22" text-anchor="middle" font-size="16">'
           f"{escape(title)}</text>"]
    for i, panel in enumerate(panels):
        out += _panel(panel, _W * i, 30, x_label, x_format, x_base)
    if note:
        out.append(f'<text x="12" y="{height - 8}" font-size="11" fill="#555">'
                   f"{escape(note)}</text>")
    out.append("</svg>")
    return "\n".join(out) + "\n"
