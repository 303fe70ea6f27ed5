"""A long run on this machine: a rank killed as the OOM killer would (SIGKILL)
restarts the generation and fn resumes from its torch.distributed.checkpoint
(DCP) checkpoint; a preemption (SIGTERM to the kernel) gives every
rank nblaunch.preempted() and a grace to save and return. Driven from this
(pytest) process, with real rank processes."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

import nblaunch
from nblaunch import Slurm
from nblaunch.config import LaunchConfig
from nblaunch.errors import Preempted, WorkerError

STEPS = 12


# --- functions run on the ranks (module level, so spawn can import them too) ---

def train_with_dcp(folder: str, kill_rank: int, kill_at: int, every: int = 2):
    """A training loop that saves a DCP checkpoint every ``every`` steps and
    resumes from the latest one; rank ``kill_rank`` SIGKILLs itself at step
    ``kill_at`` in the first generation (the OOM killer's way)."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    state = {"w": torch.zeros(4), "step": torch.tensor(0)}
    latest = os.path.join(folder, "latest")
    if os.path.exists(latest):
        with open(latest) as f:
            dcp.load(state, checkpoint_id=os.path.join(folder, f.read().strip()))
    start = int(state["step"])
    bar = nblaunch.progress(total=STEPS, desc="train")
    bar.update(start)
    for step in range(start, STEPS):
        if restart == 0 and dist.get_rank() == kill_rank and step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        g = torch.ones(4)
        dist.all_reduce(g)
        state["w"] += g
        state["step"] = torch.tensor(step + 1)
        bar.update(1)
        if restart == 0:
            time.sleep(0.3)  # the bar's report reaches the kernel before the next step
        if (step + 1) % every == 0:
            name = f"step{step + 1}"
            dcp.save(state, checkpoint_id=os.path.join(folder, name))
            dist.barrier()
            if dist.get_rank() == 0:
                with open(latest + ".tmp", "w") as f:
                    f.write(name)
                os.replace(latest + ".tmp", latest)
            dist.barrier()
    bar.close()
    return {"restart": restart, "resumed_at": start, "w": state["w"][0].item(),
            "world": int(os.environ["WORLD_SIZE"]), "rank": int(os.environ["RANK"])}


def always_killed():
    import torch.distributed as dist

    bar = nblaunch.progress(total=10, desc="train")
    bar.update(3)
    time.sleep(0.3)  # the bar's report reaches the kernel first
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()
    return "not reached"


def raise_on_rank1():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("bad batch")
    dist.barrier()
    return dist.get_rank()


def save_when_preempted(folder: str):
    """Steps until preempted (agreed by every rank), then a DCP save, then return."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    state = {"w": torch.zeros(2)}
    open(os.path.join(folder, f"up{dist.get_rank()}"), "w").close()
    step = 0
    while not nblaunch.preempted(agree=True):
        state["w"] += 1
        step += 1
        time.sleep(0.02)
    dcp.save(state, checkpoint_id=os.path.join(folder, "ckpt"))
    return {"step": step, "saw": nblaunch.preempted()}


def save_when_preempted_say_pid(folder: str):
    """``save_when_preempted``, each rank's pid in its file (for a SIGTERM from outside)."""
    import torch.distributed as dist

    with open(os.path.join(folder, f"pid{dist.get_rank()}"), "w") as f:
        f.write(str(os.getpid()))
    return save_when_preempted(folder)


def ignore_preemption(folder: str):
    import torch.distributed as dist

    with open(os.path.join(folder, f"pid{dist.get_rank()}"), "w") as f:
        f.write(str(os.getpid()))
    open(os.path.join(folder, f"up{dist.get_rank()}"), "w").close()
    bar = nblaunch.progress(total=10_000, desc="train")
    while True:
        bar.update(1)
        time.sleep(0.05)


# --- a generation killed by SIGKILL restarts and resumes ------------------------------


def test_a_rank_killed_by_sigkill_restarts_and_fn_resumes_from_its_dcp_checkpoint(tmp_path, capsys):
    results = nblaunch.notebook_launcher(train_with_dcp, (str(tmp_path), 1, 7), num_processes=2,
                                         max_restarts=1, display="text")
    # The second generation: TORCHELASTIC_RESTART_COUNT says so, and it
    # started from the last checkpoint before the kill (step 6), not from 0.
    assert [r["restart"] for r in results] == [1, 1]
    assert [r["resumed_at"] for r in results] == [6, 6]
    assert [r["w"] for r in results] == [2.0 * STEPS] * 2  # every step counted once, across generations
    assert results.restarts == ["restart 1 of 1: rank 1 killed by SIGKILL at step 7; 2 ranks"]
    shown = capsys.readouterr().out
    assert "restart 1 of 1: rank 1 killed by SIGKILL at step 7; 2 ranks" in shown
    assert "finished after 1 restart(s)" in shown


def test_after_the_last_attempt_the_error_lists_every_attempts_cause():
    with pytest.raises(WorkerError) as info:
        nblaunch.notebook_launcher(always_killed, num_processes=2, max_restarts=2, display="none")
    err = info.value
    assert err.rank == 1 and err.signal == signal.SIGKILL
    assert err.attempts == ("rank 1 killed by SIGKILL at step 3",) * 2
    text = str(err)
    assert "Every attempt (3, max_restarts=2):" in text
    assert "attempt 1 of 3: rank 1 killed by SIGKILL at step 3" in text
    assert "attempt 3 of 3: rank 1 killed by SIGKILL (above)" in text
    assert WorkerError.__reduce__(err)[1][3] == err.attempts


def test_without_restarts_the_error_is_as_before():
    with pytest.raises(WorkerError) as info:
        nblaunch.notebook_launcher(raise_on_rank1, num_processes=2, display="none")
    assert info.value.attempts == () and "Every attempt" not in str(info.value)
    assert str(info.value).startswith("rank 1 raised ValueError: bad batch")


# --- preemption --------------------------------------------------------------------


def _signal_when_up(folder, n: int, sig: int) -> threading.Thread:
    """SIGTERM to this process (the launching kernel) once ``n`` ranks are in fn."""
    def send():
        deadline = time.monotonic() + 120
        while len([f for f in os.listdir(folder) if f.startswith("up")]) < n and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), sig)

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("sig", [signal.SIGTERM])  # SIGUSR1: on a real kernel below
def test_a_preemption_signal_to_the_kernel_lets_every_rank_save_and_return(tmp_path, capsys, sig):
    import torch.distributed.checkpoint as dcp
    import torch

    before = signal.getsignal(sig)
    _signal_when_up(tmp_path, 2, sig)
    results = nblaunch.notebook_launcher(save_when_preempted, (str(tmp_path),), num_processes=2, display="text")
    assert all(r["saw"] for r in results)
    assert results[0]["step"] == results[1]["step"] > 0  # agreed: both saved at the same step
    state = {"w": torch.zeros(2)}
    dcp.load(state, checkpoint_id=str(tmp_path / "ckpt"))
    assert state["w"].tolist() == [float(results[0]["step"])] * 2
    assert f"preempted ({signal.Signals(sig).name} to the kernel): saving" in capsys.readouterr().out
    assert signal.getsignal(sig) == before  # the kernel's own handler is back


def test_ranks_that_do_not_return_within_the_grace_are_stopped_with_a_clear_preempted_error(tmp_path):
    _signal_when_up(tmp_path, 2, signal.SIGTERM)
    t0 = time.monotonic()
    with pytest.raises(Preempted) as info:
        nblaunch.notebook_launcher(ignore_preemption, (str(tmp_path),), num_processes=2, max_restarts=3,
                                   preempt_grace=2.0, display="none")
    elapsed = time.monotonic() - t0
    err = info.value
    assert err.signal == "SIGTERM" and err.step is not None and err.step > 0
    assert "the launch was preempted (SIGTERM to the kernel) at step" in str(err)
    assert "ranks 0, 1 did not return within the 2 s grace" in str(err)
    assert elapsed < 60  # not restarted (max_restarts=3): the job is ending


def test_the_grace_is_not_cut_short(tmp_path):
    """The ranks keep running for the whole grace after the notice."""
    _signal_when_up(tmp_path, 2, signal.SIGTERM)
    t0 = time.monotonic()
    with pytest.raises(Preempted):
        nblaunch.notebook_launcher(ignore_preemption, (str(tmp_path),), num_processes=2, preempt_grace=4.0,
                                   display="none")
    assert time.monotonic() - t0 >= 4.0


def test_sigterm_from_outside_to_every_rank_is_a_notice_not_a_stop(tmp_path, capsys):
    """What SLURM does on preemption, scancel and the time limit: SIGTERM to
    every process of the step (here the ``kill`` command, neither the kernel
    nor a rank), SIGKILL only later. The ranks take it as the notice, save
    and return."""
    import subprocess

    def kill_when_up():
        deadline = time.monotonic() + 120
        while len([f for f in os.listdir(tmp_path) if f.startswith("up")]) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        pids = [(tmp_path / f"pid{r}").read_text() for r in (0, 1)]
        subprocess.run(["kill", "-TERM", *pids], check=True, timeout=20)

    threading.Thread(target=kill_when_up, daemon=True).start()
    results = nblaunch.notebook_launcher(save_when_preempted_say_pid, (str(tmp_path),), num_processes=2,
                                         display="text")
    assert [r["saw"] for r in results] == [True, True]
    assert results[0]["step"] == results[1]["step"] > 0
    assert "preempted (SIGTERM to rank " in capsys.readouterr().out
    # nblaunch's own SIGTERM still ends a rank at once, even blocked in a
    # collective: test_launch.py::test_peers_blocked_in_a_collective_stop_on_sigterm...


def test_ranks_that_the_job_kills_before_the_grace_is_over_are_preempted_not_failed(tmp_path):
    """SLURM's SIGKILL comes KillWait after its SIGTERM, whatever the grace:
    ranks still saving are then killed, and the verdict is ``Preempted``."""
    import subprocess

    def as_slurm_does():
        deadline = time.monotonic() + 120
        while len([f for f in os.listdir(tmp_path) if f.startswith("up")]) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        pids = [(tmp_path / f"pid{r}").read_text() for r in (0, 1)]
        subprocess.run(["kill", "-TERM", *pids], check=True, timeout=20)
        time.sleep(1.0)  # KillWait
        subprocess.run(["kill", "-KILL", *pids], check=True, timeout=20)

    threading.Thread(target=as_slurm_does, daemon=True).start()
    with pytest.raises(Preempted) as info:
        nblaunch.notebook_launcher(ignore_preemption, (str(tmp_path),), num_processes=2, preempt_grace=60,
                                   display="none")
    assert "the launch was preempted (SIGTERM to rank " in str(info.value)
    assert "ranks 0, 1 were ended before the 60 s grace (preempt_grace) was over" in str(info.value)
    assert isinstance(info.value.__cause__, WorkerError)


def test_a_signal_the_kernel_handles_in_c_is_left_to_it():
    """faulthandler.register(SIGUSR1), a stack dump many set in their kernel,
    is not taken over (signal.getsignal does not see it) nor lost."""
    import faulthandler

    from nblaunch.watch.preempt import Catcher

    faulthandler.register(signal.SIGUSR1)
    try:
        catcher = Catcher(1.0)
        with catcher:
            assert signal.SIGUSR1 not in catcher._previous and signal.SIGTERM in catcher._previous
    finally:
        faulthandler.unregister(signal.SIGUSR1)


def test_preempted_is_false_outside_a_rank():
    assert nblaunch.preempted() is False


# --- the settings, checked before any process starts ---------------------------------


@pytest.mark.parametrize("kwargs, message", [
    ({"preempt_grace": -1}, "preempt_grace must be"),
    ({"preempt_grace": "30"}, "preempt_grace must be"),
    ({"min_nodes": 1, "max_restarts": 1}, "min_nodes is for a launch on several nodes"),
    ({"min_nodes": 2, "max_restarts": 1, "num_nodes": 3, "rdzv_endpoint": "127.0.0.1:29400",
      "rdzv_backend": "static", "node_rank": 0}, "min_nodes needs rdzv_backend='c10d'"),
    ({"min_nodes": 0, "max_restarts": 1, "cluster": Slurm(nodes=3)}, "between 1 and"),
    ({"min_nodes": 4, "max_restarts": 1, "cluster": Slurm(nodes=3)}, "between 1 and"),
    ({"min_nodes": 4, "max_restarts": 1, "num_nodes": 3, "cluster": Slurm()}, "between 1 and"),
    ({"min_nodes": 2.0, "max_restarts": 1, "cluster": Slurm(nodes=3)}, "must be an int"),
])
def test_bad_resilience_settings_are_refused_before_any_process_starts(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        LaunchConfig(2, **kwargs)


def test_good_resilience_settings_are_kept():
    c = LaunchConfig(2, cluster=Slurm(nodes=3), max_restarts=2, min_nodes=2, preempt_grace=0)
    assert (c.min_nodes, c.preempt_grace) == (2, 0)
    c = LaunchConfig(2, num_nodes=3, rdzv_endpoint="127.0.0.1:29400", max_restarts=1, min_nodes=2)
    assert c.min_nodes == 2  # nodes joined by the c10d rendezvous go on without a lost one too


def test_a_notice_while_the_ranks_start_is_caught_and_they_save():
    """A rank can be in ``fn`` before the kernel hears that it started: the
    notice was caught only from then on, and one that came earlier ended
    the kernel (the test below, once, under load). Here it comes right after
    the zygote's fork, before any rank is told its place."""
    script = os.path.join(os.path.dirname(__file__), "notice_at_fork.py")
    done = subprocess.run([sys.executable, script, "3"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.returncode, done.stderr[-3000:])
    launches = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert launches == [{"results": ["saved", "saved"]}] * 3, done.stderr[-3000:]


def test_sigterm_or_sigusr1_to_a_real_kernel_lets_the_ranks_save_and_the_kernel_lives_on(tmp_path):
    """What SLURM's preemption sends to the job's processes (the kernel among
    them): the ranks save and return, the cell shows it, and the kernel, its
    own SIGTERM handling restored, serves the next cell."""
    from conftest import Kernel

    k = Kernel()
    try:
        msg = k.execute_async(f"""
import os, time, nblaunch
def until_preempted(folder):
    import torch.distributed as dist
    open(os.path.join(folder, f"up{{dist.get_rank()}}"), "w").close()
    step = 0
    while not nblaunch.preempted(agree=True):
        step += 1
        time.sleep(0.02)
    return step
res = nblaunch.notebook_launcher(until_preempted, ({str(tmp_path)!r},), num_processes=2, display="text")
print("returned", len(res), res[0] == res[1])""")
        deadline = time.monotonic() + 120
        while len([f for f in os.listdir(tmp_path) if f.startswith("up")]) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(k.pid, signal.SIGTERM)
        r = k.wait_for_reply(msg, timeout=120)
        assert r.error is None, r.error
        assert "preempted (SIGTERM to the kernel): saving" in r.text and "returned 2 True" in r.text, r.text
        assert k.execute("import signal; print(signal.getsignal(signal.SIGTERM))").error is None
        # SIGUSR1 (sbatch --signal=USR1@60 on a job running Jupyter) is a
        # notice too where nothing in the kernel takes it: this test kernel
        # registered faulthandler on it, which stays its own until it lets go.
        for name in ("up0", "up1"):
            os.remove(tmp_path / name)
        msg = k.execute_async("import faulthandler, signal; faulthandler.unregister(signal.SIGUSR1)\n"
                              f"res = nblaunch.notebook_launcher(until_preempted, ({str(tmp_path)!r},), "
                              "num_processes=2, display='text')\nprint('returned', len(res), res[0] == res[1])")
        deadline = time.monotonic() + 120
        while len([f for f in os.listdir(tmp_path) if f.startswith("up")]) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(k.pid, signal.SIGUSR1)
        r = k.wait_for_reply(msg, timeout=120)
        assert r.error is None, r.error
        assert "preempted (SIGUSR1 to the kernel): saving" in r.text and "returned 2 True" in r.text, r.text
    finally:
        k.shutdown()
