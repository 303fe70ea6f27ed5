"""The %%nblaunch cell magic in a real kernel, under fork and forkserver."""
from __future__ import annotations

import pytest

from conftest import matrix

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("method", ["fork", *matrix("forkserver")])
def test_cell_magic_runs_the_body_on_every_rank(kernel, method):
    assert kernel.execute("%load_ext nblaunch\nimport torch\nOFFSET = 10\n"
                          "def helper(v):\n    return v * 2\n").error is None
    r = kernel.execute(
        f"%%nblaunch -n 2 --start-method {method} --display text\n"
        "import torch.distributed as dist\n"
        "t = torch.tensor([float(rank + OFFSET)])\n"
        "dist.all_reduce(t)\n"
        "print('rank', rank, 'of', world_size)\n"
        "(rank, helper(int(t.item())))\n")
    assert r.error is None, r.error
    results = [o for o in r.outputs if o["msg_type"] == "execute_result"]
    assert results and results[0]["content"]["data"]["text/plain"] == "[(0, 42), (1, 42)]"
    assert "[rank 1] rank 1 of 2" in r.stdout
    r = kernel.execute("print('OUT', _)")  # the list is the cell's value, as with any cell
    assert "OUT [(0, 42), (1, 42)]" in r.stdout


def test_cell_magic_errors_are_those_of_notebook_launcher(kernel):
    kernel.execute("%load_ext nblaunch")
    r = kernel.execute("%%nblaunch -n 2 --display text\n"
                       "if rank == 1:\n"
                       "    raise ValueError(f'bad rank {rank}')\n"
                       "rank\n")
    assert r.error is not None and r.error["ename"] == "WorkerError"
    shown = "\n".join(r.error["traceback"])
    assert shown.startswith("WorkerError: rank 1 raised ValueError: bad rank 1")
    assert "raise ValueError(f'bad rank {rank}')" in shown  # the cell's own source line


def test_cell_magic_in_the_background_returns_the_run_at_once(kernel, tmp_path):
    gate = tmp_path / "gate"
    assert kernel.execute(f"%load_ext nblaunch\nimport os, time\nGATE = {str(gate)!r}\nSCALE = 3\n").error is None
    r = kernel.execute("%%nblaunch -n 2 --background --display text\n"
                       "while not os.path.exists(GATE):\n"
                       "    time.sleep(0.02)\n"
                       "rank * SCALE\n")
    assert r.error is None, r.error
    shown = [o for o in r.outputs if o["msg_type"] == "execute_result"][0]["content"]["data"]["text/plain"]
    assert shown.startswith("<nblaunch.Run ") and "2 ranks" in shown
    r = kernel.execute("run = _\nopen(GATE, 'w').close()\nprint('RESULT', run.result(timeout=120), run.status)")
    assert "RESULT [0, 3] finished" in r.stdout, r.text
    r = kernel.execute("%%nblaunch -n 2 --detach --display none\nrank + SCALE\n")
    assert r.error is None, r.error
    r = kernel.execute("run = _\nprint('RESULT', run.result(timeout=120), run.detached)\nrun.forget()")
    assert "RESULT [3, 4] True" in r.stdout, r.text
