"""A node that stops answering on a real SLURM allocation (issue 47): every process of it (its
slurmd, its agent, its zygote and ranks) SIGSTOPped, as a hung machine, a GPU fallen off the bus
or a network partition look from the others: nothing closes. The heartbeats name it within the
launch's ``node_lost_after``, the others stop at once, with ``min_nodes`` the run goes on without
it, and once thawed it leaves nothing. A frozen kernel: the agents end their ranks. A kernel busy
in a pure-Python loop on a busy machine: no node is called lost. Needs ``.ci/slurm``'s cluster."""
from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest

import slurm_cluster
from conftest import Kernel
from test_slurm import _agents, _nothing_left, _ok, _salloc
from test_session import _value
from test_slurm_resilience import _slurmd_pid

pytestmark = [pytest.mark.timeout(300), pytest.mark.long]

_WHY_NOT = slurm_cluster.why_not(nodes=3)
needs_three = pytest.mark.skipif(bool(_WHY_NOT), reason=_WHY_NOT)
LOST_AFTER_S = 3
NAMED_WITHIN_S = LOST_AFTER_S + 12  # the loss named, the others stopped and the launch back (2 cores, shared)

STEPS = """
import os, time, nblaunch
def steps(folder, n=3000):
    import torch, torch.distributed as dist
    restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    rank, host = dist.get_rank(), os.environ["SLURMD_NODENAME"]
    bar = nblaunch.progress(total=n, desc="train")
    t = torch.ones(1)
    for step in range(n):
        dist.all_reduce(t)
        bar.update(1)
        if step == 5:
            open(os.path.join(folder, f"at-{restart}-{rank}-{host}"), "w").close()
        time.sleep(0.05)
    return (restart, rank, dist.get_world_size(), host)
"""


@pytest.fixture
def nodes(request):
    """An allocation of ``request.param`` nodes (``--no-kill``) and a kernel inside it, holding
    the three-node lock: a frozen node's daemon is every allocation's there."""
    with slurm_cluster.losing_a_node():
        job = _salloc(request.param, "--no-kill")
        k = Kernel(extra_env={"SLURM_JOB_ID": job})
        try:
            yield job, k
        finally:
            k.shutdown()
            _nothing_left(job, timeout=30)
            subprocess.run(["scancel", job], timeout=20)


def _wait_files(folder, prefix: str, n: int, timeout: float = 180) -> list[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = sorted(f for f in os.listdir(folder) if f.startswith(prefix))
        if len(found) >= n:
            return found
        time.sleep(0.05)
    raise AssertionError(f"only {os.listdir(folder)} in {timeout:.0f} s")


@contextlib.contextmanager
def frozen(job: str, node: str):
    """Every process of ``node`` SIGSTOPped (its slurmd, and the launch's agent, zygote and ranks
    there), SIGCONTed on the way out whatever happens; yields the pids stopped."""
    procs = [p for p in _agents(job) if p.name() != "srun" and p.environ().get("SLURMD_NODENAME") == node]
    slurmd = _slurmd_pid(node)
    pids = ([slurmd] if slurmd is not None else []) + [p.pid for p in procs]
    assert procs, f"no agent on {node}"
    try:
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        yield pids
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def _host_of(files: list[str], rank: int) -> str:
    return next(f.rsplit("-", 1)[1] for f in files if f.split("-")[2] == str(rank))


@needs_three
@pytest.mark.parametrize("nodes", [2], indirect=True)
def test_a_frozen_node_is_named_within_seconds_and_once_thawed_leaves_nothing(nodes, tmp_path):
    job, k = nodes
    _ok(k.execute(STEPS))
    msg = k.execute_async(f"nblaunch.notebook_launcher(steps, ({str(tmp_path)!r},), num_processes=1, "
                          f"cluster='slurm', timeout=600, node_lost_after={LOST_AFTER_S}, display='none')")
    host = _host_of(_wait_files(tmp_path, "at-0-", 2), 1)
    with frozen(job, host):
        t0 = time.monotonic()
        r = k.wait_for_reply(msg, timeout=120)
        named = time.monotonic() - t0
        thawed = time.monotonic()
    assert r.error is not None and r.error["ename"] == "WorkerError", r.text
    tb = "\n".join(r.error["traceback"])
    assert re.search(rf"node 1 \({host}\) stopped answering: no heartbeat for {LOST_AFTER_S} s "
                     r"\(its ranks were at step \d+\)", tb), tb
    assert named < NAMED_WITHIN_S, f"named {named:.1f} s after the freeze"
    _nothing_left(job, timeout=20)  # the thawed agent learnt it was dropped and ended its ranks
    print(f"named after {named:.1f} s; the thawed node gone {time.monotonic() - thawed:.1f} s after SIGCONT")


@needs_three
@pytest.mark.parametrize("nodes", [3], indirect=True)
def test_with_min_nodes_the_run_goes_on_without_a_frozen_node(nodes, tmp_path):
    job, k = nodes
    _ok(k.execute(STEPS))
    msg = k.execute_async(f"res = nblaunch.notebook_launcher(steps, ({str(tmp_path)!r}, 60), num_processes=1, "
                          "cluster='slurm', max_restarts=1, min_nodes=2, timeout=600, "
                          f"node_lost_after={LOST_AFTER_S}, display='text')\nprint(list(res))")
    host = _host_of(_wait_files(tmp_path, "at-0-", 3), 2)
    with frozen(job, host):
        t0 = time.time()
        _wait_files(tmp_path, "at-1-", 2)
        going_on = max(os.path.getmtime(tmp_path / f) for f in os.listdir(tmp_path) if f.startswith("at-1-")) - t0
        text = _ok(k.wait_for_reply(msg, timeout=120))
    survivors = sorted(n for n in ("n1", "n2", "n3") if n != host)
    assert f"[(1, 0, 2, '{survivors[0]}'), (1, 1, 2, '{survivors[1]}')]" in text, text
    assert re.search(rf"restart 1 of 1: node {host} lost at step \d+; 2 nodes, 2 ranks", text), text
    assert going_on < 60, f"the survivors' 6th step came {going_on:.1f} s after the freeze"
    _nothing_left(job, timeout=20)
    print(f"survivors at their 6th step {going_on:.1f} s after the freeze")


@needs_three
@pytest.mark.parametrize("nodes", [2], indirect=True)
def test_a_node_frozen_between_calls_of_live_ranks_is_named_at_once_and_by_the_next_run(nodes):
    """No call runs: the line comes in the notebook's output by itself, ``status`` says it, and
    the next run (the node thawed) names it and restarts the ranks."""
    job, k = nodes
    text = _ok(k.execute("import os, nblaunch\n"
                         f"ranks = nblaunch.start(1, cluster='slurm', node_lost_after={LOST_AFTER_S})\n"
                         "where = lambda: os.environ['SLURMD_NODENAME']\n"
                         "print(ranks.run(where, display='none'))", timeout=120))
    host = re.search(r"\['n\d', '(n\d)'\]", text).group(1)
    with frozen(job, host):
        t0 = time.monotonic()
        said = k.wait_for_output("while no call ran", timeout=60)
        named = time.monotonic() - t0
        status = _value(k.execute("ranks.status"))
    assert re.search(rf"nblaunch: node 1 \({host}\) stopped answering: no heartbeat for {LOST_AFTER_S} s while no "
                     r"call ran; the next run reports it and restarts the ranks \(their state is lost\)", said), said
    assert named < NAMED_WITHIN_S, f"named {named:.1f} s after the freeze"
    assert status.startswith(f"'down: node 1 ({host}) stopped answering: no heartbeat for {LOST_AFTER_S} s outside a call"), status
    r = k.execute("ranks.run(where, display='none')", timeout=180)
    assert r.error is not None and r.error["ename"] == "WorkerError", r.text
    tb = "\n".join(r.error["traceback"])
    assert f"node 1 ({host}) stopped answering: no heartbeat for {LOST_AFTER_S} s" in tb, tb
    assert "The session restarted its ranks" in tb, tb
    text = _ok(k.execute("print(ranks.run(where, display='none')); ranks.close()", timeout=180))
    assert re.search(r"\['n\d', 'n\d'\]", text), text
    print(f"named {named:.1f} s after the freeze, between calls")


@needs_three
@pytest.mark.parametrize("nodes", [2], indirect=True)
def test_the_agents_of_a_frozen_kernel_end_their_ranks(nodes):
    job, k = nodes
    k.execute_async(f"""
import time, nblaunch
def wait():
    print("waiting", flush=True)
    time.sleep(300)
nblaunch.notebook_launcher(wait, num_processes=2, cluster="slurm", node_lost_after={LOST_AFTER_S}, display="text")""")
    k.wait_for_output("waiting", timeout=120)
    assert len([p for p in _agents(job) if p.name() != "srun"]) == 2 + 2 + 4  # agents, their zygotes, ranks
    os.kill(k.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        _nothing_left(job, timeout=30)
        gone = time.monotonic() - t0
    finally:
        os.kill(k.pid, signal.SIGCONT)
    assert gone < LOST_AFTER_S + 10, f"the ranks ended {gone:.1f} s after the kernel froze"
    print(f"every node's ranks ended {gone:.1f} s after the kernel froze")


@needs_three
@pytest.mark.parametrize("nodes", [2], indirect=True)
def test_a_kernel_busy_in_python_on_a_busy_machine_loses_no_node(nodes):
    """Live ranks between calls, the kernel in a pure-Python loop for 4 lost-after times, both
    cores spun by other processes: the next call runs on both nodes."""
    job, k = nodes
    _ok(k.execute("import os, time, nblaunch\n"
                  f"ranks = nblaunch.start(1, cluster='slurm', node_lost_after={LOST_AFTER_S - 1})\n"
                  "where = lambda: (int(os.environ['WORLD_SIZE']), os.environ['SLURMD_NODENAME'])\n"
                  "print(ranks.run(where, display='none'))", timeout=120))
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        _ok(k.execute(f"t = time.monotonic()\nwhile time.monotonic() - t < {4 * (LOST_AFTER_S - 1)}: pass",
                      timeout=60))
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    text = _ok(k.execute("print(ranks.run(where, display='none')); ranks.close()", timeout=120))
    assert re.search(r"\[\(2, 'n\d'\), \(2, 'n\d'\)\]", text), text
    assert not [p for p in psutil.Process().children(recursive=True) if p.pid in {s.pid for s in spinners}]


# 2 x 16 ranks, each at 10 Hz; the 256 (128 a node) with NBLAUNCH_TEST_BUSY_RANKS_PER_NODE=128
# (measured by hand: bench/README.md, issue 47), minutes of forking on 2 shared cores.
BUSY_PER_NODE = int(os.environ.get("NBLAUNCH_TEST_BUSY_RANKS_PER_NODE", "16"))


@needs_three
@pytest.mark.parametrize("nodes", [2], indirect=True)
def test_many_ranks_reporting_fast_while_the_kernel_is_busy_lose_no_node(nodes, tmp_path):
    """A background run of 2 x 16 ranks (or more), each reporting progress at 10 Hz, while the kernel runs
    a pure-Python loop for 25 s and two other processes spin both cores: no node is called lost
    (``node_lost_after=10``), and every rank returns."""
    job, k = nodes
    stop = tmp_path / "stop"
    _ok(k.execute(f"""
import os, time, nblaunch
def report(folder, stop):
    bar = nblaunch.progress(desc="reporting")
    open(os.path.join(folder, f"up-{{os.environ['RANK']}}"), "w").close()
    while not os.path.exists(stop):
        bar.update(1)
        time.sleep(0.1)
    return os.environ["SLURMD_NODENAME"]
run = nblaunch.submit(report, ({str(tmp_path)!r}, {str(stop)!r}), num_processes={BUSY_PER_NODE}, cluster="slurm",
                      init_process_group=False, node_lost_after=10, display="none", timeout=600)"""))
    _wait_files(tmp_path, "up-", 2 * BUSY_PER_NODE)
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        busy = _ok(k.execute("t = time.monotonic()\nwhile time.monotonic() - t < 25: pass\nprint(run.status)",
                             timeout=120))
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    stop.touch()
    text = _ok(k.execute("res = run.result(timeout=120)\nprint(len(res), sorted(set(res)))", timeout=180))
    assert re.search(rf"{2 * BUSY_PER_NODE} \['n\d', 'n\d'\]", text), (busy, text)
    assert "lost" not in busy + text, busy + text
