"""The live view: progress()/log() in ranks, the widget view in a real kernel,
the text fallback, stall warnings, and a flooding rank."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
import time

import nbformat
import pytest
from nbclient import NotebookClient

from nblaunch import log, notebook_launcher, progress

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def kernel_for_view():
    from conftest import Kernel

    k = Kernel()
    try:
        yield k
    finally:
        k.shutdown()

TRAIN = """
from nblaunch import notebook_launcher, progress, log
def train(steps):
    import torch.distributed as dist
    for i in progress(range(steps), desc="train"):
        log(loss=1.0 / (i + 1), lr=0.1)
    return dist.get_rank()
"""


def test_the_saved_notebook_keeps_the_final_view(tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(TRAIN),
                nbformat.v4.new_code_cell("out = notebook_launcher(train, args=(40,), num_processes=2)"),
                nbformat.v4.new_code_cell("print(out)")]
    NotebookClient(nb, kernel_name="python3", timeout=180, store_widget_state=True).execute()
    launch = nb.cells[1].outputs
    # The live widget was replaced by a static copy of its final state: no
    # widget left to find (nothing says "model not found"), nothing printed beside it.
    assert len(launch) == 1 and launch[0]["output_type"] == "display_data", launch
    data = launch[0]["data"]
    assert "application/vnd.jupyter.widget-view+json" not in data
    html = data["text/html"]
    bars = re.findall(r"class='nblaunch-rank' data-status='(\w+)' data-fraction='([\d.]+)'", html)
    assert bars == [("finished", "1.000"), ("finished", "1.000")]  # one bar per rank, at 100%
    assert "nblaunch: finished" in html
    rows = re.findall(r"<span class='nblaunch-label' style='[^']*'>(rank \d)</span>.*?"
                      r"<span class='nblaunch-text' style='[^']*'>(.*?)</span>", html)
    assert [label for label, _ in rows] == ["rank 0", "rank 1"]  # one label per row
    import html as html_module

    shown = [html_module.unescape(text).replace("\xa0", " ") for _, text in rows]  # as a renderer shows it
    assert all(text.startswith("finished train 40/40") for text in shown), rows
    assert "loss=0.025" in html and "lr=0.1" in html
    assert "<svg class='nblaunch-chart'" in html and "<polyline" in html  # the loss curve
    assert "nblaunch: finished" in data["text/plain"] and "rank 1 finished train 40/40" in data["text/plain"]
    assert "[0, 1]" in nb.cells[2].outputs[0]["text"]
    # What GitHub and nbconvert readers get: the outcome and a line per rank.
    from nbconvert import HTMLExporter, MarkdownExporter

    for exporter in (MarkdownExporter(), HTMLExporter()):
        body, _ = exporter.from_notebook_node(nb)
        assert "nblaunch: finished" in body and "VBox(" not in body
        shown = html_module.unescape(body).replace("\xa0", " ")  # no-break spaces keep a value whole
        assert shown.count("finished train 40/40") >= 2


def test_text_fallback_outside_a_kernel_prints_status_and_summary(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(TRAIN + textwrap.dedent("""
        if __name__ == "__main__":
            print("RESULT", notebook_launcher(train, args=(25,), num_processes=2))
    """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    summary = [line for line in out.stdout.splitlines() if line.startswith("[nblaunch] finished in")]
    assert len(summary) == 1
    assert "rank 0 finished train 25/25" in summary[0] and "rank 1 finished train 25/25" in summary[0]
    assert "loss=0.04" in summary[0]
    assert "RESULT [0, 1]" in out.stdout


def test_many_ranks_collapse_to_an_overview_bounded_by_the_screen():
    from nblaunch.wire.channel import Progress
    from nblaunch.view import WidgetDisplay

    view = WidgetDisplay(show=False)  # the drawing, without a kernel to show it in
    view.begin(20, "fork", "gloo", "/tmp/x")
    view.show()
    for rank in range(20):
        view.state.set_rank(rank, "running")
        view.state.progress(Progress(rank, 1, "train", 5 if rank else 10, 10, False, 0.0))
    view.tick(force=True)
    rows = view.rows.value
    # min / median / max of the ranks' progress: the median drawn solid, the range light
    assert "data-median='0.500'" in rows and "50% / 50% / 100%" in rows
    assert rows.count("class='nblaunch-rank'") == 0  # no row per rank while none fails or lags (tests/test_scale.py)
    view.close("finished")
    assert "every rank (20)" in view.rows.value  # every row, on demand, in the final view


def test_progress_and_log_work_outside_a_launch(capsys):
    items = list(progress(range(5), desc="local"))
    log(loss=1.0)  # a no-op, not an error
    with progress(total=3) as bar:
        bar.update(3)
    assert items == [0, 1, 2, 3, 4]
    err = capsys.readouterr().err
    assert "local: [####################] 5/5" in err and "3/3" in err


def one_rank_stalls():
    import torch.distributed as dist

    for _ in progress(range(40), desc="step"):
        if dist.get_rank() == 1 and _ == 5:
            time.sleep(4)  # stuck while rank 0 moves on
        time.sleep(0.1)


def test_stall_warning_names_the_stalled_rank_only(capsys):
    notebook_launcher(one_rank_stalls, num_processes=2, stall_warning=1.5, display="text")
    notices = [line for line in capsys.readouterr().out.splitlines() if "has made no progress" in line]
    assert notices, "expected a stall warning"
    assert all(line.startswith("[nblaunch] rank 1 has made no progress") for line in notices)
    assert "(last at step 5/40)" in notices[0] and "while ranks 0 moved on" in notices[0]


def one_rank_stopped(folder):
    import os
    import signal

    rank, mark = int(os.environ["RANK"]), os.path.join(folder, "rank1")
    for step in progress(range(60), desc="step"):
        if rank == 1 and step == 5:
            open(mark, "w").write(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGSTOP)  # state T until rank 0 sends SIGCONT
        if rank == 0 and step == 45:
            os.kill(int(open(mark).read()), signal.SIGCONT)
        time.sleep(0.1)


def test_a_stopped_rank_is_named_stopped_in_the_view_and_the_stall_warning(capsys, tmp_path):
    notebook_launcher(one_rank_stopped, args=(str(tmp_path),), num_processes=2, stall_warning=2.5,
                      init_process_group=False, display="text")
    out = capsys.readouterr().out
    notices = [line for line in out.splitlines() if "[nblaunch] rank 1" in line]
    assert notices and re.match(r"\[nblaunch\] rank 1 is stopped \(SIGSTOP\) for \d+ s \(last at step 4/60\) "
                                r"while ranks 0 moved on", notices[0]), out
    assert "preempted" not in out  # continued, it is not taken for a SIGTERM (see rank.term.pause)


def flood(n):
    import sys as _sys

    for i in range(n):
        _sys.stdout.write(f"line {i}\n")
    return n


def test_a_flooding_rank_keeps_the_kernel_calm_and_the_log_complete(tmp_path, monkeypatch):
    from conftest import Kernel

    k = Kernel(extra_env={"NBLAUNCH_LOG_DIR": str(tmp_path)})
    try:
        k.execute("from nblaunch import notebook_launcher\n"
                  "def flood(n):\n    for i in range(n):\n        print(f'line {i}')\n    return n\n")
        start = time.monotonic()
        r = k.execute("print('RESULT', notebook_launcher(flood, args=(200_000,), num_processes=1))",
                      timeout=240)
        elapsed = time.monotonic() - start
        assert r.error is None, r.error
        assert "RESULT [200000]" in r.stdout
        # What Jupyter's IOPub limits (1,000 messages/s, 1 MB/s): far below both.
        updates = [m for m in r.outputs if m["msg_type"] == "comm_msg"]
        sent = sum(len(json.dumps(m["content"])) for m in updates)
        assert len(updates) <= 100 * (elapsed + 1), (len(updates), elapsed)
        assert sent <= 400_000 * (elapsed + 1), (sent, elapsed)
        (launch,) = tmp_path.iterdir()
        lines = (launch / "rank0.log").read_text().splitlines()
        assert len(lines) == 200_000 and lines[-1] == "line 199999"
        # Text mode shows at most ~1000 lines a second and says where the rest are.
        r = k.execute("notebook_launcher(flood, args=(200_000,), num_processes=1, display='text')",
                      timeout=240)
        shown = [line for line in r.stdout.splitlines() if line.startswith("[rank 0] line")]
        assert 0 < len(shown) < 200_000
        assert "more lines not shown here; all are in" in r.stdout
    finally:
        k.shutdown()


def test_each_running_row_shows_its_cpu_and_memory(kernel_for_view):
    from conftest import rows_updates

    # Each rank spins until it has used 3 s of CPU itself, however loaded the
    # machine is, and returns the share of a core it got: what the row must
    # have shown, whatever the machine's speed.
    reply = kernel_for_view.execute(
        "from nblaunch import notebook_launcher\n"
        "def busy():\n"
        "    import time\n"
        "    wall, cpu = time.monotonic(), time.process_time()\n"
        "    while time.process_time() - cpu < 3 and time.monotonic() - wall < 120:\n"
        "        pass\n"
        "    return 100 * (time.process_time() - cpu) / (time.monotonic() - wall)\n"
        "shares = notebook_launcher(busy, num_processes=2)\n"
        "print('SHARES', min(shares))\n", timeout=240)
    assert reply.error is None, reply.error
    share = float(reply.stdout.split("SHARES")[1])
    shown = [re.search(r"\u00b7 cpu (\d+)% mem (\d+) MiB", row[2]) for u in rows_updates(reply.outputs) for row in u.rows]
    readings = [(int(m.group(1)), int(m.group(2))) for m in shown if m]
    assert readings, "no row showed its resources"
    assert max(cpu for cpu, _ in readings) >= share / 2, (readings, share)  # the reading follows the rank's use
    assert all(mem > 20 for _, mem in readings)  # a rank with torch loaded
    final = rows_updates(reply.outputs)[-1].rows
    assert all("cpu" not in row[2] for row in final)  # a finished row shows no stale reading


def test_a_rank_is_flagged_when_the_machine_runs_low_on_memory(monkeypatch):
    """The low-memory reading is faked (psutil.virtual_memory): this machine
    cannot be brought near its limit safely. The processes are real."""
    import subprocess
    from collections import namedtuple

    from nblaunch.system import resources

    big = subprocess.Popen([sys.executable, "-c", "import time; x = bytearray(200 << 20); time.sleep(30)"])
    small = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        time.sleep(1.0)
        vm = namedtuple("vm", "total available")
        monkeypatch.setattr(resources.psutil, "virtual_memory", lambda: vm(16 << 30, 1 << 30))
        usage = resources.Sampler({}, first_after=0).sample({0: big.pid, 1: small.pid})
        assert usage[0].memory_low and not usage[1].memory_low  # the big one, before the OOM killer picks
        assert "(memory low!)" in usage[0].text()
        monkeypatch.setattr(resources.psutil, "virtual_memory", lambda: vm(16 << 30, 8 << 30))
        time.sleep(resources.INTERVAL_S)
        assert not resources.Sampler({}, first_after=0).sample({0: big.pid})[0].memory_low
    finally:
        big.kill()
        small.kill()
        big.wait()
        small.wait()


def test_gpu_memory_without_nvml_comes_from_the_rank(kernel):
    from conftest import rows_updates

    """This machine has no GPU: inside the ranks, torch.cuda's answers are
    faked (an initialised context holding 1 GiB of an 80 GiB device) and
    pynvml is made unimportable. The launch, the event and the row are real."""
    r = kernel.execute(textwrap.dedent("""
        import sys, time, torch
        from nblaunch import notebook_launcher
        def fake_gpu_rank():
            sys.modules["pynvml"] = None  # NVML absent
            torch.cuda.is_initialized = lambda: True
            torch.cuda.current_device = lambda: 0
            torch.cuda.mem_get_info = lambda device=None: (79 << 30, 80 << 30)
            torch.cuda.memory_reserved = lambda device=None: 1 << 30
            time.sleep(3.0)
        notebook_launcher(fake_gpu_rank, num_processes=2, display="widget")
        """))
    assert r.error is None, r.error
    texts = [text for update in rows_updates(r.outputs) for _, _, text in update.rows]
    assert any("gpu0 1.0 GiB/80.0 GiB" in t for t in texts), texts[-2:]


def test_a_row_says_what_its_rank_does_before_its_first_step(monkeypatch):
    """No row sits silent at 0%: importing, joining the process group, in fn."""
    import nblaunch.session as session_mod
    from nblaunch.view import TextDisplay

    seen: dict = {}

    class Recording(TextDisplay):
        def rank_phase(self, rank, phase):
            super().rank_phase(rank, phase)
            seen.setdefault(rank, []).append(phase)

        def tick(self, force=False):
            super().tick(force)
            for i, r in enumerate(self.state.ranks):
                seen.setdefault(("rows", i), set()).add(r.detail().split(" 0 s")[0].split(" 1 s")[0])

    monkeypatch.setattr(session_mod, "make_display", lambda kind, show_after=0.0: Recording(show_status=False))
    notebook_launcher(time.sleep, (1.5,), num_processes=2, start_method="spawn", display="none")
    for rank in (0, 1):
        assert seen[rank] == ["importing torch", "joining the process group", "in fn"], seen
        assert "running \u00b7 in fn" in seen[("rows", rank)], seen[("rows", rank)]
    assert seen[("rows", 0)] & {"running \u00b7 importing torch", "running \u00b7 joining the process group"}


def test_the_final_view_keeps_peak_memory_and_the_last_lines_of_output():
    from nblaunch.system.resources import Usage
    from nblaunch.view import WidgetDisplay

    view = WidgetDisplay(show=False)
    view.begin(2, "fork", "gloo", "/tmp/x")
    view.show()
    for rank in (0, 1):
        view.rank_status(rank, "running")
    view.resources({0: Usage(50.0, 900 << 20, False), 1: Usage(50.0, 700 << 20, False)})
    view.resources({0: Usage(50.0, 600 << 20, False), 1: Usage(50.0, 1500 << 20, False, gpu=(1, 3 << 30, 8 << 30, 90))})
    view.rank_lines(0, [f"epoch {i}" for i in range(30)])
    for rank in (0, 1):
        view.rank_status(rank, "finished")
    view.close("finished")
    text = view.static_text()
    assert "rank 0 finished \u00b7 peak mem 900 MiB" in text
    assert "rank 1 finished \u00b7 peak mem 1.5 GiB gpu1 3.0 GiB" in text
    assert "last 20 lines of output:" in text and "[rank 0] epoch 29" in text and "[rank 0] epoch 9\n" not in text
    assert "peak&#160;mem&#160;900&#160;MiB" in view.static_html()  # the saved notebook keeps it too
