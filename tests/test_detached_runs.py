"""Detached runs (issue 38): ``submit(..., detach=True)`` hands the run to a
supervisor in a session of its own; the run survives its kernel being
killed with its whole process group, another kernel attaches (its view
redrawn with the history within 2 s) and collects the results, and
``forget()`` leaves nothing behind."""
from __future__ import annotations

import os
import signal
import subprocess
import time

import psutil
import pytest

import nblaunch
from conftest import wait_for_file, wait_for_pid, Kernel, wait_gone, widget_html
from nblaunch import RunStopped

pytestmark = pytest.mark.timeout(300)


def stepping(gate: str, steps: int):
    import torch.distributed as dist

    with open(f"{gate}.{os.environ['RANK']}.pid", "w") as f:
        f.write(str(os.getpid()))
    wait_for_file(gate)
    for step in nblaunch.progress(range(steps), desc="train"):
        nblaunch.log(loss=1.0 / (step + 1))
        print("step", step, flush=True)
    dist.barrier()
    return int(os.environ["RANK"]) * 10


@pytest.fixture
def runs_dir(tmp_path, monkeypatch):
    where = tmp_path / "runs"
    monkeypatch.setenv("NBLAUNCH_RUNS_DIR", str(where))
    return where


def _supervisor(run_dir) -> int:
    return int((run_dir / "supervisor.id").read_text().split(":")[0])


def test_a_detached_run_is_kept_on_disk_until_forgotten(runs_dir, tmp_path):
    gate = str(tmp_path / "gate")
    run = nblaunch.submit(stepping, args=(gate, 5), num_processes=2, display="none", detach=True)
    assert run.detached and not run.done()
    supervisor = _supervisor(run.run_dir)
    assert os.getsid(supervisor) == supervisor  # a session of its own: what ends the kernel's group misses it
    listed = {r.id: r for r in nblaunch.runs(all=True)}
    assert run.id in listed and listed[run.id].config.num_processes == 2
    # Only run.stop() stops a run: another SIGTERM (SLURM's to every process
    # of a job, the ranks' preemption notice) leaves the supervisor going.
    for rank in range(2):  # its ranks up: the supervisor has long set its handlers
        wait_for_file(f"{gate}.{rank}.pid")
    subprocess.run(["kill", "-TERM", str(supervisor)], check=True, timeout=20)
    open(gate, "w").close()
    assert run.result(timeout=120) == [0, 10]
    assert run.status == "finished" and os.path.isfile(run.result().log_files[0])
    assert "step 4" in open(run.result().log_files[0]).read()
    assert [r.status for r in nblaunch.runs(all=True) if r.id == run.id] == ["finished"]
    run.forget()
    assert not runs_dir.joinpath(run.id).exists() and run.id not in [r.id for r in nblaunch.runs(all=True)]
    assert not wait_gone([supervisor], timeout=10)


def test_stop_ends_a_detached_run_and_its_ranks(runs_dir, tmp_path):
    gate = str(tmp_path / "never")
    run = nblaunch.submit(stepping, args=(gate, 1), num_processes=2, display="none", detach=True)
    ranks = [wait_for_pid(f"{gate}.{rank}.pid") for rank in range(2)]
    run.stop()
    assert run.status == "stopped"
    with pytest.raises(RunStopped):
        run.result()
    assert not wait_gone(ranks, timeout=10)
    run.forget()
    assert not runs_dir.exists() or not list(runs_dir.iterdir())


def test_a_run_outlives_its_killed_kernel_and_another_kernel_attaches(runs_dir, tmp_path):
    gate, later = str(tmp_path / "gate"), str(tmp_path / "later")
    env = {"NBLAUNCH_RUNS_DIR": str(runs_dir)}
    code = ("import nblaunch, os, time\n"
            "def train(gate, later):\n"
            "    open(f\"{gate}.{os.environ['RANK']}.pid\", 'w').write(str(os.getpid()))\n"
            "    print('before the kernel died', flush=True)\n"
            "    while not os.path.exists(gate):\n        time.sleep(0.02)\n"
            "    for step in nblaunch.progress(range(3), desc='away'):\n"
            "        print('printed while away', step, flush=True)\n"
            "        nblaunch.log(loss=1.0 / (step + 1))\n"
            "    while not os.path.exists(later):\n        time.sleep(0.02)\n"
            "    return int(os.environ['RANK']) + 100\n"
            f"run = nblaunch.submit(train, args=({gate!r}, {later!r}), num_processes=2, detach=True)\n"
            "print('RUN', run.id)\n")
    a = Kernel(extra_env=env)
    try:
        r = a.execute(code)
        assert r.error is None, r.error
        run_id = r.stdout.split("RUN ")[1].split()[0]
        ranks = [wait_for_pid(f"{gate}.{rank}.pid") for rank in range(2)]
        supervisor = _supervisor(runs_dir / run_id)
        group = os.getpgid(a.pid)
        assert group != os.getpgid(0)
        os.killpg(group, signal.SIGKILL)  # what Jupyter does to end a kernel
        assert not wait_gone([a.pid], timeout=10)
    finally:
        a.shutdown()
    assert all(psutil.pid_exists(p) for p in ranks + [supervisor])
    open(gate, "w").close()
    while "printed while away 2" not in "".join(
            open(f) .read() for f in (runs_dir / run_id / "logs").rglob("rank*.log")):
        time.sleep(0.05)
    b = Kernel(extra_env=env)
    try:
        r = b.execute("import nblaunch, time\n"
                      "print('LISTED', [(x.id, x.status) for x in nblaunch.runs(all=True)])\n"
                      f"t0 = time.monotonic()\nrun = nblaunch.attach({run_id!r})\n"
                      "print('ATTACHED', round(time.monotonic() - t0, 3))\n")
        assert r.error is None, r.error
        assert f"LISTED [('{run_id}', 'running')]" in r.stdout
        assert float(r.stdout.split("ATTACHED ")[1].split()[0]) < 2.0
        shown = "".join(widget_html(r.outputs))
        assert "printed while away 2" in shown and "before the kernel died" in shown
        assert "away" in shown and "loss" in shown  # the progress rows and the metric history
        r = b.execute("nblaunch.runs(all=True)")  # in a notebook: a table, each run's state and progress
        [table] = [m["content"]["data"]["text/html"] for m in r.outputs if m["msg_type"] == "execute_result"]
        assert f"<td style='text-align:left'>{run_id}</td><td style='text-align:left'>running</td>" in table
        assert "away 3/3 (100%)" in table, table
        open(later, "w").close()
        r = b.execute("print('RESULT', run.result(timeout=120), run.status)\nrun.forget()\n"
                      "print('AFTER', nblaunch.runs(all=True))\n")
        assert "RESULT [100, 101] finished" in r.stdout and "AFTER []" in r.stdout, r.text
    finally:
        b.shutdown()
    assert not wait_gone(ranks + [supervisor], timeout=10)
    assert not (runs_dir / run_id).exists()


def fails():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise KeyError("missing column")
    dist.barrier()


def test_a_detached_run_s_failure_is_raised_whole_by_result(runs_dir):
    run = nblaunch.submit(fails, num_processes=2, display="none", detach=True)
    with pytest.raises(nblaunch.WorkerError, match="rank 1 raised KeyError: 'missing column'") as caught:
        run.result(timeout=120)
    assert 'raise KeyError("missing column")' in caught.value.remote_traceback
    assert run.status == "failed"
    run.forget()


def test_a_killed_supervisor_takes_its_ranks_with_it_and_says_so(runs_dir, tmp_path):
    gate = str(tmp_path / "never")
    run = nblaunch.submit(stepping, args=(gate, 1), num_processes=2, display="none", detach=True)
    ranks = [wait_for_pid(f"{gate}.{rank}.pid") for rank in range(2)]
    os.kill(_supervisor(run.run_dir), signal.SIGKILL)
    with pytest.raises(nblaunch.LaunchError, match="ended without an outcome"):
        run.result(timeout=30)
    assert not wait_gone(ranks, timeout=10)
    run.forget()


def test_stop_at_once_and_two_views_of_one_run(runs_dir, tmp_path):
    at_once = nblaunch.submit(stepping, args=(str(tmp_path / "never"), 1), num_processes=2, display="none",
                              detach=True)
    at_once.stop()  # the supervisor may not have set up its handler yet: still a stop, never a failure
    assert at_once.status == "stopped"
    at_once.forget()
    gate = str(tmp_path / "gate")
    run = nblaunch.submit(stepping, args=(gate, 5), num_processes=2, display="text", detach=True)
    again = nblaunch.attach(run.id)  # a second view of the same run, in this process
    assert again is run and len(run._views) == 2
    open(gate, "w").close()
    assert run.result(timeout=120) == [0, 10]
    deadline = time.monotonic() + 30
    while any(v.state.state != "finished" for v in run._views):  # each follower closes its own view
        assert time.monotonic() < deadline, [v.state.state for v in run._views]
        time.sleep(0.05)
    run.forget()

