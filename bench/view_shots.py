"""Screenshots of the live view at 8 and at 1,024 ranks (docs/view-8-ranks.png,
docs/view-1024-ranks.png): the widget view's own HTML, fed the reports a
real run sends (every rank's bar and loss; rank 7 at half speed; 1,024
ranks as 128 nodes of 8), rendered in headless Chromium (Debian's
``chromium``, driven by Playwright, as tests/test_browser.py does).

    python bench/view_shots.py
"""
from __future__ import annotations

import math
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from nblaunch.view.widget import WidgetDisplay, _Static  # noqa: E402  (the drawing code, without widgets)
from nblaunch.wire.channel import Metrics, Progress  # noqa: E402

CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking"]


def view_of(world: int, steps: int = 240, total: int = 400, slow: int = 7, per_node: int = 8) -> WidgetDisplay:
    """A view as it stands 24 s into a run of ``world`` ranks at 10 steps a second."""
    view = WidgetDisplay(show=False)
    view.begin(world, "fork (zygote)", "gloo", "/tmp/nblaunch/2026-12-05/run-1")
    hosts = [f"gpu-node{r // per_node:03d}" for r in range(world)] if world > per_node else None
    view.place(0, world, None, max(1, world // per_node), hosts=hosts)
    view._build(_Static)
    view.state.t0 = time.monotonic() - steps / 10
    for r in range(world):
        view.rank_status(r, "running")
    t = time.time() - steps / 10
    for step in range(steps):
        for r in range(world):
            n = step // 2 if r == slow else step
            if r == slow and step % 2:
                continue
            view.progress(Progress(r, 1, "train", n, total, False, t + step / 10))
            loss = 2.5 * math.exp(-n / 80) + 0.05 * math.sin(r + n / 7) + 0.02 * (r % 5)
            view.metrics(Metrics(r, ((n, t, {"loss": loss}),)))
        if step == steps // 2:  # the view was looked at then: the slowest rank was behind already
            view.state.overview(time.monotonic() - (steps - step) / 10)
        if step % 60 == 0:
            view.rank_lines(0, [f"step {step}: loss {2.5 * math.exp(-step / 80):.3f}"])
    view.rank_lines(slow, ["data loader: slow disk read (3.1 s)"])
    view.tick(force=True)
    view.state.changed = True
    view._rows_at = 0.0
    view._draw()
    return view


def shoot(html: str, path: Path, width: int = 1100, open_page: int = -1) -> None:
    """``open_page``: the page of the output by rank shown opened (-1: none)."""
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    page_html = ("<html><body style='font-family:system-ui,sans-serif;font-size:13px;margin:12px;"
                 f"background:#fff;color:#111'>{html}</body></html>")
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": width, "height": 400})
            page.set_content(page_html)
            if open_page >= 0:  # as a reader who picked it would see it
                page.evaluate("n => { document.querySelector('.nblaunch-by-rank').open = true;"
                              " document.querySelectorAll('.nblaunch-by-rank-page')[n].open = true; }", open_page)
            page.locator(".nblaunch-view").screenshot(path=str(path))
        finally:
            browser.close()


def main() -> None:
    for world in (8, 1024):
        view = view_of(world)
        slow_page = next(i for i, g in enumerate(view.by_rank.groups) if 7 in g)
        shoot(view.static_html(), ROOT / "docs" / f"view-{world}-ranks.png", open_page=slow_page)
        print(f"docs/view-{world}-ranks.png: {len(view.static_html()):,} bytes of HTML")


if __name__ == "__main__":
    main()
