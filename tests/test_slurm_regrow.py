"""A lost node comes back (issue 48), on the three fake nodes of ``.ci/slurm``: n3's agent and
slurmd SIGKILLed about 10 s into a launch with ``min_nodes=2``, its slurmd started again at
about 25 s. The run goes on on n1 and n2, then, once n3 has been usable for
``node_back_after`` (10 s), every rank gets the notice (``resize: n3 is back``), saves and
returns, and ``fn`` is called again on the three nodes, from the checkpoint; the resize is
not counted against ``max_restarts``. An allocation nblaunch asked for (``Slurm(nodes=3)``)
gets a node in a lost one's place (partition "grow", where n4 waits idle). Needs the cluster
(skips without it, fails with ``NBLAUNCH_REQUIRE_SLURM``)."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time

import pytest

import slurm_cluster
from conftest import Kernel
from test_slurm import _ok
from test_slurm_resilience import _agent_on, _restart_slurmd, _slurmd_pid, _wait_files, three_nodes  # noqa: F401

pytestmark = [pytest.mark.timeout(300), pytest.mark.long]  # a node killed and brought back: pytest -m long

_WHY_NOT = slurm_cluster.why_not(nodes=3)
needs_three = pytest.mark.skipif(bool(_WHY_NOT), reason=_WHY_NOT)

LOST_AT_S, BACK_AT_S = 10.0, 25.0
GROWN_WITHIN_S = 30.0

GROWER = """
import json, os, time, nblaunch
def grower(folder, steps):
    import torch, torch.distributed as dist
    restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    rank, world, host = dist.get_rank(), dist.get_world_size(), os.environ["SLURMD_NODENAME"]
    ckpt = os.path.join(folder, "ckpt")
    start = int(open(ckpt).read()) if os.path.exists(ckpt) else 0

    def save(step):
        if rank == 0:
            with open(ckpt + ".tmp", "w") as f:
                f.write(str(step))
            os.replace(ckpt + ".tmp", ckpt)
        dist.barrier()

    t = torch.ones(1)
    for step in nblaunch.progress(range(start, steps), desc="train"):
        dist.all_reduce(t)
        if step == start:
            with open(os.path.join(folder, f"gen-{restart}-{rank}"), "w") as f:
                json.dump({"time": time.time(), "host": host, "world": world, "start": start}, f)
        if nblaunch.preempted(agree=True):
            save(step)
            with open(os.path.join(folder, f"notice-{restart}-{rank}"), "w") as f:
                f.write(nblaunch.preempt_reason())
            return (restart, rank, world, host, step)
        if (step + 1) % 5 == 0:
            save(step + 1)
        time.sleep(0.1)
    return (restart, rank, world, host, steps)
"""


def _gen(folder, restart: int, rank: int) -> dict:
    return json.load(open(folder / f"gen-{restart}-{rank}"))


@needs_three
def test_a_node_whose_slurmd_comes_back_is_taken_back_and_the_run_is_on_three_nodes_again(three_nodes, tmp_path):
    job, k = three_nodes
    _ok(k.execute(GROWER))
    t_launch = time.time()
    msg = k.execute_async(f"res = nblaunch.notebook_launcher(grower, ({str(tmp_path)!r}, 700), num_processes=1, "
                          "cluster='slurm', max_restarts=2, min_nodes=2, preempt_grace=20, display='text')\n"
                          "print(list(res)); print(res.restarts)")
    _wait_files(tmp_path, "gen-0-", 3)
    _wait_files(tmp_path, "ckpt", 1)  # a few steps in: the survivors resume from a checkpoint of the three
    time.sleep(max(0.0, t_launch + LOST_AT_S - time.time()))
    agent, slurmd = _agent_on(job, "n3"), _slurmd_pid("n3")
    assert slurmd is not None
    t_lost = time.time()
    agent.send_signal(signal.SIGKILL)
    os.kill(slurmd, signal.SIGKILL)
    try:
        _wait_files(tmp_path, "gen-1-", 2)
        time.sleep(max(0.0, t_launch + BACK_AT_S - time.time()))
    finally:
        _restart_slurmd("n3")
    t_back = time.time()
    _wait_files(tmp_path, "gen-2-", 3, timeout=120)
    grown = max(_gen(tmp_path, 2, r)["time"] for r in range(3)) - t_back
    text = _ok(k.wait_for_reply(msg, timeout=240))

    assert sorted(_gen(tmp_path, 1, r)["host"] for r in range(2)) == ["n1", "n2"]
    assert sorted(_gen(tmp_path, 2, r)["host"] for r in range(3)) == ["n1", "n2", "n3"]
    assert [open(tmp_path / f"notice-1-{r}").read() for r in range(2)] == ["resize: n3 is back"] * 2
    saved = _gen(tmp_path, 2, 0)["start"]
    assert saved > _gen(tmp_path, 1, 0)["start"] > 0  # each generation from the last one's checkpoint
    # fn called again on three nodes: only its results come back (the resized generation's are dropped)
    assert "[(2, 0, 3, 'n1', 700), (2, 1, 3, 'n2', 700), (2, 2, 3, 'n3', 700)]" in text, text
    assert re.search(r"restart 1 of 2: node n3 lost at step \d+; 2 nodes, 2 ranks", text), text
    assert "'restart 2 of 3: n3 back; 3 nodes, 3 ranks'" in text, text  # in results.restarts
    assert "n3 is back: resizing" in text, text
    assert grown < GROWN_WITHIN_S, f"the three nodes' first step came {grown:.1f} s after n3's slurmd was back"
    print(f"lost at {t_lost - t_launch:.1f} s, slurmd back at {t_back - t_launch:.1f} s; "
          f"on three nodes again {grown:.1f} s later (node_back_after 10 s)")
    print(text)



@needs_three
def test_live_ranks_never_grow_unasked_and_grow_takes_the_node_back(three_nodes):
    job, k = three_nodes
    _ok(k.execute("import os, nblaunch\n"
                  "ranks = nblaunch.start(1, cluster='slurm', min_nodes=2, node_back_after=3)\n"
                  "where = lambda: (int(os.environ['RANK']), int(os.environ['WORLD_SIZE']), "
                  "os.environ['SLURMD_NODENAME'])\n"
                  "print(ranks.run(where, display='none'))", timeout=120))
    slurmd = _slurmd_pid("n3")
    assert slurmd is not None
    _agent_on(job, "n3").send_signal(signal.SIGKILL)
    os.kill(slurmd, signal.SIGKILL)
    try:
        r = k.execute("ranks.run(where, display='none')", timeout=120)
        assert r.error is not None and "restarted its ranks on the 2 nodes still up" in "\n".join(r.error["traceback"])
    finally:
        _restart_slurmd("n3")
    t_back, text = time.monotonic(), ""
    while "n3 is back" not in text:  # each run is one more chance for the probes to have said so
        assert time.monotonic() - t_back < 90, f"no run said n3 is back within 90 s:\n{text}"
        text = _ok(k.execute("print(ranks.run(where, display='text'))", timeout=120))
    assert "[(0, 2, 'n1'), (1, 2, 'n2')]" in text, text  # said, not taken: the ranks keep their state
    assert "n3 is back: ranks.grow() takes it in" in text, text
    text = _ok(k.execute("print(ranks.grow()); print(ranks.run(where, display='none')); ranks.close()", timeout=180))
    assert "['n3']" in text and "[(0, 3, 'n1'), (1, 3, 'n2'), (2, 3, 'n3')]" in text, text
    print(f"n3 said back {time.monotonic() - t_back:.1f} s after its slurmd (node_back_after=3)")


_WHY_NOT_FOUR = slurm_cluster.why_not(nodes=4, partition="grow")


def _jobs(name: str) -> list[str]:
    """Jobs of partition "grow" (the replacement test's alone) named ``name``, pending or running."""
    out = subprocess.run(["squeue", "-h", "-p", "grow", "-n", name, "-t", "PENDING,RUNNING", "-o", "%i"],
                         capture_output=True, text=True, timeout=20)
    return out.stdout.split()


@pytest.mark.skipif(bool(_WHY_NOT_FOUR), reason=_WHY_NOT_FOUR)
def test_an_allocation_nblaunch_asked_for_gets_a_replacement_for_a_lost_node(tmp_path):
    """``Slurm(nodes=3)`` in partition "grow" (n1-n4; n4 idle): a node's agent and slurmd
    SIGKILLed and never back. SLURM is asked for one node in its place (the same partition,
    none of the allocation's), the run goes on on two, grows onto the new node once it has
    answered for ``node_back_after``, and every job it asked for is given back at the end."""
    with slurm_cluster.losing_a_node():
        k = Kernel()  # outside any allocation: nblaunch asks for one
        victim = None
        try:
            _ok(k.execute(GROWER))
            msg = k.execute_async(
                f"res = nblaunch.notebook_launcher(grower, ({str(tmp_path)!r}, 700), num_processes=1, "
                "cluster=nblaunch.Slurm(nodes=3, partition='grow'), max_restarts=2, min_nodes=2, preempt_grace=20, "
                "display='text')\nprint(list(res)); print(res.restarts)")
            _wait_files(tmp_path, "gen-0-", 3)
            _wait_files(tmp_path, "ckpt", 1)
            (job,) = _jobs("nblaunch")
            hosts = sorted(_gen(tmp_path, 0, r)["host"] for r in range(3))
            victim, (fourth,) = hosts[-1], sorted({"n1", "n2", "n3", "n4"} - set(hosts))
            agent, slurmd = _agent_on(job, victim), _slurmd_pid(victim)
            assert slurmd is not None
            t_lost = time.time()
            agent.send_signal(signal.SIGKILL)
            os.kill(slurmd, signal.SIGKILL)
            _wait_files(tmp_path, "gen-1-", 2)
            spare = _jobs("nblaunch-spare")
            assert len(spare) == 1, spare  # one request, in place of the one node lost
            _wait_files(tmp_path, "gen-2-", 3, timeout=120)
            grown = max(_gen(tmp_path, 2, r)["time"] for r in range(3)) - t_lost
            text = _ok(k.wait_for_reply(msg, timeout=240))
        finally:
            k.shutdown()
            if victim is not None:
                _restart_slurmd(victim)

    assert sorted(_gen(tmp_path, 2, r)["host"] for r in range(3)) == sorted(hosts[:2] + [fourth])
    label = f"{fourth} (in place of {victim})"
    assert [open(tmp_path / f"notice-1-{r}").read() for r in range(2)] == [f"resize: {label} is back"] * 2
    assert _gen(tmp_path, 2, 0)["start"] > _gen(tmp_path, 1, 0)["start"] > 0  # from the checkpoints
    assert f"SLURM granted {fourth} (job {spare[0]}) in place of {victim}" in text, text
    assert f"'restart 2 of 3: {label} back; 3 nodes, 3 ranks'" in text, text
    assert ", 700)]" in text and text.count(", 3, 'n") == 3, text  # fn's results on the three nodes
    deadline = time.monotonic() + 30
    while (_jobs("nblaunch") or _jobs("nblaunch-spare")) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _jobs("nblaunch") and not _jobs("nblaunch-spare"), "an allocation it asked for was not given back"
    print(f"on three nodes again, {fourth} in place of {victim}, {grown:.1f} s after the loss")
    print(text)
