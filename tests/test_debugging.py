"""Debugging a rank from the notebook: ``breakpoint()``, ``pdb.set_trace()``
and ``torch.distributed.breakpoint()`` in a rank, answered through Jupyter's
stdin channel (a real kernel, driven by jupyter_client with
``allow_stdin=True`` as JupyterLab does), and ``%debug`` / ``nblaunch.debug()``
after a failure."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

from conftest import Kernel, launch_processes, matrix, rows_updates, wait_gone

ANSI = re.compile(r"\x1b\[[0-9;]*m")

LAUNCH = ("from nblaunch import notebook_launcher\n"
          "import time, pdb, torch, torch.distributed as dist\n")


class Session:
    """A cell run with stdin: each ``input_request`` is answered by the next
    of ``answers`` (a string, or a callable of the prompt)."""

    def __init__(self, kernel: Kernel, answers):
        self.kernel = kernel
        self.answers = list(answers)
        self.prompts: list[tuple[float, str]] = []  # (when, prompt)
        self.stdout = ""
        self.error = None
        self.outputs: list = []

    def _stdin(self, msg):
        prompt = msg["content"]["prompt"]
        self.prompts.append((time.time(), prompt))
        answer = self.answers.pop(0) if self.answers else "c"
        self.kernel.kc.input(answer(prompt) if callable(answer) else answer)

    def _output(self, msg):
        self.outputs.append(msg)
        if msg["msg_type"] == "stream":
            self.stdout += ANSI.sub("", msg["content"]["text"])
        elif msg["msg_type"] == "error":
            self.error = msg["content"]

    def run(self, code: str, timeout: float = 120, allow_stdin: bool = True) -> "Session":
        self.kernel.kc.execute_interactive(code, allow_stdin=allow_stdin, stdin_hook=self._stdin,
                                           output_hook=self._output, timeout=timeout)
        return self

    @property
    def prompt_texts(self) -> list[str]:
        return [p for _, p in self.prompts]

    @property
    def shown(self) -> str:
        return self.stdout + ("\n".join(ANSI.sub("", line) for line in self.error["traceback"]) if self.error else "")


@pytest.mark.parametrize("method", ["fork", *matrix("spawn")])
def test_breakpoint_in_a_rank_opens_pdb_in_the_cell(kernel, method):
    answers = ["p secret", "pp {'s': secret}", "l", "n", "p y", "s", "s", "p v", "up", "p y", "down", "p v * 3", "c"]
    s = Session(kernel, answers).run(
        LAUNCH +
        "def helper(v):\n"
        "    return v * 2\n"
        "def train():\n"
        "    secret = 40 + dist.get_rank()\n"
        "    if dist.get_rank() == 1:\n"
        "        print('BREAK AT', time.time(), flush=True)\n"
        "        breakpoint()\n"
        "    y = secret + 1\n"
        "    z = helper(y)\n"
        "    dist.all_reduce(torch.ones(1))\n"
        "    return z\n"
        f"print('RESULT', notebook_launcher(train, num_processes=2, display='text', start_method={method!r}))\n")
    assert s.error is None, s.shown
    assert "RESULT [82, 84]" in s.stdout
    assert len(s.prompts) == len(answers), s.prompts
    assert all(re.fullmatch(r"rank 1 (\(Pdb\)|ipdb>) ", p) for p in s.prompt_texts), s.prompts
    assert "--- rank 1 is in the debugger" in s.stdout
    broke_at = float(re.search(r"BREAK AT ([\d.]+)", s.stdout).group(1))
    assert s.prompts[0][0] - broke_at < 1.0, "the prompt took over 1 s to reach the cell"
    after = s.stdout.split("--- rank 1 is in the debugger")[1]
    # p and pp in the rank's locals; l lists the rank's source; n to the next line
    assert re.search(r"^41$", after, re.M) and "{'s': 41}" in after
    assert "->" in after and "y = secret + 1" in after and "z = helper(y)" in after
    # s steps into helper (v == 42); up to train (y == 42), down again (v * 3)
    assert re.search(r"^42$\n(.|\n)*^42$", after, re.M) and "helper()" in after
    assert re.search(r"^126$", after, re.M)


def test_two_ranks_that_break_at_once_are_served_one_after_the_other(kernel):
    s = Session(kernel, ["p dist.get_rank()", "c", "p dist.get_rank()", "c"]).run(
        LAUNCH +
        "def train():\n"
        "    breakpoint()\n"
        "    dist.all_reduce(torch.ones(1))\n"
        "    return dist.get_rank()\n"
        "print('RESULT', notebook_launcher(train, num_processes=2, display='text'))\n")
    assert s.error is None, s.shown
    assert "RESULT [0, 1]" in s.stdout
    first, second = s.prompt_texts[0].split()[:2], s.prompt_texts[2].split()[:2]
    assert first != second and {first[1], second[1]} == {"0", "1"}
    assert s.prompt_texts[1].startswith(" ".join(first)) and s.prompt_texts[3].startswith(" ".join(second))
    # each session printed its own rank, in the order served
    printed = re.findall(r"^([01])$", s.stdout, re.M)
    assert printed == [first[1], second[1]], s.stdout


def test_pdb_set_trace_and_torch_distributed_breakpoint(kernel):
    s = Session(kernel, ["p secret", "n", "n", "p after", "c", "p here", "c"]).run(
        LAUNCH +
        "def train():\n"
        "    secret = 7 * (dist.get_rank() + 1)\n"
        "    dist.breakpoint(rank=1)\n"
        "    after = secret + 1\n"
        "    nxt = after + 1\n"
        "    dist.all_reduce(torch.ones(1))\n"
        "    here = 'set_trace'\n"
        "    if dist.get_rank() == 0:\n"
        "        pdb.set_trace()\n"
        "    return nxt\n"
        "print('RESULT', notebook_launcher(train, num_processes=2, display='text'))\n")
    assert s.error is None, s.shown
    assert "RESULT [9, 16]" in s.stdout
    texts = s.prompt_texts
    assert all(p.startswith("rank 1 ") for p in texts[:5]) and all(p.startswith("rank 0 ") for p in texts[5:]), texts
    # torch.distributed.breakpoint stops in the caller's frame, and n goes to the
    # caller's next line, past the barrier the other rank waits in
    assert re.search(r"^14$", s.stdout, re.M) and re.search(r"^15$", s.stdout, re.M)
    assert "barrier" not in s.stdout.split("RESULT")[0].lower().replace("waits in a barrier", "")
    assert re.search(r"^'set_trace'$", s.stdout, re.M)


def test_q_ends_the_debugging_and_leaves_no_rank_stuck(kernel):
    s = Session(kernel, ["q"]).run(
        LAUNCH +
        "def train():\n"
        "    for step in range(3):\n"
        "        if dist.get_rank() == 1:\n"
        "            breakpoint()  # q: no more stops in this call\n"
        "        dist.all_reduce(torch.ones(1))  # rank 0 waits here for rank 1\n"
        "    return dist.get_rank()\n"
        "print('RESULT', notebook_launcher(train, num_processes=2, display='text'))\n")
    assert s.error is None, s.shown
    assert "RESULT [0, 1]" in s.stdout and len(s.prompts) == 1
    assert "rank runs on without the debugger" in s.stdout


def test_without_stdin_a_breakpoint_says_so_once_and_the_run_goes_on(kernel):
    s = Session(kernel, []).run(
        LAUNCH +
        "def train():\n"
        "    for i in range(3):\n"
        "        breakpoint()\n"
        "    dist.all_reduce(torch.ones(1))\n"
        "    return dist.get_rank()\n"
        "print('RESULT', notebook_launcher(train, num_processes=2, display='text'))\n", allow_stdin=False)
    assert s.error is None, s.shown
    assert s.prompts == []
    assert "RESULT [0, 1]" in s.stdout
    assert s.stdout.count("no one can answer a debugger here") == 1, s.stdout


def test_a_paused_rank_holds_the_timeout_and_the_stall_warning(kernel):
    """The launch's timeout is 4 s and its stall warning 1 s; rank 1 stays
    at its prompt for 8 s while rank 0 waits in a collective."""
    def slow(prompt):
        time.sleep(8)
        return "c"
    s = Session(kernel, [slow]).run(
        LAUNCH +
        "import nblaunch\n"
        "def train():\n"
        "    for step in nblaunch.progress(range(4)):\n"
        "        if dist.get_rank() == 1 and step == 2:\n"
        "            breakpoint()\n"
        "        dist.all_reduce(torch.ones(1))\n"
        "    return dist.get_rank()\n"
        "print('RESULT', notebook_launcher(train, num_processes=2, timeout=4, stall_warning=1, display='widget'))\n")
    assert s.error is None, s.shown
    assert "RESULT [0, 1]" in s.stdout
    assert "no progress" not in s.shown
    statuses = [row[0] for update in rows_updates(s.outputs) for row in update.rows]
    assert "paused: in the debugger" in statuses
    assert "waiting: rank 1 is in the debugger" in statuses


def test_the_stop_button_at_a_prompt_stops_the_launch_cleanly(kernel):
    interrupted = []

    def stop(prompt):
        interrupted.append(prompt)
        kernel.km.interrupt_kernel()
        return "p 1"  # may never be read: the kernel was interrupted at its input()
    s = Session(kernel, [stop]).run(
        LAUNCH +
        "def train():\n"
        "    if dist.get_rank() == 0:\n"
        "        breakpoint()\n"
        "    dist.all_reduce(torch.ones(1))\n"
        "notebook_launcher(train, num_processes=2, display='text')\n")
    assert interrupted and s.error is not None and s.error["ename"] == "KeyboardInterrupt", s.shown
    assert "every rank was stopped" in s.shown
    assert wait_gone(launch_processes(kernel.pid), timeout=5.0) == []
    s = Session(kernel, []).run(LAUNCH + "print('AGAIN', notebook_launcher(lambda: 5, num_processes=2, display='none'))\n")
    assert "AGAIN [5, 5]" in s.stdout


FAILING = (LAUNCH +
           "class Batch:\n"
           "    def __init__(self, n): self.n = n\n"
           "def helper(v):\n"
           "    local_in_helper = v * 2\n"
           "    batch = Batch(v)\n"
           "    big = torch.zeros(4 << 20)\n"
           "    raise ValueError(f'bad {v}')\n"
           "def train():\n"
           "    secret = 40 + dist.get_rank()\n"
           "    if dist.get_rank() == 1:\n"
           "        helper(secret)\n"
           "    dist.all_reduce(torch.ones(1))\n")


@pytest.mark.parametrize("method", ["fork", *matrix("spawn")])
def test_percent_debug_opens_the_failed_ranks_frames(kernel, method):
    s = Session(kernel, []).run(FAILING + f"notebook_launcher(train, num_processes=2, display='text', start_method={method!r})\n")
    assert s.error["ename"] == "WorkerError"
    s = Session(kernel, ["p local_in_helper", "p batch.n", "p big", "up", "p secret", "l", "q"]).run("%debug\n")
    assert s.error is None, s.shown
    assert re.search(r"^82$", s.stdout, re.M) and re.search(r"^41$", s.stdout, re.M)
    assert "raise ValueError(f'bad {v}')" in s.stdout and "helper(secret)" in s.stdout
    assert "tensor([0., 0., 0.,  ..., 0., 0., 0.])" in s.stdout  # 16 MB of tensor: shown as its repr
    assert "watch.py" not in s.stdout


def test_nblaunch_debug_opens_any_failed_rank_and_live_ranks_too(kernel):
    s = Session(kernel, []).run(
        FAILING + "import nblaunch\n"
        "ranks = nblaunch.start(num_processes=2, display='none')\n"
        "try:\n"
        "    ranks.run(train)\n"
        "except nblaunch.WorkerError as e:\n"
        "    err = e\n"
        "print('FAILED', err.rank)\n")
    assert "FAILED 1" in s.stdout, s.shown
    s = Session(kernel, ["p local_in_helper", "q"]).run("nblaunch.debug(err)\nranks.close()\n")
    assert s.error is None, s.shown
    assert re.search(r"^82$", s.stdout, re.M)
    s = Session(kernel, []).run("nblaunch.debug(err, rank=0)\n")  # interrupted by nblaunch: no frames of its own
    assert s.error["ename"] == "ValueError" and "no Python frames to debug" in s.shown
    s = Session(kernel, []).run("nblaunch.debug(err, rank=5)\n")
    assert s.error["ename"] == "ValueError" and "rank 5 did not fail" in s.shown


BREAKS_ON_1 = ("def train():\n"
               "    secret = 40 + dist.get_rank()\n"
               "    if dist.get_rank() == 1:\n"
               "        breakpoint()\n"
               "    dist.all_reduce(torch.ones(1))\n"
               "    return secret\n")
SCRIPT = (LAUNCH + BREAKS_ON_1 +
          "if __name__ == '__main__':\n"
          "    print('RESULT', notebook_launcher(train, num_processes=2, display='text'))\n")


def test_in_a_terminal_pdb_works_on_the_terminal(tmp_path):
    pexpect = pytest.importorskip("pexpect")
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    child = pexpect.spawn(sys.executable, [str(script)], encoding="utf-8", timeout=60, env=_env())
    try:
        child.expect(r"rank 1 \(Pdb\) ")
        child.sendline("p secret")
        child.expect(r"\r\n41\r\n")
        child.expect(r"rank 1 \(Pdb\) ")
        child.sendline("c")
        child.expect(r"RESULT \[40, 41\]")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0


def test_a_script_without_a_terminal_passes_over_breakpoints(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    # stdin an open pipe that no one writes to: input() there would wait forever
    proc = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=_env())
    try:
        out, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
        proc.stdin.close()
    assert proc.returncode == 0, out
    assert "RESULT [40, 41]" in out
    assert out.count("no one can answer a debugger here") == 1, out


def _env() -> dict:
    env = dict(os.environ)
    env.pop("PYTEST_CURRENT_TEST", None)
    return env


def test_live_ranks_debug_a_call_and_serve_the_next(kernel):
    s = Session(kernel, ["p state", "c", "q"]).run(
        LAUNCH + "import nblaunch\n"
        "ranks = nblaunch.start(num_processes=2, display='text')\n"
        "def setup():\n"
        "    global state\n"
        "    state = 100 + dist.get_rank()\n"
        "ranks.run(setup)\n"
        "def look():\n"
        "    if dist.get_rank() == 1:\n"
        "        breakpoint()\n"
        "    dist.all_reduce(torch.ones(1))\n"
        "    return state\n"
        "print('FIRST', ranks.run(look))\n"
        "print('QUIT', ranks.run(look))\n"
        "print('AFTER', ranks.run(lambda: state), ranks.status.split(':')[0])\n"
        "ranks.close()\n")
    assert s.error is None, s.shown
    assert "FIRST [100, 101]" in s.stdout and re.search(r"^101$", s.stdout, re.M)
    assert "QUIT [100, 101]" in s.stdout  # q left the debugger; rank 0, in a collective, was not left there
    assert "AFTER [100, 101] up" in s.stdout, s.stdout


@pytest.mark.browser
def test_in_jupyterlab_the_prompt_is_the_cells_input_box(tmp_path):
    """As a person does it: JupyterLab in Chromium, the rank's prompt in the
    cell's stdin box, the commands typed there, the rows saying who waits."""
    import nbformat
    from test_browser import _artifacts, _read, _serve

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(
        LAUNCH + BREAKS_ON_1 + "print('results:', notebook_launcher(train, num_processes=2))\n")]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, tmp_path / "debug.ipynb")
    with _serve(tmp_path, "jupyterlab") as open_notebook:
        page = open_notebook("debug.ipynb")
        page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }")
        box = page.wait_for_selector(".jp-Stdin-input", timeout=90_000)
        assert "rank 1" in page.inner_text(".jp-Stdin-prompt")
        deadline = time.monotonic() + 30
        while [s for s, _ in _read(page)["bars"]] != ["waiting: rank 1 is in the debugger", "paused: in the debugger"]:
            assert time.monotonic() < deadline, _read(page)
            page.wait_for_timeout(100)
        page.screenshot(path=str(_artifacts() / "jupyterlab-rank-in-the-debugger.png"))
        box.fill("p secret")
        box.press("Enter")
        page.wait_for_function("() => /\\n41\\n/.test(document.querySelector('.jp-OutputArea').innerText)",
                               timeout=30_000)
        # the answered box turns into text; the next prompt is a new, empty box
        page.wait_for_function("() => { const boxes = document.querySelectorAll('.jp-Stdin-input');"
                               " return boxes.length === 1 && boxes[0].value === ''; }", timeout=30_000)
        page.locator(".jp-Stdin-input").fill("c")
        page.locator(".jp-Stdin-input").press("Enter")
        page.wait_for_selector("text=results: [40, 41]", timeout=60_000)
        page.screenshot(path=str(_artifacts() / "jupyterlab-rank-debugged.png"))
