"""Drawing: a rank's row as an HTML bar, a metric as an inline SVG chart."""
from __future__ import annotations

import html
import math

from .state import RankState

__all__ = ["PALETTE", "PART", "MONO", "STATE_COLOR", "bar_row", "fraction", "svg_chart",
           "log_ticks", "nice_ticks", "tick_label"]

#: A bar's colour by its status (``RankState.status``, or a run's state for the
#: header); a status not listed (running) is drawn ``#1565c0``.
STATE_COLOR = {"failed": "#c62828", "stopped": "#8a8a8a", "interrupted": "#ef6c00",
               "timed out": "#ef6c00", "finished": "#2e7d32"}


def fraction(r: RankState) -> float:
    """How full a rank's bar is, 0..1: ``n / total`` (clipped at 1); a rank
    with no total is empty until it finishes, then full."""
    return r.fraction


_MONO = "font-family:var(--jp-code-font-family,monospace);font-size:90%"
MONO = _MONO  #: the style of a row's monospaced text


def bar_row(label: str, fraction: float, status: str, text: str, warn: bool = False) -> str:
    """One row as HTML: ``label``, a bar ``fraction`` (0..1) full in
    ``status``'s colour (``STATE_COLOR``), then ``text``, whose parts are
    separated by ``PART``; the text is in the failure colour for a failed
    row, orange where ``warn``."""
    # Spans, not <code>: front ends style a static copy's <code> as inline
    # code (grey boxes). nowrap: a number never breaks across lines.
    color = STATE_COLOR.get(status, "#1565c0")
    return (f"<div class='nblaunch-rank' data-status='{html.escape(status)}' data-fraction='{fraction:.3f}' "
            f"style='display:flex;align-items:center;gap:8px;margin:2px 0'>"
            f"<span class='nblaunch-label' style='{_MONO};flex:0 0 6em'>{html.escape(label)}</span>"
            f"<div style='flex:0 0 35%;height:12px;background:#8882;border-radius:3px'>"
            f"<div style='width:{100 * fraction:.1f}%;height:100%;background:{color};border-radius:3px'></div></div>"
            # The failed rank is the one to find: its line in the failure colour.
            f"<span class='nblaunch-text' style='{_MONO};flex:1 1 0;min-width:0;"
            f"color:{color if status == 'failed' else '#ef6c00' if warn else 'inherit'}'>{_unbroken(text)}</span></div>")


def _unbroken(text: str) -> str:
    """A row's text, free to wrap between its parts (so a narrow cell shows
    all of it) but never inside one: a number and its unit, ``loss=2.162e-05``
    and ``train 16/60`` each stay whole (their spaces are no-break)."""
    return " ".join(html.escape(part).replace(" ", "&#160;") for part in text.split(PART))


#: Separates the parts of a row's text (``RankState.detail(sep=PART)``);
#: ``bar_row`` wraps a row's text only here.
PART = "\x1f"


#: A rank's colour is ``PALETTE[rank % len(PALETTE)]`` (chart lines, legend,
#: log tags). Mid-tone colours: each reads at WCAG contrast >= 3.4 on
#: JupyterLab's light and dark backgrounds alike (tests/test_view.py checks it).
PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#d9660b", "#1a9a9a", "#c2408f", "#8d6e63"]


def _legend(series: dict[int, list], most: int = 8) -> str:
    """``rank 0 1 2 3``, each number in its line's colour (the rest on hover)."""
    ranks = sorted(series)
    shown = "".join(f"<tspan fill='{PALETTE[r % len(PALETTE)]}' font-weight='bold'> {r}</tspan>"
                    for r in ranks[:most])
    return "rank" + shown + (" ..." if len(ranks) > most else "")


MAX_DRAWN_POINTS = 300  # of a line: a redraw costs the points it draws


def svg_chart(name: str, series: dict[int, list], width: int = 420, height: int = 180) -> str:
    """A line per rank, drawn as inline SVG (no plotting library, no custom
    JS), with y-axis values and gridlines; the y-axis is logarithmic when the
    values are positive and span more than two decades (a loss falling from
    5 to 1e-5 would be a flat line on a linear one). Text uses
    ``currentColor``, so it reads on light and dark themes."""
    points = [p for pts in series.values() for p in pts]
    if not points:
        return ""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    x0, x1, y0, y1 = min(xs), max(xs), min(ys), max(ys)
    log_scale = y0 > 0 and y1 / y0 > 100
    f = math.log10 if log_scale else (lambda v: v)
    ticks = log_ticks(y0, y1) if log_scale else nice_ticks(y0, y1)
    v0, v1 = f(min(y0, ticks[0])), f(max(y1, ticks[-1]))  # the axis runs from tick to tick
    left, top, bottom, right = 52, 22, 20, 10  # the title sits above the plot, never on it
    sx = (width - left - right) / ((x1 - x0) or 1)
    sy = (height - top - bottom) / ((v1 - v0) or 1)

    def y_of(v: float) -> float:
        return height - bottom - (f(v) - v0) * sy

    grid = "".join(
        f"<line x1='{left}' x2='{width - right}' y1='{y_of(t):.1f}' y2='{y_of(t):.1f}' stroke='currentColor' "
        f"stroke-opacity='0.15'/><text x='{left - 4}' y='{y_of(t) + 3:.1f}' font-size='10' text-anchor='end' "
        f"fill='currentColor'>{tick_label(t)}</text>" for t in ticks)
    lines = []
    for rank, pts in sorted(series.items()):
        every = -(-len(pts) // MAX_DRAWN_POINTS)  # a chart is a few hundred pixels wide
        if every > 1:
            pts = pts[::every] + ([pts[-1]] if (len(pts) - 1) % every else [])
        path = " ".join(f"{left + (x - x0) * sx:.1f},{y_of(y):.1f}" for x, y in pts if not log_scale or y > 0)
        lines.append(f"<polyline fill='none' stroke='{PALETTE[rank % len(PALETTE)]}' "
                     f"stroke-width='1.5' points='{path}'><title>rank {rank}</title></polyline>")
    scale = " (log)" if log_scale else ""
    return (f"<svg class='nblaunch-chart' data-scale='{'log' if log_scale else 'linear'}' width='{width}' "
            f"height='{height}' style='display:inline-block;margin-right:1em;color:inherit'>"
            f"<text x='{left}' y='13' font-size='12' fill='currentColor'>{html.escape(name)}{scale} &#160; "
            f"{_legend(series)}</text>" + grid
            + f"<text x='{left}' y='{height - 4}' font-size='10' fill='currentColor'>step {x0}</text>"
            f"<text x='{width - right}' y='{height - 4}' font-size='10' text-anchor='end' "
            f"fill='currentColor'>{x1}</text>" + "".join(lines) + "</svg>")


def nice_ticks(lo: float, hi: float, most: int = 5) -> list[float]:
    """Ticks for a linear axis at round values: a step of 1, 2 or 5 x 10^n,
    from the last multiple at or below ``lo`` to the first at or above ``hi``."""
    if hi <= lo:
        return [lo]
    power = 10.0 ** math.floor(math.log10((hi - lo) / most))
    for step in (m * power for m in (1, 2, 5, 10, 20, 50)):
        first, last = math.floor(lo / step + 1e-9), math.ceil(hi / step - 1e-9)
        if last - first + 1 <= most + 1:
            break
    return [_round_to(k * step, step) for k in range(first, last + 1)]


def log_ticks(lo: float, hi: float, most: int = 6) -> list[float]:
    """Ticks for a log axis: whole decades around ``lo``..``hi``, every
    second (or third...) one when there are more than ``most``."""
    first, last = math.floor(math.log10(lo) + 1e-9), math.ceil(math.log10(hi) - 1e-9)
    every = math.ceil((last - first + 1) / most)
    return [10.0 ** e for e in range(first, last + 1, every)]


def tick_label(v: float) -> str:
    """``0.1``, ``2``, ``1e-05``: what a reader expects at a round value."""
    return f"{v:.12g}"  # ticks are already rounded to their step: no float noise to hide


def _round_to(v: float, step: float) -> float:
    """``k * step`` without the float noise (0.30000000000000004)."""
    decimals = max(0, -math.floor(math.log10(step)) + 1)
    return round(v, decimals) + 0.0  # + 0.0: no "-0"
