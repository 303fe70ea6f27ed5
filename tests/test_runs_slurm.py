"""Background and detached runs on a real SLURM allocation (issue 38): the
run's call watch (a thread of the kernel, or the supervisor) drives the
nodes' agents; a detached run's agents keep their ranks while its kernel
is killed, and another kernel collects the results. Needs ``.ci/slurm``."""
from __future__ import annotations

import os
import signal

import pytest

from conftest import Kernel, wait_gone
from test_slurm import TRAIN, _agents, _nothing_left, _ok, allocation, needs_slurm  # noqa: F401 - the fixture

pytestmark = [pytest.mark.timeout(300), pytest.mark.slurm]

EXPECTED = ("[(0, 4, 'n1', 0, 0, 4, 6.0), (1, 4, 'n1', 0, 1, 4, 6.0), (2, 4, 'n2', 1, 2, 4, 6.0), "
            "(3, 4, 'n2', 1, 3, 4, 6.0)]")


@needs_slurm
def test_a_background_run_on_the_nodes_returns_at_once(allocation, tmp_path):  # noqa: F811
    k = Kernel(extra_env={"SLURM_JOB_ID": allocation, "NBLAUNCH_RUNS_DIR": str(tmp_path / "runs")})
    try:
        _ok(k.execute(TRAIN))
        text = _ok(k.execute("import time\nt0 = time.monotonic()\n"
                             "run = nblaunch.submit(where, num_processes=2, cluster='slurm', num_nodes=2, "
                             "display='none')\nprint('RETURNED', round(time.monotonic() - t0, 3))\n"
                             "print('RESULT', list(run.result(timeout=120)), run.status)"))
        assert float(text.split("RETURNED ")[1].split()[0]) < 1.0
        assert f"RESULT {EXPECTED} finished" in text
    finally:
        k.shutdown()
    _nothing_left(allocation)


@needs_slurm
def test_a_detached_run_on_the_nodes_outlives_its_kernel(allocation, tmp_path):  # noqa: F811
    env = {"SLURM_JOB_ID": allocation, "NBLAUNCH_RUNS_DIR": str(tmp_path / "runs")}
    gate = str(tmp_path / "gate")
    a = Kernel(extra_env=env)
    try:
        _ok(a.execute(TRAIN + "import os, time\n"
                      "def gated(gate):\n"
                      "    while not os.path.exists(gate):\n        time.sleep(0.02)\n"
                      "    return where()\n"
                      f"run = nblaunch.submit(gated, args=({gate!r},), num_processes=2, cluster='slurm', "
                      "num_nodes=2, detach=True)\nprint('RUN', run.id)\n"
                      "while run.status != 'running':\n    time.sleep(0.05)\n"))
        run_id = a.execute("print('RUN', run.id)").stdout.split("RUN ")[1].split()[0]
        os.killpg(os.getpgid(a.pid), signal.SIGKILL)
        assert not wait_gone([a.pid], timeout=10)
    finally:
        a.shutdown()
    assert _agents(allocation)  # the agents and their ranks wait at the gate while no kernel is there
    open(gate, "w").close()
    b = Kernel(extra_env=env)
    try:
        text = _ok(b.execute(f"import nblaunch\nrun = nblaunch.attach({run_id!r})\n"
                             "print('RESULT', list(run.result(timeout=120)), run.status)\nrun.forget()\n"))
        assert f"RESULT {EXPECTED} finished" in text
    finally:
        b.shutdown()
    _nothing_left(allocation)
    assert not (tmp_path / "runs" / run_id).exists()
