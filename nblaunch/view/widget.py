"""The widget view: an ipywidgets box in the cell (header, a row per rank,
charts, a log pane), replaced by a static copy of itself at the end."""
from __future__ import annotations

import html
import time
from typing import Optional

from . import ansi
from .base import View
from .by_rank import ByRank, static_pages
from .html import PALETTE, PART, STATE_COLOR, bar_row, fraction, svg_chart
from .many_html import many_rows, stragglers_note
from .state import MAX_PAGES, MAX_RATE, PAGE_LINES, TEXT_TAIL_LINES, clip

MANY_RATE = 4.0  # redraws a second of the many-rank overview

__all__ = ["WidgetDisplay"]


class WidgetDisplay(View):
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

    def __init__(self, show: bool = True, show_after: float = 0.0, handle=None, keep_widgets: bool = False):
        """``show_after``: seconds the launch must run before the widgets are
        built; one that ends sooner shows only its final view, as static
        HTML (building and closing a dozen widgets is most of a short call).
        ``handle``: a display (``display(..., display_id=True)``) made
        earlier, in the cell the view belongs to, that the view is drawn
        into: a background run's view is fed from another thread, whose own
        ``display`` could land in whichever cell runs then. ``keep_widgets``:
        the widgets stay (showing the final state) after ``close`` until
        :meth:`drop_widgets`: a tab opened again while a background run
        trained shows its view from the saved notebook, whose output names
        the widgets, not the display that gets the static copy."""
        super().__init__()
        self._given_handle = handle
        self._keep_widgets = keep_widgets
        self._display_it = show
        self._show_after = show_after
        self._show_at: Optional[float] = None
        self.box = None
        self._last_draw = 0.0
        self._rows_at = 0.0  # when the rows and charts were last drawn
        self._new_lines: list[str] = []  # HTML lines not yet on a page
        self._page_lines: list[str] = []  # the newest page's HTML lines
        self._pages: list = []  # page widgets, oldest first
        self._dropped = 0  # lines in pages dropped beyond MAX_PAGES
        self._live: dict[int, str] = {}  # rank -> the line it is rewriting
        self._live_changed = False
        self._handle = None  # the display, replaced by a static copy at the end
        self._w = None  # ipywidgets, or _Static

    def show(self) -> None:
        """Build and display the widgets. The call watch calls this right
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
        if self._given_handle is not None:
            self._handle = self._given_handle
            self._handle.update(self.box)
        elif self._display_it:
            from IPython.display import display

            self._handle = display(self.box, display_id=True)

    def _build(self, w) -> None:
        """The view's parts, from ipywidgets or from :class:`_Static` stand-ins."""
        self._w = w
        self.header, self.rows, self.chart, self.live, self.footer = (w.HTML() for _ in range(5))
        self.pane = w.VBox([self.live], layout=w.Layout(
            flex_flow="column-reverse", max_height="22em", overflow="auto"))
        self.by_rank = ByRank(w, self.state, self.pane)  # the pane, or one rank's output and detail
        self.box = w.VBox([self.header, self.rows, self.chart, self.by_rank.box, self.footer])
        self.state.changed = True
        self._draw()

    def rank_lines(self, rank: int, lines: list[str]) -> None:
        rank = self.state.label(rank)
        self._new_lines.extend(_tagged(rank, line) for line in self._admit(rank, lines))
        if self._live.pop(rank, None) is not None:
            self._live_changed = True

    def rank_status(self, rank: int, status: str) -> None:
        super().rank_status(rank, status)
        if status == "failed":
            self._rows_at = 0.0  # a failure is drawn at the next tick, whatever the overview's rate

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
        """Redraw, at most at the view's rate; ``force``: now, and show the
        view now if it waits to be shown (the cell is about to block, at a
        rank's debugger prompt)."""
        now = time.monotonic()
        if self.box is None and self._show_at is not None and (force or now >= self._show_at):
            self._show_at = now
            self._show_after = 0
            self.show()
        if force or now - self._last_draw >= 1.0 / MAX_RATE:
            self._draw(force)

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
        last = self._last_unshown()  # after the count of the lines left out, each rank's last ones
        self._new_lines += [f"<span style='color:#ef6c00'>{html.escape(n)}</span>" for n in self._hidden_notices()]
        self._new_lines += [_tagged(rank, line) for rank, line in last]
        self._draw()
        final = {"text/html": self.static_html(), "text/plain": self.static_text()}
        if self._handle is None and self._given_handle is not None:
            self._handle = self._given_handle  # ended before its widgets were due: the final view in its place
        if self._handle is not None:
            self._handle.update(final, raw=True)
            if not self._keep_widgets:
                self._close_widgets()
        elif self._w is _Static and self._display_it:
            from IPython.display import display

            display(final, raw=True)

    def static_html(self) -> str:
        """The whole view as one HTML fragment."""
        pane = "".join(p.value for p in self._pages)
        return ("<div class='nblaunch-view'>" + self.header.value + self.rows.value + self.chart.value
                + "<div style='max-height:22em;overflow:auto;display:flex;flex-direction:column-reverse'>"
                + f"<div>{pane}</div></div>" + static_pages(self.state) + self.footer.value + "</div>")

    def static_text(self) -> str:
        st = self.state
        lines = [f"{st.title}: {st.state} | {st.where}, {st.method}, {st.backend or 'no process group'}, "
                 f"{st.elapsed():.1f} s"]
        if st.many:
            lines.append(f"  {st.summary()}")
            lines += [f"  {r.line(st.row_name(i))}" for i, r in enumerate(st.ranks) if r.status == "failed"][:8]
        else:
            lines += [f"  {r.line(st.row_name(i))}" for i, r in enumerate(st.ranks)]
        lines += [f"  {notice}" for notice in st.notices[-3:]]
        if st.tail:  # terminal readers (jupyter execute, papermill, nbval, a diff) see what ranks printed
            shown = list(st.tail)[-TEXT_TAIL_LINES:]
            lines.append(f"  last {len(shown)} lines of output:" if len(st.tail) > len(shown) else "  output:")
            lines += [f"    {line}" for line in shown]
        lines.append(f"  full output: {st.log_dir}")
        return "\n".join(lines)

    def drop_widgets(self) -> None:
        """Close the widgets a ``keep_widgets`` view kept (safe twice)."""
        if self.box is not None:
            self._close_widgets()

    def _close_widgets(self) -> None:
        widgets = [*self.by_rank.widgets(), self.box, self.header, self.rows, self.chart, self.pane, self.live,
                   self.footer, *self._pages]
        for widget in widgets:
            for part in (getattr(widget, "layout", None), getattr(widget, "style", None), widget):
                if part is not None and getattr(part, "comm", None) is not None:
                    part.close()
        self.box = None

    def _draw(self, force: bool = False) -> None:
        if self.box is None:
            return
        self._last_draw = time.monotonic()
        st = self.state
        color = STATE_COLOR.get(st.state, "#1565c0")
        self.header.value = (
            f"<b style='color:{color}'>{st.title}: {st.state}</b> &nbsp; {st.where}, "
            f"{st.method}, {st.backend or 'no process group'}, {st.elapsed():.1f} s"
            + "".join(f"<pre style='color:#ef6c00;margin:2px 0'>{html.escape(n)}</pre>" for n in st.notices[-3:]))
        self._draw_log()
        self.by_rank.draw(st.state not in ("starting", "running"))  # at its own rate until the end
        if not st.changed:
            return
        if (st.many and not force and st.state in ("starting", "running")
                and self._last_draw - self._rows_at < 1.0 / MANY_RATE):
            return  # an overview costs the world's size to compute: a few times a second is enough to read
        self._rows_at = self._last_draw
        st.changed = False
        if st.many:  # an overview whose size is bounded by the screen (view/many.py)
            self.rows.value, self.chart.value = many_rows(st)
        else:
            self.rows.value = stragglers_note(st) + "<div class='nblaunch-ranks'>" + "".join(
                bar_row(st.row_name(i), fraction(r), r.status, r.detail(sep=PART),
                        warn=r.status == "running" and r.usage is not None and r.usage.memory_low)
                for i, r in enumerate(st.ranks)) + "</div>"
            self.chart.value = "".join(svg_chart(name, series) for name, series in list(st.series.items())[:3])
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
                f"<span style='color:{PALETTE[r % len(PALETTE)]}'>[rank {r}]</span> {ansi.to_html(t)}"
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


_Static.HTML = _Static.VBox = _Static.Layout = _Static.Dropdown = _Static.Stack = _Static
_Static.jslink = staticmethod(lambda *_: None)


_PAGE_OPEN = "<pre class='nblaunch-log' style='margin:0;font-size:85%;white-space:pre-wrap;word-break:break-all'>"


def _tagged(rank: int, line: str) -> str:
    """A rank's line in the log pane."""
    return f"<span style='color:{PALETTE[rank % len(PALETTE)]}'>[rank {rank}]</span> " + ansi.to_html(clip(line))
