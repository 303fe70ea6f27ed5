"""Ranks on the nodes of a real Ray cluster (issue 27).

A two-node cluster on this machine (``tests/ray_cluster.py``), started once
for this module, with the tests' kernels, in a network namespace of its own
whose only interface is loopback (where one can be made: root and
iproute2): nothing of it is reachable from outside. Marked ``ray``: the README's test command leaves them
out (Ray is a 240 MB extra, ``pip install -e '.[ray]'``), ``.ci/run`` runs
them (``pytest -m ray``). Without Ray they skip, unless
``NBLAUNCH_REQUIRE_RAY`` is set (CI), when they fail.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import time

import psutil
import pytest

import ray_cluster
from conftest import Kernel

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]

try:
    import ray  # noqa: F401
    _WHY_NOT = ""
except ImportError:
    _WHY_NOT = "Ray is not installed (pip install -e '.[ray]')"
if _WHY_NOT and os.environ.get("NBLAUNCH_REQUIRE_RAY"):
    raise RuntimeError(f"NBLAUNCH_REQUIRE_RAY is set, but {_WHY_NOT}")
if _WHY_NOT:
    pytest.skip(_WHY_NOT, allow_module_level=True)

NETNS = f"nblaunch-ray-{os.getpid()}"


@pytest.fixture(scope="module")
def netns():
    """The namespace the cluster and the kernels run in (None: the host's network)."""
    if not ray_cluster.make_netns(NETNS):
        yield None
        return
    try:
        yield NETNS
    finally:
        ray_cluster.drop_netns(NETNS)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, netns):
    """``address`` of a fresh two-node Ray cluster, loopback only in its own
    namespace where one can be made; stopped afterwards."""
    address = ray_cluster.start(str(tmp_path_factory.mktemp("ray")), netns)
    try:
        yield address
    finally:
        ray_cluster.stop()


def _ours() -> list[psutil.Process]:
    """Agents and ranks (forked agents: the same command line) and agent
    actors of Ray launches, zombies aside. They are Ray's children, not the
    test's."""
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            cmd = " ".join(p.info["cmdline"] or [])
            if p.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            # A Ray agent (and its ranks) has the node index the actor gave it; a SLURM one does not.
            if "_AgentActor" in cmd or ("nblaunch.engines.agent" in cmd and "NBLAUNCH_NODE" in p.environ()):
                found.append(p)
        except psutil.Error:
            pass
    return found


def _nothing_left(timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while _ours() and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [f"{p.pid} {' '.join(p.cmdline())[:120]}" for p in _ours()]
    assert not left, f"agents, actors or ranks left: {left}"


@pytest.fixture
def ray_kernel(cluster, netns):
    k = Kernel(netns=netns)
    try:
        _ok(k.execute(f"import ray\nray.init(address={cluster!r}, log_to_driver=False)", timeout=120))
        yield k
    finally:
        k.shutdown()
        _nothing_left()


def _ok(result) -> str:
    assert result.error is None, "\n".join(result.error["traceback"])
    return result.text


def test_ranks_run_on_both_ray_nodes_with_the_kernels_environment(ray_kernel):
    text = _ok(ray_kernel.execute("""
import os, signal, nblaunch
os.environ["FROM_THE_NOTEBOOK"] = "yes"
def where():
    import torch, torch.distributed as dist
    t = torch.ones(1)
    dist.all_reduce(t)
    print(f"rank {dist.get_rank()} here", flush=True)
    return (dist.get_rank(), int(os.environ["NODE_RANK"]), t.item(), os.environ.get("FROM_THE_NOTEBOOK"),
            signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, []))
out = nblaunch.notebook_launcher(where, num_processes=2, cluster="ray", display="text")
print(list(out))"""))
    # Ray workers do not inherit the driver's environment, and block SIGINT for their children:
    # the ranks have the notebook's variable and an unblocked SIGINT.
    assert "[(0, 0, 4.0, 'yes', False), (1, 0, 4.0, 'yes', False), (2, 1, 4.0, 'yes', False), " \
           "(3, 1, 4.0, 'yes', False)]" in text, text
    for rank in range(4):
        assert f"[rank {rank}] rank {rank} here" in text


def test_the_root_cause_on_the_second_node_is_named(ray_kernel):
    _ok(ray_kernel.execute("""
import time, nblaunch
def fn():
    import torch, torch.distributed as dist
    if dist.get_rank() == 3:
        time.sleep(0.5)
        raise ValueError("bad shard on the second node")
    t = torch.ones(1)
    dist.all_reduce(t)
"""))
    r = ray_kernel.execute("nblaunch.notebook_launcher(fn, num_processes=2, cluster='ray', display='text')")
    assert r.error is not None and r.error["ename"] == "WorkerError"
    tb = "\n".join(r.error["traceback"])
    # Ray's nodes share this host's name, so a node is named by host and Ray node id
    assert re.search(r"rank 3 on [\w.-]+:[0-9a-f]{6} raised ValueError: bad shard on the second node", tb), tb
    assert 'raise ValueError("bad shard on the second node")' in tb


def test_live_ranks_on_ray_keep_state_and_the_stop_button_works(ray_kernel):
    _ok(ray_kernel.execute("""
import time, nblaunch
ranks = nblaunch.start(2, cluster="ray", display="text")
def setup():
    global count
    count = 0
def bump():
    global count
    count += 1
    return count
def spin():
    print("spinning", flush=True)
    while True:
        time.sleep(0.01)
"""))
    _ok(ray_kernel.execute("ranks.run(setup)"))
    _ok(ray_kernel.execute("ranks.run(bump)"))
    assert "[2, 2, 2, 2]" in _ok(ray_kernel.execute("print(ranks.run(bump, display='none'))"))
    msg = ray_kernel.execute_async("ranks.run(spin)")
    ray_kernel.wait_for_output("spinning", timeout=60)
    time.sleep(0.5)  # every rank in its loop (the output of one is enough to know the call began)
    ray_kernel.km.interrupt_kernel()
    r = ray_kernel.wait_for_reply(msg, timeout=60)
    assert r.error is not None and r.error["ename"] == "KeyboardInterrupt"
    text = _ok(ray_kernel.execute("print(ranks.run(bump, display='none')); print(ranks.status)"))
    assert "[3, 3, 3, 3]" in text, text  # interrupted, and every rank kept its state
    _ok(ray_kernel.execute("ranks.close()"))
    _nothing_left()


def test_a_dead_actor_is_a_failure_naming_its_node(ray_kernel):
    msg = ray_kernel.execute_async("""
import time, nblaunch
def wait():
    print("waiting", flush=True)
    time.sleep(120)
nblaunch.notebook_launcher(wait, num_processes=1, cluster="ray", display="text")""")
    ray_kernel.wait_for_output("waiting", timeout=120)
    actors = [p for p in _ours() if "_AgentActor" in " ".join(p.cmdline())]
    assert len(actors) == 2, [p.cmdline() for p in _ours()]
    actors[1].kill()  # the actor process dies (an OOM kill, a node going away)
    r = ray_kernel.wait_for_reply(msg, timeout=60)
    assert r.error is not None and r.error["ename"] == "WorkerError", r.error
    assert re.search(r"node \d \([^)]+\) was (lost|ended by SIG)", "\n".join(r.error["traceback"])), r.error
    _nothing_left()


def test_a_killed_kernel_leaves_no_actor_agent_or_rank(cluster, netns):
    k = Kernel(netns=netns)
    try:
        k.execute_async(f"""
import ray, time, nblaunch
ray.init(address={cluster!r}, log_to_driver=False)
def wait():
    print("waiting", flush=True)
    time.sleep(120)
nblaunch.notebook_launcher(wait, num_processes=2, cluster="ray", display="text")""")
        k.wait_for_output("waiting", timeout=120)
        assert len(_ours()) >= 2 + 2 + 4  # actors, agents, ranks
        os.kill(k.pid, signal.SIGKILL)
        _nothing_left(timeout=30)
    finally:
        k.shutdown()


def test_without_a_cluster_the_error_is_clear(monkeypatch):
    import nblaunch
    from nblaunch.errors import LaunchError

    with pytest.raises((LaunchError, ConnectionError)) as info:
        nblaunch.notebook_launcher(print, num_processes=1, cluster=nblaunch.Ray(address="127.0.0.1:9"))
    assert "127.0.0.1:9" in str(info.value) or "Ray" in str(info.value)


def test_a_function_from_a_module_only_the_kernel_can_import_reaches_the_ray_nodes(ray_kernel, tmp_path):
    """Ray workers start elsewhere and share no path with the notebook:
    the module's source travels with the launch."""
    (tmp_path / "steps.py").write_text("def double(x):\n    return 2 * x\n")
    text = _ok(ray_kernel.execute(f"""
import sys, nblaunch
sys.path.insert(0, {str(tmp_path)!r})
from steps import double
print(list(nblaunch.notebook_launcher(double, (21,), num_processes=1, cluster="ray", display="none")))"""))
    assert "[42, 42]" in text, text


def test_the_cluster_is_reachable_only_inside_its_namespace(cluster, netns):
    """Its traffic stays on this machine: loopback in a namespace of its own."""
    import socket

    if netns is None:
        pytest.skip("no network namespace here (needs root and iproute2): the cluster used the host's address")
    host, port = cluster.rsplit(":", 1)
    assert host == "127.0.0.1", cluster  # Ray found no other interface to bind
    with pytest.raises(OSError):  # this test runs outside the namespace: its loopback has no such port
        socket.create_connection((host, int(port)), timeout=5).close()


def test_a_rank_on_the_second_ray_node_is_debugged_from_the_cell(ray_kernel):
    from test_debugging import Session

    s = Session(ray_kernel, ["p secret", "c"]).run("""
import nblaunch, torch, torch.distributed as dist
def train():
    secret = 40 + dist.get_rank()
    if dist.get_rank() == 2:
        breakpoint()
    dist.all_reduce(torch.ones(1))
    return secret
print('RESULT', nblaunch.notebook_launcher(train, num_processes=2, cluster='ray', display='text'))
""")
    assert s.error is None, s.shown
    assert "RESULT [40, 41, 42, 43]" in s.stdout
    assert s.prompt_texts and all(re.match(r"rank 2 on \S+ ", p) for p in s.prompt_texts), s.prompt_texts
    assert re.search(r"^42$", s.stdout, re.M)


# --- a long run (issue 37): these two add nodes to the module's cluster, so they come last ---

STEPPER = """
import json, os, time, nblaunch
def stepper(folder, steps=30):
    import torch, torch.distributed as dist
    restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    bar = nblaunch.progress(total=steps, desc="train")
    t = torch.ones(1)
    for step in range(steps):
        dist.all_reduce(t)
        bar.update(1)
        if step == 0:
            open(os.path.join(folder, f"first-{restart}-{rank}"), "w").close()
        if restart == 0 and step >= 3:
            time.sleep(0.2)  # the first generation waits to be cut short
    return (restart, rank, world)
"""


def _wait_files(folder, prefix: str, n: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while len([f for f in os.listdir(folder) if f.startswith(prefix)]) < n:
        assert time.monotonic() < deadline, os.listdir(folder)
        time.sleep(0.05)


def test_a_lost_ray_node_restarts_the_run_on_the_nodes_still_up(cluster, netns, tmp_path_factory, tmp_path):
    """min_nodes=2 on three Ray nodes: the third node dies (its raylet and
    everything under it SIGKILLed), and the next generation runs on the two
    still up, WORLD_SIZE 2."""
    raylet = ray_cluster.add_node(cluster, str(tmp_path_factory.mktemp("ray3")), netns)
    lost = ray_cluster.node_id(raylet)
    k = Kernel(netns=netns)
    try:
        _ok(k.execute(f"import ray\nray.init(address={cluster!r}, log_to_driver=False)\n" + STEPPER, timeout=120))
        msg = k.execute_async(f"res = nblaunch.notebook_launcher(stepper, ({str(tmp_path)!r},), num_processes=1, "
                              "cluster=nblaunch.Ray(nodes=3), max_restarts=1, min_nodes=2, display='text')\n"
                              "print(list(res))")
        _wait_files(tmp_path, "first-0-", 3)
        ray_cluster.kill_node(raylet)
        text = _ok(k.wait_for_reply(msg, timeout=180))
        assert "[(1, 0, 2), (1, 1, 2)]" in text, text
        assert re.search(rf"restart 1 of 1: node \S+:{lost[:6]} lost at step \d+; 2 nodes, 2 ranks", text), text
    finally:
        k.shutdown()
        _nothing_left()


PREEMPTED = """
import os, time, nblaunch
def until_preempted(folder):
    import torch.distributed as dist
    open(os.path.join(folder, f"up-{dist.get_rank()}"), "w").close()
    step = 0
    while not nblaunch.preempted(agree=True):
        step += 1
        time.sleep(0.05)
    return (dist.get_rank(), step)
"""


def test_a_ray_node_being_drained_for_preemption_lets_every_rank_save_and_return(cluster, netns, tmp_path_factory,
                                                                                 tmp_path):
    """What Ray's autoscaler does before a spot node is reclaimed (here
    ``ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION``): a notice to
    every rank on every node, which agree on a step and return."""
    raylet = ray_cluster.add_node(cluster, str(tmp_path_factory.mktemp("ray4")), netns)
    drained = ray_cluster.node_id(raylet)
    k = Kernel(netns=netns)
    try:
        _ok(k.execute(f"import ray\nray.init(address={cluster!r}, log_to_driver=False)\n" + PREEMPTED, timeout=120))
        msg = k.execute_async(f"res = nblaunch.notebook_launcher(until_preempted, ({str(tmp_path)!r},), "
                              "num_processes=1, cluster=nblaunch.Ray(nodes=3), display='text')\nprint(list(res))")
        _wait_files(tmp_path, "up-", 3)
        inside = ["ip", "netns", "exec", netns] if netns else []
        subprocess.run([*inside, ray_cluster.RAY, "drain-node", f"--address={cluster}", f"--node-id={drained}",
                        "--reason=DRAIN_NODE_REASON_PREEMPTION", "--reason-message=spot reclaim",
                        "--deadline-remaining-seconds=60"], check=True, timeout=60, capture_output=True)
        text = _ok(k.wait_for_reply(msg, timeout=120))
        found = re.findall(r"\((\d), (\d+)\)", text)
        assert [r for r, _ in found] == ["0", "1", "2"] and len({s for _, s in found}) == 1, text
        assert f"preempted (a drain to Ray node {drained[:6]}, " in text, text
    finally:
        k.shutdown()
        _nothing_left()
        ray_cluster.kill_node(raylet)


RAY_STEPS = """
import os, time, nblaunch
def steps(folder, n=3000):
    import torch, torch.distributed as dist
    bar = nblaunch.progress(total=n, desc="train")
    t = torch.ones(1)
    for step in range(n):
        dist.all_reduce(t)
        bar.update(1)
        if step == 5:
            open(os.path.join(folder, f"at-{dist.get_rank()}"), "w").close()
        time.sleep(0.05)
"""
RAY_LOST_AFTER_S = 2  # below the cluster's own health checks (3 missed at 1 s): the heartbeats, not Ray, name it


def test_a_frozen_ray_node_is_named_within_node_lost_after(cluster, netns, tmp_path_factory, tmp_path):
    """A third Ray node frozen whole (its raylet and every worker under it, the agent's actor,
    the agent and its rank SIGSTOPped): nothing closes, yet the launch names it within
    ``node_lost_after`` and stops the others; thawed, it leaves nothing of the launch."""
    raylet = ray_cluster.add_node(cluster, str(tmp_path_factory.mktemp("ray5")), netns)
    k = Kernel(netns=netns)
    stopped: list = []
    try:
        _ok(k.execute(f"import ray\nray.init(address={cluster!r}, log_to_driver=False)\n" + RAY_STEPS, timeout=120))
        msg = k.execute_async(f"nblaunch.notebook_launcher(steps, ({str(tmp_path)!r},), num_processes=1, "
                              f"cluster=nblaunch.Ray(nodes=3), node_lost_after={RAY_LOST_AFTER_S}, timeout=600, "
                              "display='none')")
        _wait_files(tmp_path, "at-", 3)
        stopped = [raylet, *raylet.children(recursive=True)]
        assert any("_AgentActor" in " ".join(p.cmdline()) for p in stopped), [p.cmdline() for p in stopped]
        for p in stopped:
            p.suspend()
        t0 = time.monotonic()
        r = k.wait_for_reply(msg, timeout=120)
        named = time.monotonic() - t0
        assert r.error is not None and r.error["ename"] == "WorkerError", r.text
        tb = "\n".join(r.error["traceback"])
        assert re.search(rf"node \d \([^)]+\) stopped answering: no heartbeat for {RAY_LOST_AFTER_S} s "
                         r"\(its ranks were at step \d+\)", tb), tb
        assert named < RAY_LOST_AFTER_S + 12, f"named {named:.1f} s after the freeze"
        print(f"named {named:.1f} s after the freeze")
    finally:
        for p in stopped:
            try:
                p.resume()
            except psutil.Error:
                pass
        try:
            k.shutdown()
            _nothing_left(timeout=30)
        finally:  # thawed, the raylet reads that Ray declared its node dead and exits: what is left goes
            for p in stopped or [raylet]:
                try:
                    p.kill()
                except psutil.Error:
                    pass
            psutil.wait_procs(stopped or [raylet], timeout=10)


GROWER = """
import os, time, nblaunch
def grower(folder, steps=900):
    import torch, torch.distributed as dist
    restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.ones(1)
    for step in nblaunch.progress(range(20 if restart == 2 else steps), desc="train"):
        dist.all_reduce(t)
        if step == 0:
            open(os.path.join(folder, f"first-{restart}-{rank}"), "w").close()
        if nblaunch.preempted(agree=True):
            with open(os.path.join(folder, f"notice-{restart}-{rank}"), "w") as f:
                f.write(nblaunch.preempt_reason())
            return (restart, rank, world, "resized")
        time.sleep(0.1)
    return (restart, rank, world)
"""


def test_a_ray_node_that_joins_after_a_loss_is_taken_and_the_run_is_on_three_nodes_again(
        cluster, netns, tmp_path_factory, tmp_path):
    """min_nodes=2 on three Ray nodes: the third dies, the run goes on on two; a node joins the
    cluster (``ray start``, as a machine rebooted or the autoscaler's replacement would), and
    once it has stayed alive for ``node_back_after`` every rank gets the notice (``resize: ...
    is back``), returns, and ``fn`` is called again on three nodes (issue 48)."""
    raylet = ray_cluster.add_node(cluster, str(tmp_path_factory.mktemp("ray6")), netns)
    k = Kernel(netns=netns)
    joined = None
    try:
        _ok(k.execute(f"import ray\nray.init(address={cluster!r}, log_to_driver=False)\n" + GROWER, timeout=120))
        msg = k.execute_async(f"res = nblaunch.notebook_launcher(grower, ({str(tmp_path)!r},), num_processes=1, "
                              "cluster=nblaunch.Ray(nodes=3), max_restarts=1, min_nodes=2, node_back_after=3, "
                              "preempt_grace=20, display='text')\nprint(list(res)); print(res.restarts)")
        _wait_files(tmp_path, "first-0-", 3)
        ray_cluster.kill_node(raylet)
        _wait_files(tmp_path, "first-1-", 2)
        t_join = time.monotonic()
        joined = ray_cluster.add_node(cluster, str(tmp_path_factory.mktemp("ray7")), netns)
        _wait_files(tmp_path, "first-2-", 3, timeout=180)
        grown = time.monotonic() - t_join
        text = _ok(k.wait_for_reply(msg, timeout=180))
        new = ray_cluster.node_id(joined)[:6]
        assert "[(2, 0, 3), (2, 1, 3), (2, 2, 3)]" in text, text
        notices = [open(tmp_path / f"notice-1-{r}").read() for r in range(2)]
        assert all(re.fullmatch(rf"resize: \S+:{new} is back", n) for n in notices), notices
        assert re.search(rf"restart 2 of 2: \S+:{new} back; 3 nodes, 3 ranks", text), text
        print(f"on three nodes again {grown:.1f} s after `ray start` of the new node (node_back_after=3)")
    finally:
        k.shutdown()
        _nothing_left()
        if joined is not None:
            ray_cluster.kill_node(joined)
