"""Rendering a launch for the person watching it.

The supervisor calls a display from the cell's own thread (the one running
``notebook_launcher``), so ipykernel routes everything to that cell on every
ipykernel version, with no parent-header juggling in other threads.

Both renderers read the same :class:`LaunchState`: ``TextDisplay`` prints
tagged whole lines plus a periodic status line; ``WidgetDisplay`` draws an
ipywidgets view (header, one row per rank, a loss chart, a log tail). Each
redraws at most ``MAX_RATE`` times a second however much arrives, and the
text path shows at most ``MAX_LINES_PER_S`` lines a second (the rest are in
the rank's log file), so a flooding rank cannot trip Jupyter's IOPub limit.
"""
from __future__ import annotations

import collections
import html
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Optional, TextIO

from . import ansi

__all__ = ["LaunchState", "TextDisplay", "WidgetDisplay", "make_display"]

MAX_RATE = 10.0
MAX_LINES_PER_S = 1000  # sustained, over all ranks; bursts up to a screenful more (below)
MAX_BYTES_PER_S = 256 << 10  # well under Jupyter's IOPub limit (1 MB/s averaged over 3 s)
STATUS_EVERY_S = 10.0
MAX_POINTS = 2000
LOG_TAIL = 40  # lines kept for the text summary and failure reports
PAGE_LINES = 100  # the widget's log pane: lines per page (only the newest page is re-sent)
MAX_PAGES = 50  # ... and pages kept (5,000 lines; the log files keep everything)
MAX_LINE_CHARS = 2000  # longer lines are shortened in the view, never in the log file
AGGREGATE_ABOVE = 16


@dataclass
class BarState:
    """One progress bar of a rank (a ``progress`` or a tqdm bar)."""

    desc: str = ""
    n: float = 0
    total: Optional[float] = None
    postfix: str = ""
    closed: bool = False
    first_seen: Optional[tuple[float, float]] = None  # (rank's time, n) the rate is measured from
    moved_at: float = 0.0  # the rank's time of the latest change
    last_change: float = 0.0  # the kernel's monotonic time of the latest change (stall warnings)
    reported_at: float = 0.0  # the rank's time of its latest report (closing included)

    def rate(self) -> Optional[float]:
        """Items per second from the first report to the latest change, on
        the rank's clock (the kernel receives reports in batches)."""
        if self.first_seen is None or self.moved_at <= self.first_seen[0]:
            return None
        return (self.n - self.first_seen[1]) / (self.moved_at - self.first_seen[0])

    def text(self) -> str:
        label = f"{self.desc} " if self.desc else ""
        return f"{label}{_count(self.n)}/{_count(self.total)}" if self.total else f"{label}{_count(self.n)}"


def _count(n: float) -> str:
    return str(int(n)) if float(n).is_integer() else f"{n:.4g}"


@dataclass
class RankState:
    status: str = "starting"
    bars: dict = field(default_factory=dict)  # key -> BarState, in the order the rank opened them
    metrics: dict = field(default_factory=dict)
    usage: Optional[object] = None  # resources.Usage, sampled about once a second while it runs

    @property
    def current(self) -> Optional[BarState]:
        """The bar the row shows: the newest open one (the inner loop of
        epoch + batch bars), else the one that closed last (the outer loop,
        which closes after its inner one)."""
        open_bars = [b for b in self.bars.values() if not b.closed]
        if open_bars:
            return open_bars[-1]
        return max(self.bars.values(), key=lambda b: b.reported_at, default=None)

    @property
    def last_change(self) -> float:
        return max((b.last_change for b in self.bars.values()), default=0.0)

    @property
    def n(self) -> float:
        return self.current.n if self.current else 0

    @property
    def total(self) -> Optional[float]:
        return self.current.total if self.current else None

    @property
    def desc(self) -> str:
        return self.current.desc if self.current else ""

    def detail(self, sep: str = " ") -> str:
        """Status, bars, rate, ETA (running rows only) and metrics: a row's
        text, its parts joined by ``sep``."""
        parts = [self.status]
        bar = self.current
        if bar is not None and (bar.total or bar.n):
            outer = [b.text() for b in self.bars.values() if not b.closed and b is not bar]
            parts.append(" \u00b7 ".join(outer + [bar.text()]))
            rate = bar.rate()
            if rate:
                parts.append(f"{rate:.3g} it/s" if rate < 100 else f"{rate:.0f} it/s")
                if self.status == "running" and bar.total and bar.n < bar.total and not bar.closed:
                    parts.append(f"ETA {(bar.total - bar.n) / rate:.0f} s")
            if bar.postfix:
                parts.append(bar.postfix)
        parts += [f"{k}={v:.4g}" for k, v in self.metrics.items()]
        if self.usage is not None and self.status == "running":
            parts.append(f"\u00b7 {self.usage.text()}")  # a middle dot: no line break after it, unlike "|"
        return sep.join(parts)

    def line(self, rank: int, now: float = 0.0) -> str:
        return f"rank {rank} {self.detail()}"


class LaunchState:
    """Everything the view shows, fed by the supervisor's events."""

    def __init__(self):
        self.state = "starting"
        self.world_size = 0
        self.call = 0  # a live session's call number (0: a launch)
        self.method = self.backend = ""
        self.log_dir = ""
        self.first_rank = 0  # global rank of this node's local rank 0
        self.node: Optional[int] = None  # this node, in a multi-node launch
        self.num_nodes = 1
        self.t0 = time.monotonic()
        self.ranks: list[RankState] = []
        self.series: dict[str, dict[int, list]] = collections.defaultdict(dict)
        self.tail: collections.deque = collections.deque(maxlen=LOG_TAIL)
        self.notices: list[str] = []
        self.changed = True

    def begin(self, world_size: int, method: str, backend: str, log_dir: str, call: int = 0) -> None:
        self.world_size, self.method, self.backend, self.log_dir = world_size, method, backend, log_dir
        self.call = call
        self.ranks = [RankState() for _ in range(world_size)]

    def place(self, first_rank: int, world_size: int, node: Optional[int], num_nodes: int) -> None:
        """Once the nodes have met: this node's ranks are ``first_rank`` on."""
        self.first_rank, self.world_size, self.node, self.num_nodes = first_rank, world_size, node, num_nodes
        self.changed = True

    @property
    def title(self) -> str:
        """``nblaunch``, or ``nblaunch call 3`` on live ranks."""
        return f"nblaunch call {self.call}" if self.call else "nblaunch"

    def label(self, local: int) -> int:
        return self.first_rank + local

    @property
    def where(self) -> str:
        """``4 ranks`` or ``4 ranks, node 1 of 2``."""
        return f"{self.world_size} ranks" + (f", node {self.node} of {self.num_nodes}" if self.node is not None else "")

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def end(self, state: str) -> None:
        """The launch is over: ``state`` is its outcome, and a row still
        running says how it ended (no row is left "running")."""
        self.state = state
        ended = {"timed out": "timed out", "interrupted": "interrupted"}.get(state, "stopped")
        for r in self.ranks:
            if r.status in ("starting", "running"):
                r.status = ended
        self.changed = True

    def resources(self, usage: dict) -> None:
        """``local rank -> resources.Usage``, from the supervisor's sampler."""
        for rank, u in usage.items():
            self.ranks[rank].usage = u
        self.changed = True

    def set_rank(self, rank: int, status: str) -> None:
        self.ranks[rank].status = status
        if status == "running" and self.state == "starting":
            self.state = "running"
        self.changed = True

    def progress(self, event) -> None:
        bar = self.ranks[event.rank].bars.setdefault(event.key, BarState())
        now = time.monotonic()
        if bar.first_seen is None or event.desc != bar.desc or event.n < bar.n:
            bar.first_seen = (event.time, event.n)  # a new bar, or one reset for the next epoch
        if event.n != bar.n or event.total != bar.total:
            bar.last_change, bar.moved_at = now, event.time
        bar.desc, bar.n, bar.total, bar.closed = event.desc, event.n, event.total, event.closed
        bar.reported_at = event.time
        bar.postfix = getattr(event, "postfix", "")
        self.changed = True

    def metrics(self, event) -> None:
        r = self.ranks[event.rank]
        for step, _, values in event.points:
            r.metrics.update(values)
            for name, value in values.items():
                points = self.series[name].setdefault(self.label(event.rank), [])
                points.append((step, value))
                if len(points) > MAX_POINTS:  # keep the curve, halve its resolution
                    del points[::2]
        self.changed = True

    def summary(self) -> str:
        now = time.monotonic()
        return " | ".join(r.line(self.label(i), now) for i, r in enumerate(self.ranks))

    @property
    def has_progress(self) -> bool:
        return any(r.total or r.n or r.metrics for r in self.ranks)


class _Budget:
    """A token bucket: ``rate`` a second, at most ``burst`` saved up."""

    def __init__(self, rate: float, burst: float):
        self.rate, self.burst, self.tokens = rate, burst, burst
        self._t = time.monotonic()

    def refill(self) -> None:
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self._t) * self.rate)
        self._t = now


class TextDisplay:
    """Plain text: ``[rank N] line`` per line, a status line now and then,
    and a final summary. ``show_status=False`` prints rank output only."""

    BURST_LINES = MAX_LINES_PER_S

    def __init__(self, stream: Optional[TextIO] = None, show_status: bool = True):
        self.state = LaunchState()
        self._stream = stream
        self._show_status = show_status
        self._pending: list[str] = []
        self._hidden: collections.Counter = collections.Counter()
        self._lines = _Budget(MAX_LINES_PER_S, burst=self.BURST_LINES)
        self._bytes = _Budget(MAX_BYTES_PER_S, burst=4 * MAX_BYTES_PER_S)
        self._last_write = 0.0
        self._last_status = time.monotonic()
        self._strip: Optional[bool] = None  # strip ANSI escapes (decided on first output)

    @property
    def stream(self) -> TextIO:
        return self._stream or sys.stdout  # looked up late: the cell's stream

    def begin(self, world_size: int, method: str, backend: str, log_dir: str, call: int = 0) -> None:
        self.state.begin(world_size, method, backend, log_dir, call)
        if self._show_status:  # at once: a quiet first minute should not look like a hang
            what = f"call {call} on {world_size} live ranks" if call else f"starting {world_size} ranks"
            self._pending.append(f"[nblaunch] {what} ({method}, "
                                 f"{backend or 'no process group'}); full output: {log_dir}\n")
            self.flush()

    def show(self) -> None:
        """Text has nothing to build."""

    def rank_lines(self, rank: int, lines: list[str]) -> None:
        rank = self.state.label(rank)
        if self._strip is None:
            self._strip = not _renders_colour(self.stream)
        shown = [clip(line) for line in self._admit(rank, lines)]
        if self._strip:
            shown = [ansi.strip(line) for line in shown]
        self._pending.extend(f"[rank {rank}] {line}\n" for line in shown)

    def _admit(self, rank: int, lines: list[str]) -> list[str]:
        """The lines to show of those a rank wrote: ``MAX_LINES_PER_S`` and
        ``MAX_BYTES_PER_S`` sustained over all ranks, with a burst allowance;
        the rest are counted and named in a notice (the log files keep them)."""
        self.state.tail.extend(f"[rank {rank}] {ansi.strip(clip(line))}" for line in lines[-LOG_TAIL:])
        self._lines.refill()
        self._bytes.refill()
        shown = []
        for line in lines:
            cost = min(len(line), MAX_LINE_CHARS) + 40  # the tag and markup around it
            if self._lines.tokens < 1 or self._bytes.tokens < cost:
                break
            self._lines.tokens -= 1
            self._bytes.tokens -= cost
            shown.append(line)
        self._hidden[rank] += len(lines) - len(shown)
        return shown

    def _hidden_notices(self) -> list[str]:
        notices = [f"[nblaunch] rank {rank}: {count} more lines not shown here; "
                   f"all are in {self.state.log_dir}/rank{rank}.log"
                   for rank, count in sorted(self._hidden.items()) if count]
        self._hidden.clear()
        return notices

    def rank_live(self, rank: int, text: Optional[str]) -> None:
        """The line a rank is rewriting with carriage returns (or has not
        ended yet); None once it ended. Text shows whole lines only."""

    def notice(self, text: str) -> None:
        self.state.notices.append(text)
        self._pending.append(f"[nblaunch] {text}\n")
        self.flush()

    def tick(self, force: bool = False) -> None:
        now = time.monotonic()
        if self._show_status and self.state.has_progress and now - self._last_status >= STATUS_EVERY_S:
            self._last_status = now
            self._pending.append(f"[nblaunch] {self.state.elapsed():.0f} s | {self.state.summary()}\n")
        if (self._pending or self._hidden) and (force or now - self._last_write >= 1.0 / MAX_RATE):
            self.flush()

    def flush(self) -> None:
        self._pending.extend(f"{notice}\n" for notice in self._hidden_notices())
        if self._pending:
            text, self._pending = "".join(self._pending), []
            self.stream.write(text)
            self.stream.flush()
        self._last_write = time.monotonic()

    def close(self, state: str) -> None:
        self.state.end(state)
        if self._show_status:
            summary = f" | {self.state.summary()}" if self.state.has_progress else ""
            self._pending.append(f"[nblaunch] {state} in {self.state.elapsed():.1f} s{summary}\n"
                                 f"[nblaunch] full output: {self.state.log_dir}\n")
        self.flush()


class WidgetDisplay(TextDisplay):
    """An ipywidgets view in the cell; rank output goes to its log pane.

    HTML widgets in a VBox, the rank rows drawn as HTML bars: creating
    widgets costs ~0.5 ms each in the kernel (each brings its own layout and
    style models), and this view is built on every launch's critical path.

    The log pane is a scrolling box of pages of ``PAGE_LINES`` lines: a
    redraw re-sends only the newest page (and the lines being rewritten with
    carriage returns), so thousands of kept lines cost nothing per redraw;
    the oldest pages go beyond ``MAX_PAGES``. It is laid out bottom-up
    (``column-reverse``), which keeps the newest line in sight as it grows.
    """

    BURST_LINES = PAGE_LINES * MAX_PAGES  # a whole pane at once: a short script's output in full

    def __init__(self, show: bool = True, show_after: float = 0.0):
        """``show_after``: seconds the launch must run before the widgets are
        built; one that ends sooner shows only its final view, as static
        HTML (building and closing a dozen widgets is most of a short call)."""
        super().__init__(show_status=False)
        self._display_it = show
        self._show_after = show_after
        self._show_at: Optional[float] = None
        self.box = None
        self._last_draw = 0.0
        self._new_lines: list[str] = []  # HTML lines not yet on a page
        self._page_lines: list[str] = []  # the newest page's HTML lines
        self._pages: list = []  # page widgets, oldest first
        self._dropped = 0  # lines in pages dropped beyond MAX_PAGES
        self._live: dict[int, str] = {}  # rank -> the line it is rewriting
        self._live_changed = False
        self._handle = None  # the display, replaced by a static copy at the end
        self._w = None  # ipywidgets, or _Static

    def show(self) -> None:
        """Build and display the widgets. The supervisor calls this right
        after the ranks are forked and released: building them costs a few
        milliseconds that the ranks' own start-up then hides. With
        ``show_after``, they are built by the first ``tick`` after it."""
        if self.box is not None:
            return
        if self._show_after > 0 and self._show_at is None:
            self._show_at = time.monotonic() + self._show_after
            return
        import ipywidgets as w

        self._build(w)
        if self._display_it:
            from IPython.display import display

            self._handle = display(self.box, display_id=True)

    def _build(self, w) -> None:
        """The view's parts, from ipywidgets or from :class:`_Static` stand-ins."""
        self._w = w
        self.header, self.rows, self.chart, self.live, self.footer = (w.HTML() for _ in range(5))
        self.pane = w.VBox([self.live], layout=w.Layout(
            flex_flow="column-reverse", max_height="22em", overflow="auto"))
        self.box = w.VBox([self.header, self.rows, self.chart, self.pane, self.footer])
        self.state.changed = True
        self._draw()

    def rank_lines(self, rank: int, lines: list[str]) -> None:
        rank = self.state.label(rank)
        tag = f"<span style='color:{_PALETTE[rank % len(_PALETTE)]}'>[rank {rank}]</span> "
        self._new_lines.extend(tag + ansi.to_html(clip(line)) for line in self._admit(rank, lines))
        if self._live.pop(rank, None) is not None:
            self._live_changed = True

    def rank_live(self, rank: int, text: Optional[str]) -> None:
        rank = self.state.label(rank)
        if text is None or not text.strip():
            self._live_changed |= self._live.pop(rank, None) is not None
        elif self._live.get(rank) != text:
            self._live[rank] = clip(text)
            self._live_changed = True

    def notice(self, text: str) -> None:
        self.state.notices.append(text)
        self.state.changed = True
        self._draw()

    def tick(self, force: bool = False) -> None:
        now = time.monotonic()
        if self.box is None and self._show_at is not None and now >= self._show_at:
            self.show()
        if force or now - self._last_draw >= 1.0 / MAX_RATE:
            self._draw()

    def close(self, state: str) -> None:
        """Draw the final view, then put a static copy of it (HTML, and a
        plain-text summary) in the widget's place and close the widgets:
        the cell, the saved notebook and any renderer without the kernel's
        widget state (nbconvert, GitHub, a reopened notebook) show the same
        final view, and a kernel running hundreds of launches keeps no
        widgets of finished ones."""
        self.state.end(state)
        if self.box is None and self._show_after > 0:
            self._build(_Static)  # ended before its widgets were due (or before it began): the final view alone
        self.show()  # a launch that failed before its ranks started still gets its view
        self._live.clear()
        self._live_changed = True
        self._draw()
        final = {"text/html": self.static_html(), "text/plain": self.static_text()}
        if self._handle is not None:
            self._handle.update(final, raw=True)
            self._close_widgets()
        elif self._w is _Static and self._display_it:
            from IPython.display import display

            display(final, raw=True)

    def static_html(self) -> str:
        """The whole view as one HTML fragment."""
        pane = "".join(p.value for p in self._pages)
        return ("<div class='nblaunch-view'>" + self.header.value + self.rows.value + self.chart.value
                + "<div style='max-height:22em;overflow:auto;display:flex;flex-direction:column-reverse'>"
                + f"<div>{pane}</div></div>" + self.footer.value + "</div>")

    def static_text(self) -> str:
        st = self.state
        lines = [f"{st.title}: {st.state} | {st.where}, {st.method}, {st.backend or 'no process group'}, "
                 f"{st.elapsed():.1f} s"]
        lines += [f"  {r.line(st.label(i))}" for i, r in enumerate(st.ranks)]
        lines += [f"  {notice}" for notice in st.notices[-3:]]
        lines.append(f"  full output: {st.log_dir}")
        return "\n".join(lines)

    def _close_widgets(self) -> None:
        widgets = [self.box, self.header, self.rows, self.chart, self.pane, self.live, self.footer, *self._pages]
        for widget in widgets:
            for part in (getattr(widget, "layout", None), getattr(widget, "style", None), widget):
                if part is not None and getattr(part, "comm", None) is not None:
                    part.close()
        self.box = None

    def _draw(self) -> None:
        if self.box is None:
            return
        self._last_draw = time.monotonic()
        st = self.state
        color = _STATE_COLOR.get(st.state, "#1565c0")
        self.header.value = (
            f"<b style='color:{color}'>{st.title}: {st.state}</b> &nbsp; {st.where}, "
            f"{st.method}, {st.backend or 'no process group'}, {st.elapsed():.1f} s"
            + "".join(f"<pre style='color:#ef6c00;margin:2px 0'>{html.escape(n)}</pre>" for n in st.notices[-3:]))
        self._draw_log()
        if not st.changed:
            return
        st.changed = False
        rows = [_bar_row(f"rank {st.label(i)}", _fraction(r), r.status, r.detail(sep=_PART),
                         warn=r.status == "running" and r.usage is not None and r.usage.memory_low)
                for i, r in enumerate(st.ranks)]
        if len(st.ranks) > AGGREGATE_ABOVE:  # many ranks: one bar, detail on demand
            mean = sum(_fraction(r) for r in st.ranks) / len(st.ranks)
            done = sum(r.status == "finished" for r in st.ranks)
            status = "failed" if any(r.status == "failed" for r in st.ranks) else st.state
            rows = [_bar_row("all ranks", mean, status, f"{done}/{len(st.ranks)} finished"),
                    "<details><summary>per-rank detail</summary>" + "".join(rows) + "</details>"]
        self.rows.value = "<div class='nblaunch-ranks'>" + "".join(rows) + "</div>"
        self.chart.value = "".join(_svg_chart(name, series) for name, series in list(st.series.items())[:3])
        dropped = (f"{self._dropped:,} earlier lines are only in the log files; " if self._dropped else "")
        self.footer.value = f"<small>{dropped}full output: <code>{html.escape(st.log_dir)}</code></small>"

    def _draw_log(self) -> None:
        self._new_lines += [f"<span style='color:#ef6c00'>{html.escape(n)}</span>" for n in self._hidden_notices()]
        if self._new_lines:
            new, self._new_lines = self._new_lines, []
            while new:
                if not self._pages or len(self._page_lines) >= PAGE_LINES:
                    self._new_page()
                room = PAGE_LINES - len(self._page_lines)
                self._page_lines += new[:room]
                new = new[room:]
                self._pages[-1].value = _PAGE_OPEN + "\n".join(self._page_lines) + "</pre>"
        if self._live_changed:
            self._live_changed = False
            self.live.value = (_PAGE_OPEN.replace("margin:0", "margin:0;opacity:0.75") + "\n".join(
                f"<span style='color:{_PALETTE[r % len(_PALETTE)]}'>[rank {r}]</span> {ansi.to_html(t)}"
                for r, t in sorted(self._live.items())) + "</pre>") if self._live else ""

    def _new_page(self) -> None:
        self._page_lines = []
        if len(self._pages) < MAX_PAGES:
            page = self._w.HTML()
        else:  # the oldest page's widget becomes the newest page
            page = self._pages.pop(0)
            self._dropped += PAGE_LINES
            self.state.changed = True
        self._pages.append(page)
        # column-reverse: the first child is drawn at the bottom.
        self.pane.children = [self.live, *reversed(self._pages)]


class _Static:
    """Stands in for ipywidgets' ``HTML``/``VBox``/``Layout`` when the view is
    drawn only once, as static HTML: the same drawing code, no widgets."""

    def __init__(self, children=(), **_):
        self.value = ""
        self.children = list(children)


_Static.HTML = _Static.VBox = _Static.Layout = _Static


_PAGE_OPEN = "<pre class='nblaunch-log' style='margin:0;font-size:85%;white-space:pre-wrap;word-break:break-all'>"


def clip(line: str) -> str:
    """A line as the view shows it: at most ``MAX_LINE_CHARS`` characters."""
    if len(line) <= MAX_LINE_CHARS:
        return line
    return f"{line[:MAX_LINE_CHARS]} ... [{len(line) - MAX_LINE_CHARS:,} more characters in the log file]"


def _renders_colour(stream) -> bool:
    """Terminals and Jupyter front ends (which render ANSI colours in stream
    output) keep colours; files and pipes get plain text."""
    if _in_kernel() and type(stream).__module__.startswith("ipykernel"):
        return True
    try:
        return stream.isatty() and os.environ.get("TERM") != "dumb"
    except (AttributeError, ValueError):
        return False


_STATE_COLOR = {"failed": "#c62828", "stopped": "#8a8a8a", "interrupted": "#ef6c00",
                "timed out": "#ef6c00", "finished": "#2e7d32"}


def _fraction(r: RankState) -> float:
    if r.total:
        return min(1.0, r.n / r.total)
    return 1.0 if r.status == "finished" else 0.0


_MONO = "font-family:var(--jp-code-font-family,monospace);font-size:90%"


def _bar_row(label: str, fraction: float, status: str, text: str, warn: bool = False) -> str:
    # Spans, not <code>: front ends style a static copy's <code> as inline
    # code (grey boxes). nowrap: a number never breaks across lines.
    color = _STATE_COLOR.get(status, "#1565c0")
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
    return " ".join(html.escape(part).replace(" ", "&#160;") for part in text.split(_PART))


_PART = "\x1f"  # separates the parts of a row's text (RankState.detail(parts=True))


# Mid-tone colours: each reads at WCAG contrast >= 3.4 on JupyterLab's light
# and dark backgrounds alike (tests/test_view.py checks it).
_PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#d9660b", "#1a9a9a", "#c2408f", "#8d6e63"]


def _legend(series: dict[int, list], most: int = 8) -> str:
    """``rank 0 1 2 3``, each number in its line's colour (the rest on hover)."""
    ranks = sorted(series)
    shown = "".join(f"<tspan fill='{_PALETTE[r % len(_PALETTE)]}' font-weight='bold'> {r}</tspan>"
                    for r in ranks[:most])
    return "rank" + shown + (" ..." if len(ranks) > most else "")


def _svg_chart(name: str, series: dict[int, list], width: int = 420, height: int = 180) -> str:
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
    v0, v1 = f(y0), f(y1)
    left, top, bottom, right = 52, 22, 20, 10  # the title sits above the plot, never on it
    sx = (width - left - right) / ((x1 - x0) or 1)
    sy = (height - top - bottom) / ((v1 - v0) or 1)

    def y_of(v: float) -> float:
        return height - bottom - (f(v) - v0) * sy

    ticks = ([10.0 ** e for e in range(math.ceil(v0), math.floor(v1) + 1)] if log_scale
             else [y0 + (y1 - y0) * k / 3 for k in range(4)] if y1 > y0 else [y0])
    if log_scale and len(ticks) > 6:
        ticks = ticks[::math.ceil(len(ticks) / 6)]
    grid = "".join(
        f"<line x1='{left}' x2='{width - right}' y1='{y_of(t):.1f}' y2='{y_of(t):.1f}' stroke='currentColor' "
        f"stroke-opacity='0.15'/><text x='{left - 4}' y='{y_of(t) + 3:.1f}' font-size='10' text-anchor='end' "
        f"fill='currentColor'>{t:.3g}</text>" for t in ticks)
    lines = []
    for rank, pts in sorted(series.items()):
        path = " ".join(f"{left + (x - x0) * sx:.1f},{y_of(y):.1f}" for x, y in pts if not log_scale or y > 0)
        lines.append(f"<polyline fill='none' stroke='{_PALETTE[rank % len(_PALETTE)]}' "
                     f"stroke-width='1.5' points='{path}'><title>rank {rank}</title></polyline>")
    scale = " (log)" if log_scale else ""
    return (f"<svg class='nblaunch-chart' data-scale='{'log' if log_scale else 'linear'}' width='{width}' "
            f"height='{height}' style='display:inline-block;margin-right:1em;color:inherit'>"
            f"<text x='{left}' y='13' font-size='12' fill='currentColor'>{html.escape(name)}{scale} &#160; "
            f"{_legend(series)}</text>" + grid
            + f"<text x='{left}' y='{height - 4}' font-size='10' fill='currentColor'>step {x0}</text>"
            f"<text x='{width - right}' y='{height - 4}' font-size='10' text-anchor='end' "
            f"fill='currentColor'>{x1}</text>" + "".join(lines) + "</svg>")


# A launch or call shorter than this shows only its final view, as static
# HTML: building and closing a dozen widgets is most of a short call's cost
# (8.5 vs 16.5 ms for a live call, measured in bench/live.py).
SHOW_AFTER_S = 0.25


def make_display(kind: str, show_after: float = 0.0):
    """``"auto"``: widgets in a kernel with ipywidgets, else text.
    ``show_after``: see :class:`WidgetDisplay`."""
    if kind == "auto":
        kind = "widget" if _in_kernel() and _has_widgets() else "text"
    if kind == "widget":
        return WidgetDisplay(show_after=show_after)
    return TextDisplay(show_status=(kind == "text"))


def _in_kernel() -> bool:
    ip = sys.modules.get("IPython")
    shell = ip.get_ipython() if ip is not None else None
    return shell is not None and getattr(shell, "kernel", None) is not None


def _has_widgets() -> bool:
    # Found, not imported: importing ipywidgets costs tens of ms in a fresh
    # kernel, paid only once a launch lasts long enough to build its widgets.
    import importlib.util

    return "ipywidgets" in sys.modules or importlib.util.find_spec("ipywidgets") is not None
