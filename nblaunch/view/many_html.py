"""Drawing many ranks (:mod:`.many`): the overview as HTML, a metric as a
median line in a min..max band. What is drawn is bounded by the screen
(a few stragglers, a few nodes, a chart's points), whatever the world size."""
from __future__ import annotations

import html
import time
from typing import Optional

from .html import MONO as _MONO, PART, STATE_COLOR, bar_row, log_ticks, nice_ticks, tick_label
from .many import Overview, Spread, Straggler

__all__ = ["overview_html", "band_chart", "held_back_text", "many_rows", "stragglers_note"]

# Table cells apart: the tables are monospaced text, read across.
_CELLS = "<style>.nblaunch-overview td,.nblaunch-overview th{padding:0 1.2em 0 0;text-align:left}</style>"

_ORDER = ("running", "starting", "paused", "waiting", "finished", "failed", "stopped", "interrupted", "timed out")
_MAX_CHART_POINTS = 300  # per line: a chart is a few hundred pixels wide


def _rate(v: Optional[float]) -> str:
    return "-" if v is None else (f"{v:.3g}" if v < 100 else f"{v:.0f}")


def _pct(s: Spread) -> str:
    return f"{100 * s.lo:.0f}% / {100 * s.mid:.0f}% / {100 * s.hi:.0f}%"


def spread_bar(label: str, s: Optional[Spread], status: str, text: str) -> str:
    """A bar whose light part spans min..max and whose solid part reaches the median."""
    if s is None:
        return bar_row(label, 0.0, status, text)
    color = STATE_COLOR.get(status, "#1565c0")
    return (f"<div class='nblaunch-spread' data-median='{s.mid:.3f}' style='display:flex;align-items:center;"
            f"gap:8px;margin:2px 0'><span style='{_MONO};flex:0 0 6em'>{html.escape(label)}</span>"
            f"<div style='flex:0 0 35%;height:12px;background:#8882;border-radius:3px;position:relative'>"
            f"<div style='position:absolute;left:{100 * s.lo:.1f}%;width:{100 * (s.hi - s.lo):.1f}%;height:100%;"
            f"background:{color};opacity:0.35;border-radius:3px'></div>"
            f"<div style='width:{100 * s.mid:.1f}%;height:100%;background:{color};border-radius:3px'></div></div>"
            f"<span style='{_MONO};flex:1 1 0;min-width:0'>{html.escape(text)}</span></div>")


def _ago(since: float, now: float) -> str:
    return f"{now - since:.0f} s"


def overview_html(ov: Overview, state_name: str, world: int, now: Optional[float] = None) -> str:
    """The overview: counts, spreads, stragglers, nodes."""
    now = time.monotonic() if now is None else now
    counts = " \u00b7 ".join(f"{ov.counts[k]} {k}" for k in _ORDER if ov.counts.get(k)) or f"{world} starting"
    status = "failed" if ov.counts.get("failed") else state_name
    parts = [f"<div class='nblaunch-overview'>{_CELLS}<div style='{_MONO}'>{html.escape(counts)}</div>"]
    if ov.progress is not None:
        steps = ""
        if ov.steps is not None:
            total = f"/{ov.total:.0f}" if ov.total else ""
            steps = f"steps {ov.steps.lo:.0f} / {ov.steps.mid:.0f} / {ov.steps.hi:.0f}{total}"
        rate = (f" \u00b7 it/s {_rate(ov.rate.lo)} / {_rate(ov.rate.mid)} / {_rate(ov.rate.hi)}"
                if ov.rate is not None else "")
        parts.append(spread_bar("all ranks", ov.progress, status,
                                f"min / median / max: {_pct(ov.progress)} {steps}{rate}"))
    if ov.stragglers:
        rows = "".join(
            f"<tr class='nblaunch-straggler' data-rank='{s.rank}'><td>rank {s.rank}</td>"
            f"<td>{html.escape(s.host or '')}</td><td>{s.behind_steps:.0f} steps ({s.behind_s:.1f} s)</td>"
            f"<td>{'-' if s.rate_ratio is None else f'{s.rate_ratio:.2f}x'}</td><td>{_ago(s.since, now)}</td></tr>"
            for s in ov.stragglers)
        more = (f"<tr><td colspan='5'>and {ov.more_behind} more behind</td></tr>" if ov.more_behind else "")
        parts.append(f"<table class='nblaunch-stragglers' style='{_MONO};border-collapse:collapse;margin:4px 0'>"
                     "<tr style='text-align:left'><th>slowest</th><th>host</th><th>behind the median</th>"
                     f"<th>rate vs median</th><th>for</th></tr>{rows}{more}</table>")
    if ov.nodes:
        rows = "".join(
            f"<tr class='nblaunch-node'><td>{html.escape(n.host)}</td><td>{n.ranks}</td>"
            f"<td>{_pct(n.progress)}</td><td>{n.failed or ''}</td>"
            f"<td>{'' if n.slowest is None else f'rank {n.slowest}'}</td></tr>" for n in ov.nodes)
        more = f"<tr><td colspan='5'>and {ov.more_nodes} more nodes</td></tr>" if ov.more_nodes else ""
        parts.append(f"<table class='nblaunch-nodes' style='{_MONO};border-collapse:collapse;margin:4px 0'>"
                     "<tr style='text-align:left'><th>node</th><th>ranks</th><th>progress min / median / max</th>"
                     f"<th>failed</th><th>slowest</th></tr>{rows}{more}</table>")
    parts.append("</div>")
    return "".join(parts)


def held_back_text(worst: list[Straggler]) -> str:
    """The final view's line on the ranks that held the others back ('' if none)."""
    if not worst:
        return ""
    what = "; ".join(
        f"rank {s.rank}{f' ({s.host})' if s.host else ''} up to {s.behind_s:.1f} s behind"
        + (f" at {s.rate_ratio:.2f}x the median rate" if s.rate_ratio is not None else "") for s in worst)
    return f"slowest ranks: {what}"


def _thin(rows: list, most: int = _MAX_CHART_POINTS) -> list:
    step = max(1, -(-len(rows) // most))
    return rows[::step] if step > 1 else rows


def band_chart(name: str, rows: list[tuple], lines: Optional[dict] = None, width: int = 420,
               height: int = 180) -> str:
    """``rows``: ``(step, lo, median, hi)``; drawn as the median's line in a
    shaded band from the lowest to the highest value at each step, plus
    ``lines`` (rank -> points: a few ranks worth seeing alone, such as the
    slowest). A log y-axis when the values are positive and span more than
    two decades, as ``svg_chart``."""
    import math

    rows = _thin(rows)
    if not rows:
        return ""
    lines = {r: _thin(p) for r, p in (lines or {}).items() if p}
    xs = [r[0] for r in rows] + [p[0] for pts in lines.values() for p in pts]
    ys = [v for r in rows for v in (r[1], r[3])] + [p[1] for pts in lines.values() for p in pts]
    x0, x1, y0, y1 = min(xs), max(xs), min(ys), max(ys)
    log_scale = y0 > 0 and y1 / y0 > 100
    f = math.log10 if log_scale else (lambda v: v)
    ticks = log_ticks(y0, y1) if log_scale else nice_ticks(y0, y1)
    v0, v1 = f(min(y0, ticks[0])), f(max(y1, ticks[-1]))
    left, top, bottom, right = 52, 22, 20, 10
    sx = (width - left - right) / ((x1 - x0) or 1)
    sy = (height - top - bottom) / ((v1 - v0) or 1)

    def at(x, y) -> str:
        return f"{left + (x - x0) * sx:.1f},{height - bottom - (f(y) - v0) * sy:.1f}"

    ok = [r for r in rows if not log_scale or r[1] > 0]
    band = " ".join(at(r[0], r[3]) for r in ok) + " " + " ".join(at(r[0], r[1]) for r in reversed(ok))
    median = " ".join(at(r[0], r[2]) for r in ok)
    grid = "".join(
        f"<line x1='{left}' x2='{width - right}' y1='{height - bottom - (f(t) - v0) * sy:.1f}' "
        f"y2='{height - bottom - (f(t) - v0) * sy:.1f}' stroke='currentColor' stroke-opacity='0.15'/>"
        f"<text x='{left - 4}' y='{height - bottom - (f(t) - v0) * sy + 3:.1f}' font-size='10' text-anchor='end' "
        f"fill='currentColor'>{tick_label(t)}</text>" for t in ticks)
    extra = "".join(
        f"<polyline fill='none' stroke='#c62828' stroke-width='1' stroke-dasharray='3,2' points='"
        + " ".join(at(x, y) for x, y in pts if not log_scale or y > 0) + f"'><title>rank {r}</title></polyline>"
        for r, pts in lines.items())
    named = "".join(f" &#160;<tspan fill='#c62828'>- - rank {r}</tspan>" for r in lines)
    scale = " (log)" if log_scale else ""
    return (f"<svg class='nblaunch-chart nblaunch-band' data-scale='{'log' if log_scale else 'linear'}' "
            f"width='{width}' height='{height}' style='display:inline-block;margin-right:1em;color:inherit'>"
            f"<text x='{left}' y='13' font-size='12' fill='currentColor'>{html.escape(name)}{scale} &#160; "
            f"<tspan fill='#1565c0'>median</tspan>, min..max{named}</text>" + grid
            + f"<polygon points='{band}' fill='#1565c0' fill-opacity='0.2' stroke='none'/>"
            f"<polyline fill='none' stroke='#1565c0' stroke-width='1.5' points='{median}'/>" + extra
            + f"<text x='{left}' y='{height - 4}' font-size='10' fill='currentColor'>step {x0}</text>"
            f"<text x='{width - right}' y='{height - 4}' font-size='10' text-anchor='end' "
            f"fill='currentColor'>{x1}</text></svg>")


SHOW_ROWS = 8  # of the failed ranks and the stragglers, rows in full


def many_rows(st) -> tuple[str, str]:
    """A ``LaunchState`` of many ranks drawn: (the overview and the rows worth
    seeing alone: failed ranks, then the slowest; the charts, as bands with
    the slowest rank's own line)."""
    now = time.monotonic()
    ov = st.overview(now)
    shown = [i for i, r in enumerate(st.ranks) if r.status == "failed"][:SHOW_ROWS]
    shown += [s.local for s in ov.stragglers if s.local not in shown][:SHOW_ROWS - len(shown)]
    rows = "".join(bar_row(f"rank {st.label(i)}", st.ranks[i].fraction, st.ranks[i].status,
                           st.ranks[i].detail(sep=PART)) for i in shown)
    held = held_back_text(st.stragglers.held_back()) if st.state not in ("starting", "running") else ""
    note = f"<div style='{_MONO};color:#ef6c00'>{html.escape(held)}</div>" if held else ""
    body = overview_html(ov, st.state, len(st.ranks), now) + note
    if rows:
        body += f"<div class='nblaunch-ranks'>{rows}</div>"
    if st.state not in ("starting", "running"):  # drawn once, at the end: every rank, on demand
        body += (f"<details class='nblaunch-every-rank'><summary>every rank ({len(st.ranks)})</summary>"
                 f"<pre style='margin:0;font-size:85%'>" + "\n".join(
                     html.escape(r.line(st.row_name(i))) for i, r in enumerate(st.ranks)) + "</pre></details>")
    slowest = [st.label(s.local) for s in ov.stragglers[:1]] or [s.rank for s in st.stragglers.held_back(1)]
    charts = "".join(band_chart(name, band.rows(), {r: st.series.get(name, {}).get(r, []) for r in slowest})
                     for name, band in list(st.bands.items())[:3])
    return body, charts


def stragglers_note(st) -> str:
    """For a few ranks (a row each): one line naming the slowest while it
    runs, or, once over, the ranks that held the others back ('' if none)."""
    if st.state in ("starting", "running"):
        ov = st.overview()
        if not ov.stragglers:
            return ""
        s = ov.stragglers[0]
        rate = f", at {s.rate_ratio:.2f}x the median rate" if s.rate_ratio is not None else ""
        text = (f"slowest: rank {s.rank}{f' ({s.host})' if s.host else ''}, {s.behind_steps:.0f} steps "
                f"({s.behind_s:.1f} s) behind the median{rate}, for {time.monotonic() - s.since:.0f} s")
    else:
        text = held_back_text(st.stragglers.held_back())
    return f"<div class='nblaunch-slowest' style='{_MONO};color:#ef6c00'>{html.escape(text)}</div>" if text else ""
