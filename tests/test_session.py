"""Live ranks across cells (nblaunch.start / Ranks / %nblaunch), in real kernels."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest

from conftest import matrix, rows_updates, wait_gone

pytestmark = pytest.mark.timeout(300)


def _value(r):
    """The cell's execute_result as text."""
    assert r.error is None, "\n".join(r.error.get("traceback", [])) if r.error else None
    results = [o for o in r.outputs if o["msg_type"] == "execute_result"]
    assert results, f"no value; stdout={r.stdout!r}"
    return results[-1]["content"]["data"]["text/plain"]


def _pids(kernel) -> list[int]:
    return eval(_value(kernel.execute("ranks.pids")))


SETUP = """
import os, time, torch, torch.distributed as dist
import nblaunch
ranks = nblaunch.start(2, start_method={method!r}, display="text")
def setup():
    global counter
    counter = 0
def bump():
    global counter
    counter += 1
    t = torch.tensor([float(counter)])
    dist.all_reduce(t)
    return counter, t.item(), os.getpid()
"""


@pytest.mark.parametrize("method", ["fork", *matrix("spawn", "forkserver")])
def test_state_persists_across_cells(kernel, method):
    """A counter set up once and incremented by three runs, cell by cell, in the same processes."""
    assert kernel.execute(SETUP.format(method=method), timeout=180).error is None
    pids = _pids(kernel)
    assert _value(kernel.execute("ranks.run(setup)")) == "[None, None]"
    seen = [_value(kernel.execute("ranks.run(bump)")) for _ in range(3)]
    assert seen[-1] == f"[(3, 6.0, {pids[0]}), (3, 6.0, {pids[1]})]", seen
    # A function and a class defined after start travel by value and see the rank's names.
    r = kernel.execute("class Box:\n    def __init__(self, v): self.v = v\n"
                       "def boxed(): return Box(counter * 10).v\n"
                       "ranks.run(boxed)")
    assert _value(r) == "[30, 30]"
    kernel.execute("ranks.close()")
    assert wait_gone(pids, timeout=5) == []
    assert "closed" in _value(kernel.execute("ranks.status"))


def test_the_rank_keeps_its_own_names_and_the_notebook_values_follow(kernel):
    r = kernel.execute(SETUP.format(method="fork") + """
def train():
    global model
    model.append(lr)
    return list(model)
def make():
    global model
    model = []
ranks.run(make)
lr = 0.1
ranks.run(train)
model = "a kernel-side object of the same name"
lr = 0.5
ranks.run(train)
""")
    assert _value(r) == "[[0.1, 0.5], [0.1, 0.5]]"  # the rank's model, the notebook's new lr
    r = kernel.execute("import torch\nranks.push(w=torch.arange(3.0))\n"
                       "ranks.run(lambda: float(w.sum()))")
    assert _value(r) == "[3.0, 3.0]"
    r = kernel.execute("def grow():\n    global w\n    w = w * (dist.get_rank() + 2)\n"
                       "ranks.run(grow)\n(ranks.pull('w', rank=1).tolist(), [t.tolist() for t in ranks.pull('w')])")
    assert _value(r) == "([0.0, 3.0, 6.0], [[0.0, 2.0, 4.0], [0.0, 3.0, 6.0]])"
    r = kernel.execute("ranks.pull('nothing_here', rank=0)")
    assert r.error["ename"] == "WorkerError" and "name 'nothing_here' is not defined" in r.error["evalue"]
    kernel.execute("ranks.close()")


def test_a_failure_on_one_rank_keeps_the_others_state(kernel):
    assert kernel.execute(SETUP.format(method="fork")).error is None
    kernel.execute("ranks.run(setup); ranks.run(bump)")
    pids = _pids(kernel)
    r = kernel.execute("def fail_one():\n"
                       "    if dist.get_rank() == 1:\n"
                       "        raise ValueError('rank one is unhappy')\n"
                       "    while True:\n"
                       "        time.sleep(0.01)\n"
                       "ranks.run(fail_one)")
    assert r.error["ename"] == "WorkerError"
    shown = "\n".join(r.error["traceback"])
    assert shown.startswith("WorkerError: rank 1 raised ValueError: rank one is unhappy")
    assert "raise ValueError('rank one is unhappy')" in shown
    assert "rank 0: its call was interrupted by nblaunch after the failure above (the rank is kept)" in shown
    assert "still up and keep their state" in shown
    assert _value(kernel.execute("ranks.run(bump)")) == f"[(2, 4.0, {pids[0]}), (2, 4.0, {pids[1]})]"
    kernel.execute("ranks.close()")


def test_an_interrupt_that_comes_while_a_rank_is_still_loading_the_call_is_kept(kernel):
    """Rank 1 fails at once while rank 0 is still unpickling the call (made
    slow on purpose): the interrupt that follows must not be lost, or rank 0
    would run on and the session be restarted for nothing."""
    assert kernel.execute(SETUP.format(method="fork")).error is None
    kernel.execute("ranks.run(setup); ranks.run(bump)")
    pids = _pids(kernel)
    r = kernel.execute("def _slow_on_rank_0():\n"
                       "    if os.environ['RANK'] == '0':\n"
                       "        time.sleep(0.5)\n"
                       "    return 'loaded'\n"
                       "class SlowToLoad:\n"
                       "    def __reduce__(self):\n"
                       "        return (_slow_on_rank_0, ())\n"
                       "def fail_fast(_):\n"
                       "    if dist.get_rank() == 1:\n"
                       "        raise ValueError('rank 1 fails before rank 0 has started')\n"
                       "    time.sleep(30)\n"
                       "ranks.run(fail_fast, SlowToLoad())")
    shown = "\n".join(r.error["traceback"])
    assert shown.startswith("WorkerError: rank 1 raised ValueError: rank 1 fails before rank 0 has started")
    assert "still up and keep their state" in shown, shown
    assert _value(kernel.execute("ranks.run(bump)")) == f"[(2, 4.0, {pids[0]}), (2, 4.0, {pids[1]})]"
    kernel.execute("ranks.close()")


def test_interrupt_keeps_the_ranks(kernel):
    assert kernel.execute(SETUP.format(method="fork")).error is None
    kernel.execute("ranks.run(setup); ranks.run(bump)")
    pids = _pids(kernel)
    msg = kernel.execute_async("def spin():\n"
                               "    print('spinning', flush=True)\n"
                               "    while True:\n"
                               "        sum(range(1000))\n"
                               "ranks.run(spin)")
    kernel.wait_for_output("spinning")
    t0 = time.monotonic()
    kernel.km.interrupt_kernel()
    r = kernel.wait_for_reply(msg)
    took = time.monotonic() - t0
    assert r.error["ename"] == "KeyboardInterrupt"
    shown = "\n".join(r.error["traceback"])
    assert "The ranks are idle and keep their state" in shown and "in spin" in shown
    assert took < 3.0, f"interrupt -> idle took {took:.2f} s"  # a loose bound; the bench measures it
    assert _pids(kernel) == pids
    assert _value(kernel.execute("ranks.run(bump)")) == f"[(2, 4.0, {pids[0]}), (2, 4.0, {pids[1]})]"
    kernel.execute("ranks.close()")


def test_a_killed_rank_restarts_the_session_and_says_so(kernel):
    assert kernel.execute(SETUP.format(method="fork")).error is None
    kernel.execute("ranks.run(setup); ranks.run(bump)")
    pids = _pids(kernel)
    r = kernel.execute("def die():\n"
                       "    if dist.get_rank() == 1:\n"
                       "        os.kill(os.getpid(), 9)\n"
                       "    t = torch.ones(1); dist.all_reduce(t)\n"
                       "ranks.run(die)")
    assert r.error["ename"] == "WorkerError"
    shown = "\n".join(r.error["traceback"])
    assert shown.startswith("WorkerError: rank 1 was killed by SIGKILL(-9)")
    assert "restarted its ranks" in shown and "is gone" in shown
    assert wait_gone(pids, timeout=5) == []
    new = _pids(kernel)
    assert not set(new) & set(pids)
    assert "restarted 1x" in _value(kernel.execute("ranks.status"))
    r = kernel.execute("ranks.run(bump)")  # the state is gone, and says so
    assert r.error["ename"] == "WorkerError" and "NameError" in r.error["evalue"]
    kernel.execute("ranks.run(setup)")
    assert _value(kernel.execute("ranks.run(bump)")).startswith("[(1, 2.0")
    kernel.execute("ranks.close()")
    assert wait_gone(new, timeout=5) == []


def test_a_rank_killed_between_cells_is_noticed(kernel):
    assert kernel.execute(SETUP.format(method="fork")).error is None
    pids = _pids(kernel)
    psutil.Process(pids[0]).send_signal(signal.SIGKILL)
    assert wait_gone(pids[:1]) == []
    assert _value(kernel.execute("ranks.status")).startswith("'down: rank 0 ended outside a call")
    r = kernel.execute("ranks.run(bump)")
    assert r.error["ename"] == "WorkerError" and "rank 0 was killed by SIGKILL" in r.error["evalue"]
    assert "restarted its ranks" in "\n".join(r.error["traceback"])
    kernel.execute("ranks.run(setup)")
    assert _value(kernel.execute("ranks.run(bump)")).startswith("[(1, 2.0")
    kernel.execute("ranks.close()")


def test_a_wedged_collective_restarts_the_session(kernel):
    """Rank 0 waits in an all_reduce that rank 1, failed, never joins. Either
    it cannot answer the interrupt (blocked in C), or it answers from inside
    the collective (torch's wait checks for signals) having issued one
    collective more than rank 1: both leave the group unusable, so the ranks
    are restarted rather than left half-working, and the error says why."""
    assert kernel.execute(SETUP.format(method="fork")).error is None
    pids = _pids(kernel)
    t0 = time.monotonic()
    r = kernel.execute("def wedge():\n"
                       "    if dist.get_rank() == 1:\n"
                       "        time.sleep(0.5)  # rank 0 is in the all_reduce by then\n"
                       "        raise RuntimeError('no all_reduce for you')\n"
                       "    t = torch.ones(1); dist.all_reduce(t)\n"
                       "ranks.run(wedge)")
    took = time.monotonic() - t0
    shown = "\n".join(r.error["traceback"])
    assert shown.startswith("WorkerError: rank 1 raised RuntimeError: no all_reduce for you")
    assert ("rank 0 did not stop within 5 s of being interrupted" in shown
            or "out of step (collectives issued: rank 0: 1, rank 1: 0)" in shown), shown
    assert "restarted its ranks" in shown
    assert took < 20
    assert wait_gone(pids, timeout=5) == []
    kernel.execute("ranks.run(setup)")
    assert _value(kernel.execute("ranks.run(bump)")).startswith("[(1, 2.0")
    kernel.execute("ranks.close()")


def test_timeout_interrupts_the_call_and_keeps_the_ranks(kernel):
    assert kernel.execute(SETUP.format(method="fork")).error is None
    kernel.execute("ranks.run(setup); ranks.run(bump)")
    r = kernel.execute("ranks.run(time.sleep, 60, timeout=1)")
    assert r.error["ename"] == "LaunchTimeout"
    shown = "\n".join(r.error["traceback"])
    assert "call 3 did not finish within 1 s" in shown and "keep their state" in shown
    assert _value(kernel.execute("ranks.run(bump)")).startswith("[(2, 4.0")
    kernel.execute("ranks.close()")


@pytest.mark.parametrize("end", ["killed", "restarted"])
def test_the_kernel_ending_leaves_no_rank(kernel, end):
    assert kernel.execute(SETUP.format(method="fork")).error is None
    pids = _pids(kernel)
    if end == "killed":
        os.kill(kernel.pid, signal.SIGKILL)  # the kernel alone, as the OOM killer does
    else:
        kernel.km.restart_kernel(now=True)
    assert wait_gone(pids, timeout=10) == []


@pytest.mark.parametrize("method", ["fork", *matrix("spawn")])
def test_interpreter_exit_without_close_leaves_no_rank(tmp_path, method):
    script = tmp_path / "script.py"
    script.write_text("import nblaunch\n"
                      "if __name__ == '__main__':\n"
                      f"    ranks = nblaunch.start(2, start_method={method!r}, display='none')\n"
                      "    print(' '.join(map(str, ranks.pids)), flush=True)\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    pids = [int(p) for p in out.stdout.split()]
    assert len(pids) == 2 and wait_gone(pids, timeout=10) == []


def test_one_session_at_a_time_and_notebook_launcher_beside_it(kernel):
    assert kernel.execute(SETUP.format(method="fork")).error is None
    r = kernel.execute("nblaunch.start(2)")
    assert r.error["ename"] == "LaunchError" and "already up" in r.error["evalue"]
    r = kernel.execute("nblaunch.notebook_launcher(lambda: dist.get_world_size(), num_processes=3, display='none')")
    assert _value(r) == "[3, 3, 3]"
    pids = _pids(kernel)
    r = kernel.execute("with nblaunch.start(2, display='none') as other:\n    pass")
    assert r.error is not None  # still one session
    kernel.execute("del ranks\nimport gc; gc.collect()")  # garbage collection ends the ranks
    assert wait_gone(pids, timeout=5) == []
    r = kernel.execute("with nblaunch.start(2, display='none') as other:\n"
                       "    got = other.run(lambda: dist.get_rank())\n"
                       "    inner = other.pids\n"
                       "(got, inner)")
    got, inner = eval(_value(r))
    assert got == [0, 1] and wait_gone(inner, timeout=5) == []


def test_bad_input_is_refused_before_anything_runs(kernel):
    assert kernel.execute(SETUP.format(method="fork")).error is None
    for code, needle in [("ranks.run(42)", "fn must be callable"),
                         ("ranks.run(lambda: 1, timeout=-1)", "timeout must be a positive number"),
                         ("ranks.pull('not a name')", "name must be an identifier"),
                         ("ranks.pull('x', rank=5)", "rank must be None or an int in [0, 2)"),
                         ("import threading\nranks.run(lambda: 1, lock=threading.Lock())", "cannot send the job"),
                         ("nblaunch.start(0)", "num_processes must be between 1 and")]:
        r = kernel.execute(code)
        assert r.error is not None and needle in r.error["evalue"], (code, r.error)
    kernel.execute("ranks.run(setup)")
    assert _value(kernel.execute("ranks.run(bump)")).startswith("[(1")  # the call counter moved on, nothing else
    kernel.execute("ranks.close()")


def test_each_call_has_its_own_live_view(kernel):
    assert kernel.execute(SETUP.format(method="fork").replace('display="text"', 'display="widget"')).error is None
    code = ("def epoch(n):\n"
            "    for _ in nblaunch.progress(range(n), desc='epoch'):\n"
            "        time.sleep(0.02)\n"
            "    return n\n"
            "ranks.run(epoch, {n})")
    first = kernel.execute(code.format(n=20))
    # tqdm in a live rank drives its row as in a launch (rank_env applies to live ranks too).
    second = kernel.execute(code.replace("nblaunch.progress(range(n), desc='epoch')",
                                         "tqdm(range(n), desc='epoch')").format(n=30)
                            .replace("def epoch", "from tqdm.auto import tqdm\ndef epoch"))
    for r, n in ((first, 20), (second, 30)):
        assert r.error is None
        final = rows_updates(r.outputs)[-1].rows
        assert [status for status, _, _ in final] == ["finished", "finished"]
        assert all(f"{n}/{n}" in text for _, _, text in final), final
        html = [o for o in r.outputs if o["msg_type"] == "update_display_data"]
        assert html and re.search(r"nblaunch call \d+: finished", html[-1]["content"]["data"]["text/html"])
    kernel.execute("ranks.close()")


def test_the_magic_end_to_end(kernel):
    r = kernel.execute("%load_ext nblaunch\n%nblaunch start -n 2 --display text")
    assert r.error is None and "nblaunch: up: 2 ranks" in r.stdout
    r = kernel.execute("%%nblaunch\nimport torch, torch.distributed as dist\ncount = 0\nrank")
    assert _value(r) == "[0, 1]"
    kernel.execute("step = 5")  # a notebook value the cell uses
    for i in range(1, 4):
        r = kernel.execute("%%nblaunch\ncount += step\nt = torch.tensor([float(count)])\ndist.all_reduce(t)\nt.item()")
        assert _value(r) == f"[{10.0 * i}, {10.0 * i}]"
    r = kernel.execute("%nblaunch status")
    assert "nblaunch: up: 2 ranks" in r.stdout and "4 calls" in r.stdout
    r = kernel.execute("%%nblaunch\nif rank == 0:\n    raise KeyError('k')\ncount")
    assert r.error["ename"] == "WorkerError" and "KeyError" in r.error["evalue"]
    assert _value(kernel.execute("%%nblaunch\ncount")) == "[15, 15]"
    r = kernel.execute("%nblaunch stop")
    assert "live ranks closed" in r.stdout
    r = kernel.execute("%nblaunch status")
    assert "no live ranks are up" in r.stdout
