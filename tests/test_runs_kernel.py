"""Background runs as a user meets them, in real kernels (issue 38): the
cell returns at once, the view keeps moving in its cell while other cells
run, an interrupted cell leaves the run alone, ``run.stop()`` ends it."""
from __future__ import annotations

import queue
import time

import psutil
import pytest

from conftest import Kernel, wait_for_pid, wait_gone

pytestmark = pytest.mark.timeout(300)

TRAIN = (
    "import nblaunch, os, time\n"
    "def train(gate, steps):\n"
    "    open(f\"{gate}.{os.environ['RANK']}.pid\", 'w').write(str(os.getpid()))\n"
    "    while not os.path.exists(gate):\n"
    "        time.sleep(0.02)\n"
    "    for step in nblaunch.progress(range(steps), desc='train'):\n"
    "        print('step', step, flush=True)\n"
    "        nblaunch.log(loss=1.0 / (step + 1))\n"
    "        time.sleep(0.05)\n"
    "    return int(os.environ['RANK'])\n"
)


def launch_processes_and_forkserver_children(pid: int) -> list[int]:
    return [p.pid for p in psutil.Process(pid).children(recursive=True)]


def all_messages_until_idle(k: Kernel, msg_id: str, timeout: float = 120) -> list:
    """Every iopub message (any cell's) until cell ``msg_id`` is idle."""
    seen = []
    deadline = time.monotonic() + timeout
    while True:
        try:
            msg = k.kc.get_iopub_msg(timeout=max(0.01, deadline - time.monotonic()))
        except queue.Empty:
            raise TimeoutError(f"cell not idle within {timeout} s") from None
        seen.append(msg)
        if (msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "status"
                and msg["content"]["execution_state"] == "idle"):
            return seen


def test_the_cell_returns_and_the_view_moves_in_its_cell_while_others_run(kernel, tmp_path):
    gate = tmp_path / "gate"
    r = kernel.execute(TRAIN + "t0 = time.monotonic()\n"
                       f"run = nblaunch.submit(train, args=({str(gate)!r}, 40), num_processes=2)\n"
                       "print('RETURNED', round(time.monotonic() - t0, 3), run.status)\n")
    assert r.error is None, r.error
    took = float(r.stdout.split("RETURNED ")[1].split()[0])
    assert took < 1.0, r.stdout
    display_ids = [m["content"]["transient"]["display_id"] for m in r.outputs if m["msg_type"] == "display_data"]
    assert len(display_ids) == 1  # the run's place in its cell
    # Another cell runs while the run trains: it opens the gate and waits for the end.
    second = kernel.execute_async(f"open({str(gate)!r}, 'w').close()\n"
                                  "while not run.done():\n    time.sleep(0.05)\n"
                                  "print('RESULT', run.result(), run.status)\n")
    msgs = all_messages_until_idle(kernel, second)
    outputs = "".join(m["content"].get("text", "") for m in msgs
                      if m["msg_type"] == "stream" and m["parent_header"].get("msg_id") == second)
    assert "RESULT [0, 1] finished" in outputs
    # The widgets' updates (keyed by their models, whichever cell ipykernel 6 names as their parent; 7
    # names the first) arrive while the second cell runs.
    updates = [m for m in msgs if m["msg_type"] == "comm_msg"]
    assert len(updates) >= 5, "the view did not move while the second cell ran"
    values = "".join(str(m["content"]["data"].get("state", {}).get("value", "")) for m in updates)
    assert "step 39" in values and "train" in values
    # The view ends as static HTML in the first cell's place, not in the second cell.
    finals = [m for m in msgs if m["msg_type"] == "update_display_data"
              and m["content"]["transient"]["display_id"] == display_ids[0]]
    assert finals and "finished" in finals[-1]["content"]["data"]["text/plain"]
    assert not [m for m in msgs if m["msg_type"] == "display_data" and m["parent_header"].get("msg_id") == second]
    # run.view(): the view again, in the cell that asks (its final state, once it ended).
    shown = kernel.execute("run.view()")
    again = [m["content"]["data"] for m in shown.outputs if m["msg_type"] == "display_data"]
    assert len(again) == 1 and "nblaunch: finished" in again[0]["text/html"]


def test_run_view_shows_the_live_view_in_another_cell(kernel, tmp_path):
    gate = tmp_path / "gate"
    r = kernel.execute(TRAIN + f"run = nblaunch.submit(train, args=({str(gate)!r}, 5), num_processes=2)\n"
                       "while run.status != 'running':\n    time.sleep(0.05)\n")
    assert r.error is None, r.error
    shown = kernel.execute("run.view()")
    live = [m["content"]["data"] for m in shown.outputs if m["msg_type"] == "display_data"]
    assert len(live) == 1 and "application/vnd.jupyter.widget-view+json" in live[0]  # the same widgets, live
    r = kernel.execute(f"open({str(gate)!r}, 'w').close()\nprint('RESULT', run.result(timeout=120))")
    assert "RESULT [0, 1]" in r.stdout, r.text


def test_interrupting_a_cell_leaves_the_run_alone_and_stop_ends_it(kernel, tmp_path):
    gate = tmp_path / "gate"
    r = kernel.execute(TRAIN + f"run = nblaunch.submit(train, args=({str(gate)!r}, 20), num_processes=2,"
                       " display='none')\n"
                       f"other = nblaunch.submit(train, args=({str(gate) + '.never'!r}, 1), num_processes=2,"
                       " display='none')\n"
                       f"pids = [f'{gate}{{x}}.{{r}}.pid' for x in ('', '.never') for r in (0, 1)]\n"
                       "while not all(os.path.exists(p) for p in pids):\n    time.sleep(0.05)\n")
    assert r.error is None, r.error
    ranks = [wait_for_pid(str(tmp_path / f"{name}.{rank}.pid")) for name in ("gate", "gate.never") for rank in (0, 1)]
    assert all(p in launch_processes_and_forkserver_children(kernel.pid) for p in ranks)
    cell = kernel.execute_async("print('SLEEPING', flush=True)\ntime.sleep(60)\n")
    kernel.wait_for_output("SLEEPING")
    kernel.km.interrupt_kernel()
    interrupted = kernel.wait_for_reply(cell)
    assert interrupted.error is not None and interrupted.error["ename"] == "KeyboardInterrupt"
    r = kernel.execute(f"open({str(gate)!r}, 'w').close()\n"
                       "print('RESULT', run.result(timeout=120), run.status, other.status)\n")
    assert "RESULT [0, 1] finished running" in r.stdout, r.text
    r = kernel.execute("other.stop()\nprint('STOPPED', other.status, [x.status for x in nblaunch.runs()])\n"
                       "try:\n    other.result()\nexcept nblaunch.RunStopped as e:\n    print('RAISED', e)\n")
    assert "STOPPED stopped ['finished', 'stopped']" in r.stdout and "RAISED run" in r.stdout, r.text
    assert not wait_gone(ranks, timeout=10)
