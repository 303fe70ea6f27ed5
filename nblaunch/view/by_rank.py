"""The ranks' output by rank: one rank's lines (or one group of ranks'),
each with the rank's detail, picked in the view.

While a launch runs, the cell's thread runs its call watch, so the kernel
reads nothing the browser sends until the call is over: a pick must take
effect in the browser alone. So the pick is a ``Dropdown`` whose index is
linked, in the front end (``ipywidgets.jslink``), to the page a ``Stack``
shows, and the kernel keeps every page drawn: the whole log pane first,
then one page per rank up to ``MAX_PAGES`` ranks, else one per group of
consecutive ranks (at most ``MAX_PAGES``: 64 ranks each at 1,024). A page
gives each of its ranks its detail (where it runs, its bars, rate,
metrics, memory, its log file) and its last lines. Pages are redrawn at
most every ``PAGE_EVERY_S``, and at most ``PAGE_BYTES_PER_S`` on average
(every 7 s at 1,024 ranks): what they cost the kernel and the browser's
channel is bounded by the screen, not the world. The saved view keeps the
same pages as ``<details>``, opened one at a time.
"""
from __future__ import annotations

import html
import time

from . import ansi
from .html import MONO, STATE_COLOR

__all__ = ["ByRank", "groups", "page_label", "page_html", "static_pages", "MAX_PAGES", "PAGE_EVERY_S"]

MAX_PAGES = 16  # pages after the whole pane: one per rank up to this many ranks
PAGE_EVERY_S = 2.0  # at most this often ...
PAGE_BYTES_PER_S = 32 << 10  # ... and at most this much a second, on average, to the browser
PAGE_LINES = 48  # of a page's output, shared by its ranks (at least 2 lines each)
EVERY_RANK = "every rank"


def groups(world: int) -> list[range]:
    """The ranks (local indices) of each page: one each up to ``MAX_PAGES``
    ranks, else ``MAX_PAGES`` groups of consecutive ranks."""
    if world <= 0:
        return []
    size = -(-world // MAX_PAGES)
    return [range(start, min(world, start + size)) for start in range(0, world, size)]


def page_label(st, group: range) -> str:
    """``rank 3`` or ``ranks 64-127`` (the ranks' numbers in the job)."""
    first, last = st.label(group[0]), st.label(group[-1])
    return f"rank {first}" if first == last else f"ranks {first}-{last}"


def rank_detail(st, i: int) -> str:
    """What the view knows of local rank ``i``, in one line: its name and
    machine, status, bars, rate, metrics, memory."""
    return st.ranks[i].line(st.row_name(i))


def page_html(st, group: range) -> str:
    """The page of ``group``: each rank's detail, then its last lines."""
    each = max(2, PAGE_LINES // len(group))
    where = f"{st.log_dir}/rank{st.label(group[0])}.log" if len(group) == 1 else f"{st.log_dir}/rank<N>.log"
    parts = [f"<div style='{MONO};opacity:0.75'>full output: {html.escape(where)}</div>"] if st.log_dir else []
    for i in group:
        r = st.ranks[i]
        color = STATE_COLOR.get(r.status, "#1565c0")
        parts.append(f"<div class='nblaunch-rank-detail' data-rank='{st.label(i)}' style='{MONO};color:{color}'>"
                     f"{html.escape(rank_detail(st, i))}</div>")
        lines = list(st.rank_tail.get(st.label(i), ()))[-each:]
        if lines:
            parts.append("<pre class='nblaunch-rank-log' style='margin:0 0 4px 1em;font-size:85%;"
                         "white-space:pre-wrap;word-break:break-all'>"
                         + "\n".join(ansi.to_html(line) for line in lines) + "</pre>")
    return f"<div class='nblaunch-page' style='max-height:22em;overflow:auto'>{''.join(parts)}</div>"


def static_pages(st) -> str:
    """The pages for the saved view: one ``<details>`` each, under one that
    says how the output is split."""
    pages = groups(len(st.ranks))
    if not pages:
        return ""
    inner = "".join(f"<details class='nblaunch-by-rank-page'><summary>{html.escape(page_label(st, g))}</summary>"
                    f"{page_html(st, g)}</details>" for g in pages)
    return (f"<details class='nblaunch-by-rank'><summary>output and detail by rank</summary>"
            f"<div style='margin-left:1em'>{inner}</div></details>")


class ByRank:
    """The pick and its pages, from ipywidgets ``w`` (or the view's static
    stand-ins). ``every`` is the whole log pane: the first page."""

    def __init__(self, w, st, every):
        self._st = st
        self.groups = groups(len(st.ranks))
        self.pages = [w.HTML() for _ in self.groups]
        labels = [EVERY_RANK] + [page_label(st, g) for g in self.groups]
        self.pick = w.Dropdown(options=labels, index=0, description="output of",
                               layout=w.Layout(width="16em"))
        self.stack = w.Stack([every, *self.pages], selected_index=0)
        self.link = w.jslink((self.pick, "index"), (self.stack, "selected_index"))
        self.box = w.VBox([self.pick, self.stack])
        self._next_at = 0.0  # the next redraw, unless forced

    def draw(self, force: bool = False) -> None:
        """Redraw the pages (at most every ``PAGE_EVERY_S``, unless ``force``)."""
        now = time.monotonic()
        if not force and now < self._next_at:
            return
        sent = 0
        for page, group in zip(self.pages, self.groups):
            text = page_html(self._st, group)
            if page.value != text:
                page.value = text
                sent += len(text)
        self._next_at = now + max(PAGE_EVERY_S, sent / PAGE_BYTES_PER_S)

    def widgets(self) -> list:
        """Every widget it made (to close), the link first."""
        return [w for w in (self.link, self.pick, self.stack, self.box, *self.pages) if w is not None]
