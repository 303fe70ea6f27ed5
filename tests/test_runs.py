"""Background runs (issue 38), in this process: ``nblaunch.submit`` returns
at once, runs train side by side, ``run.stop()`` cleans up, ``cpus=`` and
``devices=`` split the machine. Through a real kernel: tests/test_runs_kernel.py."""
from __future__ import annotations

import os
import time

import psutil
import pytest

import nblaunch
from conftest import wait_for_file, wait_gone
from nblaunch import RunStopped, WorkerError

pytestmark = pytest.mark.timeout(240)


def gated(gate: str):
    """Each rank waits until ``gate`` exists, then returns what it ran on."""
    import torch.distributed as dist

    wait_for_file(gate)
    dist.barrier()
    return [dist.get_rank(), os.environ["MASTER_PORT"], os.getpgid(0)]


def meet(mine: str, theirs: str):
    """A rank of one run says it is up, then waits for the other run's ranks:
    it can only return if both runs train at the same time."""
    open(f"{mine}.{os.environ['RANK']}", "w").close()
    for rank in range(2):
        wait_for_file(f"{theirs}.{rank}")
    return os.environ["RANK"]


def forever(pid_file: str):
    """Starts a child of its own, says who runs, and never returns."""
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with open(f"{pid_file}.{os.environ['RANK']}", "w") as f:
        f.write(f"{os.getpid()} {child.pid}")
    while True:
        time.sleep(0.05)


def fails():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise KeyError("missing column")
    dist.barrier()


def pinned():
    import torch

    return [sorted(os.sched_getaffinity(0)), torch.get_num_threads(), os.environ.get("CUDA_VISIBLE_DEVICES")]


def test_submit_returns_at_once_and_the_result_comes_later(tmp_path):
    gate = str(tmp_path / "gate")
    t0 = time.monotonic()
    run = nblaunch.submit(gated, args=(gate,), num_processes=2, display="none")
    took = time.monotonic() - t0
    assert took < 1.0, f"submit took {took:.2f} s"
    assert not run.done() and run.status in ("starting", "running")
    assert run in nblaunch.runs()
    with pytest.raises(TimeoutError):
        run.result(timeout=0.5)
    open(gate, "w").close()
    results = run.result(timeout=120)
    assert [r[0] for r in results] == [0, 1]
    assert run.done() and run.status == "finished" and run.exception() is None
    assert os.path.isdir(run.log_dir) and results.log_dir == run.log_dir
    run.forget()
    assert run not in nblaunch.runs()


def test_two_runs_train_side_by_side_with_their_own_ports_and_groups(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    run_a = nblaunch.submit(meet, args=(a, b), num_processes=2, display="none")
    run_b = nblaunch.submit(meet, args=(b, a), num_processes=2, display="none")
    assert run_a.result(timeout=120) == ["0", "1"] and run_b.result(timeout=120) == ["0", "1"]
    gate = str(tmp_path / "open")
    open(gate, "w").close()
    one = nblaunch.submit(gated, args=(gate,), num_processes=2, display="none")
    two = nblaunch.submit(gated, args=(gate,), num_processes=2, display="none")
    first, second = one.result(timeout=120), two.result(timeout=120)
    assert first[0][1] != second[0][1]  # each run's own store port
    assert not {r[2] for r in first} & {r[2] for r in second}  # no process group shared between runs
    for run in (run_a, run_b, one, two):
        run.forget()


def test_a_foreground_launch_while_a_run_trains_starts_from_the_forkserver(tmp_path, capsys):
    gate = str(tmp_path / "gate")
    run = nblaunch.submit(gated, args=(gate,), num_processes=2, display="none")
    with pytest.raises(ValueError, match="'fork' cannot be used while other runs are in flight"):
        nblaunch.notebook_launcher(gated, args=(gate,), num_processes=2, start_method="fork")
    open(gate, "w").close()
    out = nblaunch.notebook_launcher(gated, args=(gate,), num_processes=2, display="text")
    assert [r[0] for r in out] == [0, 1]
    assert "forkserver" in capsys.readouterr().out
    assert [r[0] for r in run.result(timeout=120)] == [0, 1]
    run.forget()
    nblaunch.notebook_launcher(gated, args=(gate,), num_processes=2, display="text")
    assert "(fork, gloo)" in capsys.readouterr().out  # alone again: forked by the zygote


def test_stop_ends_every_rank_and_what_it_started(tmp_path):
    pid_file = str(tmp_path / "pids")
    run = nblaunch.submit(forever, args=(pid_file,), num_processes=2, display="none")
    for rank in range(2):
        wait_for_file(f"{pid_file}.{rank}")
    pids = [int(p) for rank in range(2) for p in open(f"{pid_file}.{rank}").read().split()]
    assert all(psutil.pid_exists(p) for p in pids)
    run.stop()
    assert run.done() and run.status == "stopped"
    with pytest.raises(RunStopped, match="was stopped") as stopped:
        run.result()
    assert "in forever" in str(stopped.value)  # where each rank was when stopped
    view = run._views[-1] if run._views else None
    assert view is None or view.state.state == "stopped"
    assert not wait_gone(pids, timeout=10)
    run.stop()  # twice is fine
    run.forget()


def test_a_failing_run_raises_the_rank_error_from_result():
    run = nblaunch.submit(fails, num_processes=2, display="none")
    with pytest.raises(WorkerError, match="rank 1 raised KeyError: 'missing column'"):
        run.result(timeout=120)
    assert run.status == "failed" and isinstance(run.exception(), WorkerError)
    seen = []
    run.add_done_callback(seen.append)
    assert seen == [run]
    run.forget()


def test_bad_options_are_refused_before_any_process_starts():
    before = psutil.Process().children(recursive=True)
    with pytest.raises(ValueError, match="cannot be used for a background run"):
        nblaunch.submit(pinned, num_processes=1, start_method="fork")
    with pytest.raises(ValueError, match=r"cpus \[100000\] not on this machine"):
        nblaunch.submit(pinned, num_processes=1, cpus=[100000])
    with pytest.raises(ValueError, match="each once"):
        nblaunch.submit(pinned, num_processes=1, cpus=[0, 0])
    with pytest.raises(TypeError, match="cpus must be a list of ints"):
        nblaunch.submit(pinned, num_processes=1, cpus="0-3")
    with pytest.raises(TypeError, match="cannot send the job"):
        lock = __import__("threading").Lock()
        nblaunch.submit(lambda: lock, num_processes=1)
    assert psutil.Process().children(recursive=True) == before
    assert nblaunch.runs() == []


def test_cpus_pin_every_rank_and_split_its_threads():
    cpus = sorted(os.sched_getaffinity(0))[:1]
    run = nblaunch.submit(pinned, num_processes=2, cpus=cpus, display="none")
    assert run.result(timeout=120) == [[cpus, 1, None], [cpus, 1, None]]
    run.forget()


def test_devices_are_the_run_s_own_and_overlaps_are_refused(monkeypatch, tmp_path):
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)  # CUDA faked: only its count is read here
    gate = str(tmp_path / "gate")
    run = nblaunch.submit(gated, args=(gate,), num_processes=2, devices=[2, 3], display="none",
                          backend="gloo")
    with pytest.raises(ValueError, match=r"devices \[3\] are used by run " + run.id):
        nblaunch.submit(pinned, num_processes=1, devices=[0, 3])
    with pytest.raises(ValueError, match=r"devices \[7\] not on this machine \(it has devices 0-3\)"):
        nblaunch.submit(pinned, num_processes=1, devices=[7])
    other = nblaunch.submit(pinned, num_processes=1, devices=[0, 1], display="none", backend="gloo")
    assert other.result(timeout=120)[0][2] == "0,1"
    open(gate, "w").close()
    run.result(timeout=120)
    again = nblaunch.submit(pinned, num_processes=1, devices=[3], display="none", backend="gloo")
    assert again.result(timeout=120)[0][2] == "3"
    for r in (run, other, again):
        r.forget()


def on_gpu():
    import torch
    import torch.distributed as dist

    return [torch.cuda.device_count(), os.environ["CUDA_VISIBLE_DEVICES"], dist.get_backend(),
            torch.cuda.get_device_name(0)]


@pytest.mark.skipif(__import__("torch").cuda.device_count() == 0, reason="needs a GPU")
def test_devices_on_a_real_gpu_are_the_run_s_only():
    import torch

    last = torch.cuda.device_count() - 1
    run = nblaunch.submit(on_gpu, num_processes=1, devices=[last], display="none")
    seen = run.result(timeout=180)[0]
    assert seen[:3] == [1, str(last), "nccl"]  # one GPU visible: the one asked for
    run.forget()


def fails_first_time():
    if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
        raise RuntimeError("first try")
    return int(os.environ["TORCHELASTIC_RESTART_COUNT"])


def test_timeouts_and_restarts_work_as_in_a_launch():
    napping = nblaunch.submit(time.sleep, args=(60,), num_processes=2, timeout=2, display="none")
    restarted = nblaunch.submit(fails_first_time, num_processes=2, max_restarts=1, display="none")
    assert restarted.result(timeout=120) == [1, 1] and restarted.status == "finished"
    with pytest.raises(nblaunch.LaunchTimeout, match="did not finish within 2 s"):
        napping.result(timeout=120)
    assert napping.status == "timed out"
    for run in (napping, restarted):
        run.forget()


def breaks_then_fails():
    import torch.distributed as dist

    secret = 40 + dist.get_rank()
    breakpoint()  # no cell waits on a background run: passed over, with one notice
    if dist.get_rank() == 1:
        raise ValueError(secret)
    return secret


def test_a_background_run_passes_over_breakpoints_and_keeps_the_failed_ranks_frames(capsys):
    run = nblaunch.submit(breaks_then_fails, num_processes=2, display="text")
    with pytest.raises(WorkerError) as caught:
        run.result(timeout=120)
    assert "no cell to ask in" in capsys.readouterr().out
    tb = caught.value.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    assert tb.tb_frame.f_code.co_name == "breaks_then_fails" and tb.tb_frame.f_locals["secret"] == 41
    run.forget()


def test_a_run_folder_written_before_the_house_moved_is_listed_attached_and_forgotten(tmp_path, monkeypatch):
    """Run folders as nblaunch wrote them before issue 50 (plain dicts, the
    errors pickled whole): still listed with their status, attached with
    their results or error, and forgotten. No process is started."""
    import pickle

    import cloudpickle

    from nblaunch.config import LaunchConfig
    from nblaunch.errors import RankFailure

    monkeypatch.setenv("NBLAUNCH_RUNS_DIR", str(tmp_path))
    config = LaunchConfig(2, background=True, display="none")
    failure = RankFailure(rank=1, kind="exception", time=1.0, exc_type="ValueError", message="boom")
    old = {"1205-101010-1-aaaa": {"status": "finished", "results": [1, 2], "log_dir": "/logs/a", "log_files": []},
           "1205-101011-2-bbbb": {"status": "failed", "error": WorkerError([failure], log_dir="/logs/b"),
                                  "error_text": "WorkerError: rank 1 failed"},
           "1205-101012-3-cccc": {"status": "stopped", "error_text": "run.stop() stopped every rank"}}
    for run_id, outcome in old.items():
        folder = tmp_path / run_id
        folder.mkdir(mode=0o700)
        (folder / "run.pkl").write_bytes(pickle.dumps({"config": config, "submitted": 1.0}))
        (folder / "supervisor.id").write_text("1:1")  # long gone
        (folder / "outcome.pkl").write_bytes(cloudpickle.dumps({**outcome, "ended": 2.0}))
    listed = {r.id: r.status for r in nblaunch.runs(all=True)}
    assert listed == {"1205-101010-1-aaaa": "finished", "1205-101011-2-bbbb": "failed",
                      "1205-101012-3-cccc": "stopped"}
    assert nblaunch.attach("1205-101010-1-aaaa").result() == [1, 2]
    with pytest.raises(WorkerError, match="boom"):
        nblaunch.attach("1205-101011-2-bbbb").result()
    with pytest.raises(RunStopped, match="run 1205-101012-3-cccc was stopped"):
        nblaunch.attach("1205-101012-3-cccc").result()
    for run_id in old:
        nblaunch.attach(run_id).forget()
    assert os.listdir(tmp_path) == [] and nblaunch.runs(all=True) == []
