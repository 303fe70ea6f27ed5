"""A long run on a real SLURM allocation of three nodes (issue 37): a node
lost (its agent and its slurmd SIGKILLed) stops the other nodes' ranks at
once, and with ``min_nodes`` the next generation runs on the two nodes still
up; ``scancel --signal=USR1`` on the agents' step is a preemption notice to
every rank. Needs the three-node cluster of ``.ci/slurm`` (skips without it,
fails with ``NBLAUNCH_REQUIRE_SLURM``)."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time

import psutil
import pytest

import slurm_cluster
from conftest import Kernel
from test_slurm import _agents, _nothing_left, _ok, _salloc

pytestmark = [pytest.mark.timeout(300), pytest.mark.long]

_WHY_NOT = slurm_cluster.why_not(nodes=3)
needs_three = pytest.mark.skipif(bool(_WHY_NOT), reason=_WHY_NOT)

RECOVERY_BOUND_S = 30.0

STEPPER = """
import json, os, time, nblaunch
def stepper(folder, steps=400):
    import torch, torch.distributed as dist
    restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    bar = nblaunch.progress(total=steps, desc="train")
    t = torch.ones(1)
    for step in range(steps):
        dist.all_reduce(t)
        bar.update(1)
        if step == 0:
            with open(os.path.join(folder, f"first-{restart}-{rank}"), "w") as f:
                json.dump({"time": time.time(), "host": os.environ["SLURMD_NODENAME"]}, f)
        if restart == 0 and step >= 5:
            time.sleep(0.2)  # the first generation waits to be cut short
    return (restart, rank, world, os.environ["SLURMD_NODENAME"])
"""


@pytest.fixture
def three_nodes():
    """An allocation of the three nodes (``--no-kill``: the job outlives a
    node's failure, as a long run's should) and a kernel inside it."""
    with slurm_cluster.losing_a_node():
        job = _salloc(3, "--no-kill")
        k = Kernel(extra_env={"SLURM_JOB_ID": job})
        try:
            yield job, k
        finally:
            k.shutdown()
            _nothing_left(job)
            subprocess.run(["scancel", job], timeout=20)


def _agent_on(job: str, node: str) -> psutil.Process:
    """The agent itself (not its zygote or ranks: SLURM's step daemon is its parent)."""
    for p in _agents(job):
        try:
            if p.environ().get("SLURMD_NODENAME") == node and p.parent().name() == "slurmstepd":
                return p
        except psutil.Error:
            pass
    raise AssertionError(f"no agent on {node}")


def _slurmd_pid(node: str) -> int | None:
    path = os.path.join(os.environ.get("NBLAUNCH_SLURM_DIR", "/tmp/nblaunch-slurm"), f"slurmd-{node}.pid")
    try:
        return int(open(path).read())
    except (OSError, ValueError):
        return None


def _restart_slurmd(node: str) -> None:
    conf = os.environ.get("SLURM_CONF", "/etc/slurm/slurm.conf")
    subprocess.run(["slurmd", "-N", node, "-f", conf], check=True, timeout=30)


def _wait_files(folder, prefix: str, n: int, timeout: float = 180) -> list[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = sorted(f for f in os.listdir(folder) if f.startswith(prefix))
        if len(found) >= n:
            return found
        time.sleep(0.05)
    raise AssertionError(f"only {os.listdir(folder)} in {timeout:.0f} s")


@needs_three
def test_a_lost_node_restarts_the_run_on_the_two_nodes_still_up_within_30_s(three_nodes, tmp_path):
    job, k = three_nodes
    _ok(k.execute(STEPPER))
    msg = k.execute_async(f"res = nblaunch.notebook_launcher(stepper, ({str(tmp_path)!r}, 30), num_processes=1, "
                          "cluster='slurm', max_restarts=1, min_nodes=2, display='text')\nprint(list(res))")
    _wait_files(tmp_path, "first-0-", 3)
    time.sleep(1.0)  # a few steps in
    agent, slurmd = _agent_on(job, "n3"), _slurmd_pid("n3")
    t_lost = time.time()
    agent.send_signal(signal.SIGKILL)
    if slurmd is not None and os.geteuid() == 0:
        os.kill(slurmd, signal.SIGKILL)
    try:
        _wait_files(tmp_path, "first-1-", 2)
        firsts = [json.load(open(tmp_path / f"first-1-{r}")) for r in (0, 1)]
        recovery = max(f["time"] for f in firsts) - t_lost
        r = k.wait_for_reply(msg, timeout=120)
    finally:
        if slurmd is not None and os.geteuid() == 0:
            _restart_slurmd("n3")
    text = _ok(r)
    # The second generation: two nodes, WORLD_SIZE 2, RANK 0 and 1, restart count 1.
    assert "[(1, 0, 2, 'n1'), (1, 1, 2, 'n2')]" in text, text
    assert re.search(r"restart 1 of 1: node n3 lost at step \d+; 2 nodes, 2 ranks", text), text
    assert sorted(f["host"] for f in firsts) == ["n1", "n2"]
    assert recovery < RECOVERY_BOUND_S, f"the survivors' first step came {recovery:.1f} s after the loss"
    print(f"recovery: {recovery:.1f} s")


@needs_three
def test_without_enough_nodes_left_the_loss_is_the_error_naming_the_node(three_nodes, tmp_path):
    job, k = three_nodes
    _ok(k.execute(STEPPER))
    msg = k.execute_async(f"nblaunch.notebook_launcher(stepper, ({str(tmp_path)!r}, 30), num_processes=1, "
                          "cluster='slurm', max_restarts=1, min_nodes=3, display='none')")
    _wait_files(tmp_path, "first-0-", 3)
    t0 = time.monotonic()
    _agent_on(job, "n2").send_signal(signal.SIGKILL)
    r = k.wait_for_reply(msg, timeout=120)
    assert time.monotonic() - t0 < 30  # the others were stopped at once, not left in their all_reduce
    assert r.error is not None and r.error["ename"] == "WorkerError"
    tb = "\n".join(r.error["traceback"])
    assert re.search(r"node 1 \(n2\)", tb), tb


PREEMPTED = """
import os, time, nblaunch
def until_preempted(folder):
    import torch, torch.distributed as dist
    open(os.path.join(folder, f"up-{dist.get_rank()}"), "w").close()
    step = 0
    while not nblaunch.preempted(agree=True):
        step += 1
        time.sleep(0.05)
    return (dist.get_rank(), step, os.environ["SLURMD_NODENAME"])
"""


@needs_three
def test_scancel_signal_usr1_on_the_step_lets_every_rank_on_every_node_return(three_nodes, tmp_path):
    job, k = three_nodes
    _ok(k.execute(PREEMPTED))
    msg = k.execute_async(f"res = nblaunch.notebook_launcher(until_preempted, ({str(tmp_path)!r},), num_processes=1, "
                          "cluster='slurm', display='text')\nprint(list(res))")
    _wait_files(tmp_path, "up-", 3)
    steps = subprocess.run(["squeue", "-h", "-s", "-j", job, "-o", "%i %j"], capture_output=True, text=True,
                           timeout=20).stdout.splitlines()
    step = [line.split()[0] for line in steps if "nblaunch-agents" in line]
    assert step, steps
    subprocess.run(["scancel", "--signal=USR1", step[0]], check=True, timeout=20)
    text = _ok(k.wait_for_reply(msg, timeout=120))
    found = re.findall(r"\((\d), (\d+), '(n\d)'\)", text)
    assert [(r, h) for r, _, h in found] == [("0", "n1"), ("1", "n2"), ("2", "n3")], text
    assert len({s for _, s, _ in found}) == 1, text  # agreed: every rank stopped at the same step
    assert "preempted (SIGUSR1 to the agent on n" in text, text


def _agents_step(job: str) -> str:
    steps = subprocess.run(["squeue", "-h", "-s", "-j", job, "-o", "%i %j"], capture_output=True, text=True,
                           timeout=20).stdout.splitlines()
    step = [line.split()[0] for line in steps if "nblaunch-agents" in line]
    assert step, steps
    return step[0]


@needs_three
def test_scancel_of_the_job_is_a_notice_every_rank_saves_on_before_slurms_sigkill(three_nodes, tmp_path):
    """``scancel JOB`` (as preemption and the time limit do): SLURM sends
    SIGTERM to every process of the job's steps, agents and ranks alike,
    and SIGKILL KillWait (5 s here) later. The ranks take it as the notice,
    agree on a step and return before the SIGKILL. (``scancel STEP`` is a
    SIGKILL at once: a lost node, test_slurm.py.)"""
    job, k = three_nodes
    _ok(k.execute(PREEMPTED))
    msg = k.execute_async(f"res = nblaunch.notebook_launcher(until_preempted, ({str(tmp_path)!r},), num_processes=1, "
                          "cluster='slurm', display='text')\nprint(list(res))")
    _wait_files(tmp_path, "up-", 3)
    subprocess.run(["scancel", job], check=True, timeout=20)
    text = _ok(k.wait_for_reply(msg, timeout=120))
    found = re.findall(r"\((\d), (\d+), '(n\d)'\)", text)
    assert [(r, h) for r, _, h in found] == [("0", "n1"), ("1", "n2"), ("2", "n3")], text
    assert len({s for _, s, _ in found}) == 1, text
    assert re.search(r"preempted \(SIGTERM to (the agent on|rank \d on) n\d\): saving", text), text


@needs_three
def test_live_ranks_that_lose_a_node_are_restarted_on_the_nodes_still_up(three_nodes):
    job, k = three_nodes
    _ok(k.execute("import os, nblaunch\n"
                  "ranks = nblaunch.start(1, cluster='slurm', min_nodes=2)\n"
                  "where = lambda: (int(os.environ['RANK']), int(os.environ['WORLD_SIZE']), "
                  "os.environ['SLURMD_NODENAME'])\n"
                  "print(ranks.run(where, display='none'))"))
    _agent_on(job, "n3").send_signal(signal.SIGKILL)
    r = k.execute("ranks.run(where, display='none')", timeout=120)
    assert r.error is not None and r.error["ename"] == "WorkerError"
    tb = "\n".join(r.error["traceback"])
    assert "node 2 (n3)" in tb and "restarted its ranks on the 2 nodes still up" in tb, tb
    text = _ok(k.execute("print(ranks.run(where, display='text')); print(ranks.num_processes); ranks.close()",
                         timeout=120))
    assert "[(0, 2, 'n1'), (1, 2, 'n2')]" in text, text
    assert "the ranks run on the 2 nodes still up since node n3 lost" in text, text
