"""The live view as a person sees it: JupyterLab 4 and Notebook 7 on loopback,
a notebook run in headless Chromium (Debian's chromium, driven by Playwright; no downloaded
browser), the DOM read while the ranks train and after.

Skipped where Chromium, JupyterLab, Notebook or Playwright are missing, unless
``NBLAUNCH_REQUIRE_BROWSER=1`` (set by ``.ci/run``, which installs them):
then a missing piece fails the test instead of hiding it. Screenshots go to
``$NBLAUNCH_ARTIFACTS`` (default ``test-artifacts/`` in the checkout).
"""
from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import nbformat
import pytest

pytestmark = [pytest.mark.timeout(300), pytest.mark.browser]  # pytest -m browser (CI: .ci/run)

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# The flags Chromium needs as root on a machine with no network beyond loopback.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]

# A 4-rank CPU training slowed to ~4 s, so the view can be watched while it moves.
LIVE_TRAIN = """
import time, torch
from nblaunch import notebook_launcher, progress, log

def train(steps=60):
    import torch.distributed as dist
    torch.manual_seed(dist.get_rank())  # each rank its own data: a loss line each
    w = torch.nn.Parameter(torch.zeros(4))
    opt = torch.optim.SGD([w], lr=0.05)
    for step in progress(range(steps), desc="train"):
        x = torch.randn(16, 4)
        loss = ((x @ w - x.sum(1)) ** 2).mean()
        opt.zero_grad(); loss.backward(); opt.step()
        log(loss=loss.item())
        if step % 20 == 0:
            print(f"step {step}: loss {loss.item():.3f}")
        time.sleep(0.06)
    return dist.get_rank()

def fail_on_2():
    import torch.distributed as dist
    if dist.get_rank() == 2:
        raise ValueError("rank two gives up")
    dist.barrier()
"""

# One reading per launch view on the page, in page order: each view is an
# ipywidgets VBox whose header reads "nblaunch: <state>" while it runs, then
# the static copy of its final state (.nblaunch-view) that replaces it.
READ_VIEWS = """() => Array.from(document.querySelectorAll('.widget-vbox, .nblaunch-view')).map(box => {
  const header = Array.from(box.querySelectorAll('b')).map(b => b.textContent)
      .find(t => t.startsWith('nblaunch: '));
  if (!header) return null;
  const bars = Array.from(box.querySelectorAll('.nblaunch-rank'))
      .map(e => [e.dataset.status, parseFloat(e.dataset.fraction)]);
  const lines = box.querySelectorAll('svg.nblaunch-chart polyline').length;
  const text = box.innerText;
  const logged = [0, 1, 2, 3].filter(r => text.includes(`[rank ${r}] step 40: loss`));
  return {header, bars, lines, logged};
}).filter(view => view !== null)"""
NO_VIEW = {"header": None, "bars": [], "lines": 0, "logged": []}


def _missing(app: str) -> str:
    if CHROMIUM is None:
        return "no chromium on PATH (Debian: apt-get install chromium)"
    for module in ("playwright", app):
        try:
            __import__(module)
        except ImportError:
            return f"{module} is not installed (it is in the test extras)"
    return ""


@contextlib.contextmanager
def _serve(tmp_path: Path, app: str, dark: bool = False):
    """A Jupyter server (``app``: ``"jupyterlab"`` or ``"notebook"``, for
    Notebook 7) on loopback serving ``tmp_path``; yields a function that
    opens a notebook in headless Chromium once its kernel is idle."""
    missing = _missing(app)
    if missing:
        if os.environ.get("NBLAUNCH_REQUIRE_BROWSER") == "1":
            pytest.fail(f"the browser test is required here but {missing}")
        pytest.skip(missing)
    from playwright.sync_api import sync_playwright

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    token = secrets.token_hex(16)
    settings = tmp_path / "lab-settings" / "@jupyterlab" / "apputils-extension"
    settings.mkdir(parents=True)
    (settings / "notification.jupyterlab-settings").write_text(
        json.dumps({"fetchNews": "false", "checkForUpdates": False}))  # no news toast over the view
    if dark:
        (settings / "themes.jupyterlab-settings").write_text(json.dumps({"theme": "JupyterLab Dark"}))
    env = dict(os.environ, JUPYTERLAB_SETTINGS_DIR=str(tmp_path / "lab-settings"))
    env.pop("PYTEST_CURRENT_TEST", None)  # as a user's server: ipykernel captures fds again
    app_class = "LabApp" if app == "jupyterlab" else "JupyterNotebookApp"
    # JupyterLab only: no calls out (Notebook 7's config shim rejects these).
    quiet = ["--LabApp.news_url=None", "--LabApp.extension_manager=readonly",
             "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"] if app == "jupyterlab" else []
    server = subprocess.Popen(
        [sys.executable, "-m", app, "--no-browser", "--allow-root", "--ip=127.0.0.1",
         f"--port={port}", f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={tmp_path}",
         # Exposes window.jupyterapp, whose commands run the cells.
         f"--{app_class}.expose_app_in_browser=True", *quiet],
        env=env, stdout=open(tmp_path / "server.log", "wb"), stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    path = "lab/tree" if app == "jupyterlab" else "notebooks"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2)
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise AssertionError(f"{app} did not start:\n" + (tmp_path / "server.log").read_text())
                time.sleep(0.2)
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            try:
                def open_notebook(name: str):
                    page = browser.new_page(viewport={"width": 1280, "height": 1100})
                    page.goto(f"{base}/{path}/{name}?token={token}")
                    page.wait_for_function(
                        "() => { const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;"
                        " const k = w && w.sessionContext && w.sessionContext.session"
                        " && w.sessionContext.session.kernel; return k && k.status === 'idle'; }",
                        timeout=90_000)
                    return page

                yield open_notebook
            finally:
                browser.close()
    finally:
        server.terminate()  # the server shuts its kernels down, and their ranks with them
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


@pytest.fixture
def lab(tmp_path):
    with _serve(tmp_path, "jupyterlab") as open_notebook:
        yield open_notebook


@pytest.fixture
def lab_dark(tmp_path):
    with _serve(tmp_path, "jupyterlab", dark=True) as open_notebook:
        yield open_notebook


@pytest.fixture
def notebook7(tmp_path):
    with _serve(tmp_path, "notebook") as open_notebook:
        yield open_notebook


def _run_all(page) -> None:
    # Not awaited: the command's promise resolves only when every cell ran.
    page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }")


def _artifacts() -> Path:
    path = Path(os.environ.get("NBLAUNCH_ARTIFACTS", ROOT / "test-artifacts"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def _read(page, index: int = 0) -> dict:
    views = page.evaluate(READ_VIEWS)
    return views[index] if len(views) > index else NO_VIEW


def _wait_view(page, settled, index: int = 0, timeout_s: float = 120) -> dict:
    """Poll launch view ``index`` until ``settled(view)``; return the last
    reading. The header and the rank rows are separate widgets whose updates
    reach the page one after the other, so one reading can show the new
    header above the old rows: wait for the state instead of reading it once."""
    deadline = time.monotonic() + timeout_s
    view = _read(page, index)
    while not settled(view) and time.monotonic() < deadline:
        page.wait_for_timeout(100)
        view = _read(page, index)
    return view


def _ended(view) -> bool:
    return (view["header"] or "").startswith(("nblaunch: finished", "nblaunch: failed"))


def test_four_ranks_train_and_the_view_moves_live(lab, tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(LIVE_TRAIN),
                nbformat.v4.new_code_cell("results = notebook_launcher(train, num_processes=4)"),
                nbformat.v4.new_code_cell("print('results:', results)"),
                nbformat.v4.new_code_cell("notebook_launcher(fail_on_2, num_processes=4)")]
    # A kernelspec, or JupyterLab asks which kernel to start.
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, tmp_path / "live.ipynb")
    page = lab("live.ipynb")
    _run_all(page)
    snapshots = []
    shot_taken = picked = False
    deadline = time.monotonic() + 120
    while True:
        view = _read(page)
        snapshots.append(view)
        header = view["header"] or ""
        if header.startswith("nblaunch: running") and not picked:
            # One rank's output and detail, picked while the kernel is busy
            # with the launch: the browser alone shows its page.
            pick = page.locator(".widget-dropdown select").first
            pick.select_option("rank 2")
            page.wait_for_selector(".nblaunch-rank-detail[data-rank='2']", state="visible", timeout=10_000)
            assert not page.locator(".nblaunch-rank-detail[data-rank='1']").first.is_visible()
            pick.select_option("every rank")
            picked = True
        if header.startswith("nblaunch: running") and not shot_taken and view["lines"] \
                and any(0.3 < f < 0.8 for _, f in view["bars"]):
            page.screenshot(path=str(_artifacts() / "jupyterlab-live-view-running.png"))
            shot_taken = True
        if _ended(view):
            break
        assert time.monotonic() < deadline, f"no end in sight: {view}"
        page.wait_for_timeout(100)
    page.wait_for_selector("text=results: [0, 1, 2, 3]", timeout=30_000)
    page.screenshot(path=str(_artifacts() / "jupyterlab-live-view-finished.png"))

    final = _wait_view(page, lambda v: [s for s, _ in v["bars"]] == ["finished"] * 4, timeout_s=10)
    assert final["header"].startswith("nblaunch: finished"), final
    assert final["bars"] == [["finished", 1.0]] * 4  # one bar per rank, each at 100%
    assert final["lines"] == 4  # the loss chart: a line per rank
    assert final["logged"] == [0, 1, 2, 3]  # the log pane: every rank's printed lines, tagged
    # Live, not only at the end: while running, bars part-way and a loss curve
    # already drawn, and the bars moved between redraws.
    running = [v for v in snapshots if (v["header"] or "").startswith("nblaunch: running")]
    midway = [v for v in running if v["lines"] and any(0 < f < 1 for _, f in v["bars"])]
    assert midway, f"the view never showed a rank part-way: {snapshots[:3]} ... {snapshots[-3:]}"
    means = {round(sum(f for _, f in v["bars"]) / len(v["bars"]), 2) for v in running if v["bars"]}
    assert len(means) >= 3, f"the bars did not move while running: {sorted(means)}"
    assert shot_taken and picked

    # Then a launch that fails: its view ends red, naming the rank, and the
    # cell shows the one error with that rank's own traceback.
    page.wait_for_selector("text=WorkerError: rank 2 raised ValueError: rank two gives up", timeout=60_000)
    page.wait_for_selector("text=Traceback from rank 2", timeout=10_000)
    failed = _wait_view(page, lambda v: len(v["bars"]) == 4 and all(
        status in ("stopped", "failed") for status, _ in v["bars"]), index=1, timeout_s=10)
    assert failed["header"].startswith("nblaunch: failed"), failed
    assert [status for status, _ in failed["bars"]] == ["stopped", "stopped", "failed", "stopped"], failed
    page.locator(".jp-Cell").last.screenshot(path=str(_artifacts() / "jupyterlab-failed-launch.png"))


def test_quickstart_tutorial_in_notebook7(notebook7, tmp_path):
    shutil.copy(ROOT / "notebooks" / "01_quickstart.ipynb", tmp_path)
    page = notebook7("01_quickstart.ipynb")
    _run_all(page)
    view = _wait_view(page, lambda v: _ended(v) and all(status != "running" for status, _ in v["bars"]))
    assert view["header"].startswith("nblaunch: finished"), view
    assert view["bars"] == [["finished", 1.0]] * 2 and view["lines"] == 2, view
    page.wait_for_selector("text=loss went down on every rank: True", timeout=30_000)
    page.screenshot(path=str(_artifacts() / "notebook7-quickstart.png"), full_page=True)


READ_COLOURS = """() => {
  const view = document.querySelector('.nblaunch-view');
  const cell = view.closest('.jp-Cell') || document.body;
  let bg = 'rgba(0, 0, 0, 0)', e = view;
  while (e && /rgba\\(0, 0, 0, 0\\)|transparent/.test(bg)) { bg = getComputedStyle(e).backgroundColor; e = e.parentElement; }
  const texts = ['.nblaunch-text', '.nblaunch-label', 'b', 'small', 'pre']
      .map(sel => view.querySelector(sel)).filter(Boolean).map(el => getComputedStyle(el).color);
  return {bg, texts};
}"""


def _contrast(css_a: str, css_b: str) -> float:
    """WCAG 2 contrast ratio of two ``rgb(...)`` colours (1 to 21)."""
    def luminance(css: str) -> float:
        channels = [float(v) / 255 for v in css[css.index("(") + 1:].rstrip(")").split(",")[:3]]
        r, g, b = (c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4 for c in channels)
        return 0.2126 * r + 0.7152 * g + 0.0722 * b

    high, low = sorted((luminance(css_a), luminance(css_b)), reverse=True)
    return (high + 0.05) / (low + 0.05)


# the live view again, in the dark theme
def test_eight_ranks_in_the_dark_theme_and_the_saved_notebook_reopened(lab_dark, tmp_path):
    """Readable with 8 ranks in JupyterLab's dark theme (the screenshot is
    kept to look at), and the notebook saved the default way (no widget
    state) shows the final view when opened again, not "model not found"."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(LIVE_TRAIN),
                nbformat.v4.new_code_cell("results = notebook_launcher(train, args=(30,), num_processes=8)"),
                nbformat.v4.new_code_cell("print('results:', results)")]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, tmp_path / "eight.ipynb")
    page = lab_dark("eight.ipynb")
    assert page.evaluate("() => document.body.dataset.jpThemeLight") == "false"  # the dark theme is on
    _run_all(page)
    page.wait_for_selector("text=results: [0, 1, 2, 3, 4, 5, 6, 7]", timeout=240_000)
    view = _wait_view(page, lambda v: _ended(v) and len(v["bars"]) == 8, timeout_s=30)
    assert view["header"].startswith("nblaunch: finished") and view["bars"] == [["finished", 1.0]] * 8, view
    assert view["lines"] == 8, view  # a loss line per rank
    colours = page.evaluate(READ_COLOURS)
    assert _contrast(colours["bg"], "rgb(0, 0, 0)") < 2, colours  # a dark background
    for text in colours["texts"]:  # every kind of text in the view, readable on it (WCAG AA, large/bold text)
        assert _contrast(text, colours["bg"]) >= 3, colours
    page.locator(".jp-Cell").nth(1).screenshot(path=str(_artifacts() / "jupyterlab-dark-8-ranks.png"))

    page.evaluate("() => window.jupyterapp.commands.execute('docmanager:save')")
    deadline = time.monotonic() + 30
    while True:
        saved = nbformat.read(tmp_path / "eight.ipynb", as_version=4)
        html = [o["data"].get("text/html", "") for o in saved.cells[1].get("outputs", []) if "data" in o]
        if any("nblaunch-view" in h for h in html) or time.monotonic() > deadline:
            break
        page.wait_for_timeout(200)
    assert any("nblaunch: finished" in h and "rank 7" in h for h in html), html
    assert "widget-state" not in json.dumps(saved.metadata)  # saved without widget state
    page.evaluate("() => window.jupyterapp.commands.execute('kernelmenu:shutdown')")
    page.close()

    again = lab_dark("eight.ipynb")  # the saved file, opened afresh; nothing re-runs
    again.wait_for_selector(".nblaunch-view", timeout=30_000)
    reopened = _read(again)
    assert reopened["header"].startswith("nblaunch: finished") and len(reopened["bars"]) == 8, reopened
    body = again.inner_text("body")
    assert "Error displaying widget" not in body and "model not found" not in body


BACKGROUND_TRAIN = """
import os, time, nblaunch

def train(gate, later):
    rank = os.environ["RANK"]
    for step in nblaunch.progress(range(80), desc="train"):
        if step == 20:
            while not os.path.exists(gate):
                time.sleep(0.02)
        if step == 60:
            open(f"{later}.reached.{rank}", "w").close()
            while not os.path.exists(later):
                time.sleep(0.02)
        print("before close" if step < 20 else "while closed", step, flush=True)
        nblaunch.log(loss=1.0 / (step + 1))
        time.sleep(0.02)
    return int(rank)
"""

READ_RUN_VIEW = """() => Array.from(document.querySelectorAll('.widget-vbox, .nblaunch-view')).map(box => {
  const header = Array.from(box.querySelectorAll('b')).map(b => b.textContent)
      .find(t => t.startsWith('nblaunch: '));
  return header ? {header, text: box.innerText} : null;
}).filter(view => view !== null)[0] || {header: '', text: ''}"""


def test_a_background_run_s_view_comes_back_with_a_reopened_tab(lab, tmp_path):
    """Issue 38: the tab is closed while a background run trains and opened
    again: the view is there, live (widget state from the kernel), with the
    lines the ranks printed while no tab was open, and it goes on to the end."""
    gate, later = str(tmp_path / "gate"), str(tmp_path / "later")
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(BACKGROUND_TRAIN),
                nbformat.v4.new_code_cell(f"run = nblaunch.submit(train, args=({gate!r}, {later!r}), "
                                          "num_processes=2)")]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, tmp_path / "bg.ipynb")
    page = lab("bg.ipynb")
    _run_all(page)
    deadline = time.monotonic() + 120
    view = page.evaluate(READ_RUN_VIEW)
    while "[rank 1] before close 19" not in view["text"]:
        assert time.monotonic() < deadline, f"the run's view never showed its first lines: {view}"
        page.wait_for_timeout(100)
        view = page.evaluate(READ_RUN_VIEW)
    assert view["header"].startswith("nblaunch: running"), view
    page.evaluate("() => window.jupyterapp.commands.execute('docmanager:save')")
    saved = tmp_path / "bg.ipynb"
    while "application/vnd.jupyter.widget-view+json" not in saved.read_text():
        assert time.monotonic() < deadline, "the notebook was not saved"
        time.sleep(0.1)
    page.close()  # the tab is closed: no front end is connected

    open(gate, "w").close()
    for rank in (0, 1):
        while not os.path.exists(f"{later}.reached.{rank}"):
            assert time.monotonic() < deadline, "the ranks did not train on while the tab was closed"
            time.sleep(0.05)
    page = lab("bg.ipynb")  # the same kernel: its session outlived the tab
    view = page.evaluate(READ_RUN_VIEW)
    while "[rank 1] while closed 59" not in view["text"]:
        assert time.monotonic() < deadline, f"the reopened tab did not show the lines printed meanwhile: {view}"
        page.wait_for_timeout(100)
        view = page.evaluate(READ_RUN_VIEW)
    assert view["header"].startswith("nblaunch: running") and "[rank 0] before close 0" in view["text"], view
    page.screenshot(path=str(_artifacts() / "jupyterlab-background-run-reopened.png"))
    open(later, "w").close()
    while not view["header"].startswith("nblaunch: finished"):  # still live in the reopened tab
        assert time.monotonic() < deadline + 60, f"the reopened view did not follow the run to its end: {view}"
        page.wait_for_timeout(100)
        view = page.evaluate(READ_RUN_VIEW)
    assert "[rank 1] while closed 79" in view["text"]
    # And it stays: the widgets are kept (the reopened tab's output names them, not the display that gets
    # the static copy), so the end does not blank it.
    for _ in range(10):
        page.wait_for_timeout(200)
        view = page.evaluate(READ_RUN_VIEW)
        assert view["header"].startswith("nblaunch: finished"), view
