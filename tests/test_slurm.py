"""Ranks on the nodes of a real SLURM allocation (issue 26).

Runs against a real cluster: slurmctld and two slurmd daemons (nodes n1 and
n2) on this machine, started by ``.ci/slurm`` (CI runs it; ``sudo bash
.ci/slurm`` here). Without SLURM these tests skip, unless
``NBLAUNCH_REQUIRE_SLURM`` is set (CI), when they fail. The kernels run
inside an allocation the way a Jupyter server started by ``salloc`` or
Open OnDemand does: with the job's ``SLURM_JOB_ID`` in their environment.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client

import psutil
import pytest

import slurm_cluster
from conftest import Kernel

pytestmark = [pytest.mark.timeout(300), pytest.mark.slurm]


_WHY_NOT = slurm_cluster.why_not()
needs_slurm = pytest.mark.skipif(bool(_WHY_NOT), reason=_WHY_NOT)


def _agents(job: str) -> list[psutil.Process]:
    """Every nblaunch agent and rank of a cluster launch on allocation ``job``
    (the zygotes and ranks are forked agents: the same command line), and the srun that
    started them, zombies aside. They are SLURM's children, not the test's,
    so the usual check does not see them; other launches running beside
    this test (the SLURM notebook in the other test process) are not ours."""
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            cmd = " ".join(p.info["cmdline"] or [])
            if ("nblaunch.engines.agent" in cmd and p.info["status"] != psutil.STATUS_ZOMBIE
                    and (f"--jobid={job} " in cmd or p.environ().get("SLURM_JOB_ID") == job)):
                found.append(p)
        except psutil.Error:
            pass
    return found


def _nothing_left(job: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while _agents(job) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [f"{p.pid} {' '.join(p.cmdline())[:120]}" for p in _agents(job)]
    assert not left, f"agents or ranks left on the nodes: {left}"


def _salloc(nodes: int = 2, *extra: str) -> str:
    out = subprocess.run(["salloc", "--no-shell", f"--nodes={nodes}", "--job-name=nblaunch-tests", *extra],
                         capture_output=True, text=True, timeout=60)
    found = re.search(r"job allocation (\d+)", out.stdout + out.stderr)
    assert found, out.stdout + out.stderr
    return found.group(1)


def _held() -> list[str]:
    """Allocations still held (pending or running; one being cleaned up after
    scancel, COMPLETING, is given back)."""
    out = subprocess.run(["squeue", "-h", "-t", "PENDING,RUNNING", "-o", "%i"], capture_output=True, text=True,
                         timeout=20)
    return out.stdout.split()


@pytest.fixture(scope="module")
def allocation():
    job = _salloc(2)
    try:
        yield job
    finally:
        subprocess.run(["scancel", job], timeout=20)


@pytest.fixture
def slurm_kernel(allocation):
    k = Kernel(extra_env={"SLURM_JOB_ID": allocation})
    try:
        yield k
    finally:
        k.shutdown()
        _nothing_left(allocation)


def _ok(result) -> str:
    assert result.error is None, "\n".join(result.error["traceback"])
    return result.text


TRAIN = """
import os, socket
import nblaunch
def where():
    import torch, torch.distributed as dist
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    print(f"rank {dist.get_rank()} on {os.environ['SLURMD_NODENAME']}", flush=True)
    return (dist.get_rank(), dist.get_world_size(), os.environ["SLURMD_NODENAME"], int(os.environ["NODE_RANK"]),
            int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"]), t.item())
def weights():
    import gc, torch, torch.distributed as dist
    return {"w": torch.full((1000,), float(dist.get_rank())), "rank": dist.get_rank(),
            "gc": gc.isenabled()}
"""


@needs_slurm
def test_ranks_run_on_every_node_of_the_allocation_and_return_by_rank(slurm_kernel):
    _ok(slurm_kernel.execute(TRAIN))
    r = slurm_kernel.execute("res = nblaunch.notebook_launcher(where, num_processes=2, cluster='slurm', num_nodes=2)\n"
                             "print(list(res))")
    text = _ok(r)
    # rank, world, node name, NODE_RANK, SLURM_PROCID, SLURM_NTASKS, all_reduce of the ranks
    assert "[(0, 4, 'n1', 0, 0, 4, 6.0), (1, 4, 'n1', 0, 1, 4, 6.0), (2, 4, 'n2', 1, 2, 4, 6.0), " \
           "(3, 4, 'n2', 1, 3, 4, 6.0)]" in text
    final = [o["content"]["data"]["text/plain"] for o in r.outputs
             if o["msg_type"] in ("display_data", "update_display_data") and "text/plain" in o["content"]["data"]]
    view = final[-1]
    # One view for both nodes: a row per rank with its machine, and every rank's lines.
    for rank, host in [(0, "n1"), (1, "n1"), (2, "n2"), (3, "n2")]:
        assert f"rank {rank} · {host} finished" in view, view
        assert f"[rank {rank}] rank {rank} on {host}" in view, view
    # Tensors in results travel from the other node too (a node's shared memory is fetched there).
    # Each rank collects its own garbage (its agent imported with the collector off).
    text = _ok(slurm_kernel.execute("out = nblaunch.notebook_launcher(weights, num_processes=2, cluster='slurm', "
                                    "display='none')\n"
                                    "print([(o['rank'], o['w'].shape[0], o['w'].sum().item(), o['gc']) for o in out])"))
    assert "[(0, 1000, 0.0, True), (1, 1000, 1000.0, True), (2, 1000, 2000.0, True), (3, 1000, 3000.0, True)]" in text


@needs_slurm
def test_a_timeout_shows_every_ranks_stack_on_both_nodes(slurm_kernel, allocation):
    _ok(slurm_kernel.execute("""
import time, nblaunch
def stuck():
    import torch, torch.distributed as dist
    if dist.get_rank() == 2:
        time.sleep(120)   # never joins
    t = torch.ones(1)
    dist.all_reduce(t)
"""))
    r = slurm_kernel.execute("nblaunch.notebook_launcher(stuck, num_processes=2, cluster='slurm', timeout=8, "
                             "display='text')")
    assert r.error is not None and r.error["ename"] == "LaunchTimeout", r.error
    text = "\n".join(r.error["traceback"])
    assert "node 0 (n1)" in text and "node 1 (n2)" in text, text
    assert re.search(r"rank 2: in stuck at ", text), text  # the rank that never joined, where it was
    assert re.search(r"rank 3: in all_reduce at ", text), text  # its node's other rank, waiting for it
    _nothing_left(allocation)


@needs_slurm
def test_the_root_cause_on_node_2_is_named_with_its_node_and_traceback(slurm_kernel, allocation):
    _ok(slurm_kernel.execute("""
import time, nblaunch
def fn():
    import torch, torch.distributed as dist
    if dist.get_rank() == 3:
        time.sleep(0.5)
        raise ValueError("bad shard on the second node")
    t = torch.ones(1)
    dist.all_reduce(t)   # ranks 0-2 wait here for rank 3
"""))
    t0 = time.monotonic()
    r = slurm_kernel.execute("nblaunch.notebook_launcher(fn, num_processes=2, cluster='slurm', display='text')")
    took = time.monotonic() - t0
    assert r.error is not None and r.error["ename"] == "WorkerError"
    tb = "\n".join(r.error["traceback"])
    assert "rank 3 on n2 raised ValueError: bad shard on the second node" in tb
    assert 'raise ValueError("bad shard on the second node")' in tb  # its own traceback
    assert took < 60  # loose: the others were stopped, not left to gloo's 30-minute timeout


@needs_slurm
def test_live_ranks_keep_state_across_cells_on_both_nodes(slurm_kernel, allocation):
    _ok(slurm_kernel.execute("""
import os, nblaunch
ranks = nblaunch.start(2, cluster="slurm", display="text")
def setup():
    global step, host
    import torch.distributed as dist
    step, host = 10 * dist.get_rank(), os.environ["SLURMD_NODENAME"]
"""))
    _ok(slurm_kernel.execute("ranks.run(setup)"))
    _ok(slurm_kernel.execute("def bump():\n    global step\n    step += 1\n    return (step, host)"))
    _ok(slurm_kernel.execute("ranks.run(bump)"))
    text = _ok(slurm_kernel.execute("print(ranks.run(bump, display='none')); print(ranks.pull('step'))"))
    assert "[(2, 'n1'), (12, 'n1'), (22, 'n2'), (32, 'n2')]" in text
    assert "[2, 12, 22, 32]" in text
    # A failure on node 2 interrupts the others' calls and keeps every rank.
    r = slurm_kernel.execute("""
def fail_on_3():
    import time, torch.distributed as dist
    if dist.get_rank() == 3:
        raise RuntimeError("live failure on n2")
    time.sleep(60)
ranks.run(fail_on_3)""")
    tb = "\n".join(r.error["traceback"]) if r.error else ""
    assert "rank 3 on n2 raised RuntimeError: live failure on n2" in tb, tb
    assert "The live ranks are still up and keep their state" in tb, tb
    text = _ok(slurm_kernel.execute("print(ranks.run(bump, display='none')); print(ranks.status)"))
    assert "[(3, 'n1'), (13, 'n1'), (23, 'n2'), (33, 'n2')]" in text, text
    assert "up: 4 ranks" in text
    _ok(slurm_kernel.execute("ranks.close()"))
    _nothing_left(allocation)


@needs_slurm
def test_the_stop_button_stops_every_node(slurm_kernel, allocation):
    msg = slurm_kernel.execute_async("""
import time, nblaunch
def spin():
    print("spinning", flush=True)
    while True:
        time.sleep(0.01)
nblaunch.notebook_launcher(spin, num_processes=2, cluster="slurm", display="text")""")
    seen = ""
    deadline = time.monotonic() + 120
    while seen.count("spinning") < 4 and time.monotonic() < deadline:
        seen += slurm_kernel.wait_for_output("spinning", timeout=120)
    slurm_kernel.km.interrupt_kernel()
    r = slurm_kernel.wait_for_reply(msg, timeout=60)
    assert r.error is not None and r.error["ename"] == "KeyboardInterrupt"
    _nothing_left(allocation)


@needs_slurm
def test_a_nodes_agent_sleeps_while_its_ranks_are_quiet(slurm_kernel, allocation):
    """While the ranks send nothing, a node's agent wakes about once a second
    (its resource sample), not 20 times (it polled every 50 ms): counted by
    the agent's main thread's voluntary context switches, from its rank."""
    text = _ok(slurm_kernel.execute("""
import time, nblaunch
def agent_wakes():
    import psutil
    agent = psutil.Process().parent().parent()  # rank <- zygote <- agent
    assert "nblaunch.engines.agent" in " ".join(agent.cmdline())
    def switches():
        with open(f"/proc/{agent.pid}/task/{agent.pid}/status") as f:
            return int(next(line for line in f if line.startswith("voluntary_ctxt_switches")).split()[1])
    time.sleep(1.0)  # the launch's own traffic is over
    before = switches()
    time.sleep(3.0)
    return switches() - before
print("wakes", list(nblaunch.notebook_launcher(agent_wakes, num_processes=1, cluster="slurm", display="none")))"""))
    wakes = [int(w) for w in re.search(r"wakes \[([\d, ]+)\]", text).group(1).split(",")]
    assert all(w <= 12 for w in wakes), wakes  # 3 s: ~3 samples (it was ~60)


@needs_slurm
def test_scancel_of_the_agents_step_is_a_clear_failure_naming_the_node(slurm_kernel, allocation):
    msg = slurm_kernel.execute_async("""
import time, nblaunch
def wait():
    print("waiting", flush=True)
    time.sleep(120)
nblaunch.notebook_launcher(wait, num_processes=1, cluster="slurm", display="text")""")
    slurm_kernel.wait_for_output("waiting", timeout=120)
    steps = subprocess.run(["squeue", "-h", "-s", "-j", allocation, "-o", "%i %j"], capture_output=True,
                           text=True, timeout=20).stdout.split("\n")
    step = [line.split()[0] for line in steps if "nblaunch" in line]
    assert step, steps
    subprocess.run(["scancel", step[0]], check=True, timeout=20)
    r = slurm_kernel.wait_for_reply(msg, timeout=60)
    assert r.error is not None and r.error["ename"] == "WorkerError"
    tb = "\n".join(r.error["traceback"])
    assert re.search(r"node \d \(n\d\) was ended by SLURM \(.*CANCELLED", tb), tb
    _nothing_left(allocation)


@needs_slurm
def test_a_killed_kernel_leaves_nothing_on_any_node(allocation):
    k = Kernel(extra_env={"SLURM_JOB_ID": allocation})
    try:
        k.execute_async("""
import time, nblaunch
def wait():
    print("waiting", flush=True)
    time.sleep(120)
nblaunch.notebook_launcher(wait, num_processes=2, cluster="slurm", display="text")""")
        k.wait_for_output("waiting", timeout=120)
        assert len([p for p in _agents(allocation) if p.name() != "srun"]) == 2 + 2 + 4  # agents, their zygotes, ranks
        os.kill(k.pid, signal.SIGKILL)
        t0 = time.monotonic()
        _nothing_left(allocation, timeout=15)
        assert time.monotonic() - t0 < 15
    finally:
        k.shutdown()


@needs_slurm
def test_asking_slurm_for_an_allocation_gives_it_back(kernel):
    text = _ok(kernel.execute("""
import os, nblaunch
os.environ.pop("SLURM_JOB_ID", None)
def host():
    return os.environ["SLURMD_NODENAME"], os.environ["SLURM_JOB_ID"]
out = nblaunch.notebook_launcher(host, num_processes=1, cluster=nblaunch.Slurm(nodes=2), display="text")
print([h for h, _ in out], "job", out[0][1])"""))
    assert "['n1', 'n2']" in text
    job = re.search(r"job (\d+)", text).group(1)
    assert job not in _held(), f"the allocation nblaunch asked for ({job}) is still held"
    _nothing_left(job)


def test_outside_an_allocation_the_error_says_how_to_get_one(monkeypatch):
    import nblaunch
    from nblaunch.errors import LaunchError

    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    with pytest.raises(LaunchError) as info:
        nblaunch.notebook_launcher(print, num_processes=1, cluster="slurm")
    message = str(info.value)
    assert "Slurm(nodes=2" in message or "`srun` command" in message
    with pytest.raises(ValueError, match="cluster must be"):
        nblaunch.notebook_launcher(print, num_processes=1, cluster="kubernetes")
    with pytest.raises(ValueError, match="rdzv_endpoint and node_rank"):
        nblaunch.notebook_launcher(print, num_processes=1, cluster="slurm", rdzv_endpoint="h:1")


def test_the_agents_port_refuses_a_wrong_or_missing_secret_and_lets_the_right_one_in(caplog):
    """The listener with real sockets: a peer with the wrong secret, one that
    says nothing, one that sends a pickle at once; then the real agent."""
    import socket

    from nblaunch.wire import link

    secret = link.new_secret()
    listener = link.Listener("127.0.0.1", secret)
    try:
        with pytest.raises(AuthenticationError):
            Client(listener.address, authkey=b"not the secret")
        silent = socket.create_connection(listener.address)  # holds its own handshake, nobody else's
        rude = socket.create_connection(listener.address)
        rude.sendall(b"\x00\x00\x00\x10" + b"cos\nsystem\n(S'x'\ntR.")  # a pickle, before any proof
        good = link.connect(listener.address, secret)
        good.send({"node": 0})
        got = listener.get(10)
        assert got is not None and got[1] == {"node": 0}
        deadline = time.monotonic() + 10
        while len(listener.refused) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(listener.refused) >= 2  # the wrong secret and the pickle
        assert any("refused a connection" in rec.getMessage() for rec in caplog.records)
        got[0].close()
        good.close()
        silent.close()
        rude.close()
    finally:
        listener.close()


@needs_slurm
def test_a_function_from_the_notebooks_own_module_reaches_nodes_that_cannot_import_it(slurm_kernel, allocation,
                                                                                       tmp_path):
    """cloudpickle sends a module's function by reference; the module lives
    in a folder only the kernel has on its path. Its source goes with the
    launch; each agent installs it for its ranks."""
    (tmp_path / "shards.py").write_text("import os\n\ndef shard_of(n):\n"
                                        "    return int(os.environ['RANK']) * n, __name__\n")
    text = _ok(slurm_kernel.execute(f"""
import sys, nblaunch
sys.path.insert(0, {str(tmp_path)!r})
from shards import shard_of
print(list(nblaunch.notebook_launcher(shard_of, (10,), num_processes=1, cluster="slurm", display="none")))"""))
    assert "[(0, 'shards'), (10, 'shards')]" in text, text


@needs_slurm
def test_the_magic_starts_live_ranks_on_every_node(slurm_kernel, allocation):
    _ok(slurm_kernel.execute("%load_ext nblaunch"))
    assert "up: 4 ranks (slurm, gloo)" in _ok(slurm_kernel.execute("%nblaunch start -n 2 --cluster slurm"))
    _ok(slurm_kernel.execute("%%nblaunch\nimport os\nhost = os.environ['SLURMD_NODENAME']"))
    text = _ok(slurm_kernel.execute("%%nblaunch --display none\nprint(rank, host)"))  # the cell ran on every node
    assert "[rank 0] 0 n1" in text and "[rank 3] 3 n2" in text, text
    _ok(slurm_kernel.execute("%nblaunch stop"))
    _nothing_left(allocation)


@needs_slurm
def test_a_pending_allocation_is_shown_and_given_back_on_interrupt(slurm_kernel, allocation):
    """A request SLURM keeps pending (here: not to start before two minutes
    from now): the view says so and why; the stop button cancels it."""
    msg = slurm_kernel.execute_async("""
import os, nblaunch
os.environ.pop("SLURM_JOB_ID", None)
nblaunch.notebook_launcher(print, num_processes=1, display="text",
                           cluster=nblaunch.Slurm(nodes=2, extra_args=["--begin=now+120"]))""")
    seen = slurm_kernel.wait_for_output("PENDING", timeout=60)
    job = re.search(r"waiting for SLURM job (\d+): PENDING \((\w+)\)", seen)
    assert job and job.group(2) == "BeginTime", seen
    slurm_kernel.km.interrupt_kernel()
    r = slurm_kernel.wait_for_reply(msg, timeout=60)
    assert r.error is not None and r.error["ename"] == "KeyboardInterrupt"
    assert job.group(1) not in _held(), "the pending request was not cancelled"


@needs_slurm
def test_a_rank_on_node_2_is_debugged_from_the_cell_over_the_agents_link(slurm_kernel, allocation):
    from test_debugging import Session

    s = Session(slurm_kernel, ["p secret", "c"]).run("""
import nblaunch, torch, torch.distributed as dist
def train():
    secret = 40 + dist.get_rank()
    if dist.get_rank() == 3:
        breakpoint()
    dist.all_reduce(torch.ones(1))
    return secret
print('RESULT', nblaunch.notebook_launcher(train, num_processes=2, cluster='slurm', display='text'))
""")
    assert s.error is None, s.shown
    assert "RESULT [40, 41, 42, 43]" in s.stdout
    assert s.prompt_texts and all(p.startswith("rank 3 on n2 ") for p in s.prompt_texts), s.prompt_texts
    assert re.search(r"^43$", s.stdout, re.M)
    s = Session(slurm_kernel, []).run("""
def fail():
    secret = 40 + dist.get_rank()
    if dist.get_rank() == 2:
        raise ValueError(secret)
    dist.all_reduce(torch.ones(1))
nblaunch.notebook_launcher(fail, num_processes=2, cluster='slurm', display='text')
""")
    assert s.error["ename"] == "WorkerError"
    s = Session(slurm_kernel, ["p secret", "q"]).run("%debug")
    assert re.search(r"^42$", s.stdout, re.M), s.shown
    _nothing_left(allocation)
