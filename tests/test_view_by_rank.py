"""The ranks' output by rank, picked in the view: the widget's model as the
browser gets it (no kernel, no process), and the saved view."""
from __future__ import annotations

import ipywidgets

from nblaunch.view import WidgetDisplay
from nblaunch.view.by_rank import MAX_PAGES, PAGE_EVERY_S, page_html
from nblaunch.view.state import RANK_TAIL
from nblaunch.wire.channel import Progress


def _view(world: int, hosts=None) -> WidgetDisplay:
    view = WidgetDisplay(show=False)  # the widgets, without a kernel to show them in
    view.begin(world, "fork", "gloo", "/tmp/logs")
    view.place(0, world, None, 1 if hosts is None else world // 8, hosts=hosts)
    view._build(ipywidgets)
    for r in range(world):
        view.rank_status(r, "running")
    return view


def test_eight_ranks_a_page_each_picked_in_the_browser_alone():
    view = _view(8)
    for r in range(8):
        view.rank_lines(r, [f"rank {r} says step {i}" for i in range(3)])
    view.progress(Progress(3, 1, "train", 5, 10, False, 1.0))
    view.by_rank.draw(force=True)  # as it is every PAGE_EVERY_S
    pick, stack = view.by_rank.pick, view.by_rank.stack
    assert pick.options == ("every rank",) + tuple(f"rank {r}" for r in range(8))
    assert stack.children[0] is view.pane and stack.selected_index == 0  # the whole pane first
    # The pick moves the stack in the front end: the kernel is busy with the call meanwhile.
    link = view.by_rank.link
    assert (link.source, link.target) == ((pick, "index"), (stack, "selected_index"))
    page = stack.children[1 + 3].value
    assert "rank 3 says step 2" in page and "rank 2 says" not in page and "rank 4 says" not in page
    # Its detail: status, bar, and where its whole output is.
    assert "rank 3 running train 5/10" in page and "/tmp/logs/rank3.log" in page

    view.rank_status(3, "failed")
    view.close("failed")
    saved = view.static_html()  # the saved notebook: the same pages, one <details> each
    assert saved.count("<details class='nblaunch-by-rank-page'>") == 8
    assert "<summary>rank 3</summary>" in saved and "rank 3 failed" in saved and "rank 3 says step 2" in saved


def test_a_rank_keeps_its_last_lines_even_those_the_pane_had_no_room_for():
    view = _view(2)
    view.rank_lines(0, [f"line {i}" for i in range(5000)])  # over the pane's rate: most are not shown there
    view.by_rank.draw(force=True)
    assert list(view.state.rank_tail[0]) == [f"line {i}" for i in range(5000 - RANK_TAIL, 5000)]
    assert "line 4999" in view.by_rank.pages[0].value


def test_1024_ranks_pages_are_groups_bounded_by_the_screen():
    view = _view(1024, hosts=[f"node{r // 8}" for r in range(1024)])
    for r in range(1024):
        view.rank_lines(r, [f"r{r} line {i} " + "x" * 80 for i in range(RANK_TAIL)])
    view.by_rank.draw(force=True)
    labels = view.by_rank.pick.options
    assert len(labels) == 1 + MAX_PAGES and labels[1] == "ranks 0-63" and labels[-1] == "ranks 960-1023"
    page = view.by_rank.pages[1].value  # ranks 64-127: each one's detail and its last lines
    assert "rank 100 \u00b7 node12 running" in page and f"r100 line {RANK_TAIL - 1} " in page
    assert f"r100 line {RANK_TAIL - 3} " not in page  # 2 lines each, where 64 ranks share a page
    assert all(len(p.value) < 40_000 for p in view.by_rank.pages)

    # Redrawn at most every PAGE_EVERY_S, whatever the ranks write (or a redraw the view forces).
    view.rank_lines(100, ["a newer line"])
    view.tick(force=False)
    assert "a newer line" not in view.by_rank.pages[1].value
    assert "a newer line" in page_html(view.state, view.by_rank.groups[1])
    view.by_rank.draw(force=True)
    assert "a newer line" in view.by_rank.pages[1].value
