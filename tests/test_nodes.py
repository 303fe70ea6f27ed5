"""Several "nodes" on this machine: separate launcher processes that meet
through torch.distributed's elastic rendezvous, as they would on two machines."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

import nblaunch
from conftest import matrix, wait_gone

SCRIPT = Path(__file__).with_name("node_launch.py")
ROOT = Path(__file__).resolve().parents[1]


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class Nodes:
    """Start node launchers; collect what each printed; check their ranks are gone."""

    def __init__(self, tmp_path: Path):
        self.pids = tmp_path / "rank-pids"
        self.procs: list[subprocess.Popen] = []

    def start(self, scenario, endpoint, backend="c10d", rdzv_id=None, node_rank=None, extra=None,
              prefix=(), env=None):
        env = dict(os.environ, NODE_TEST_PIDS=str(self.pids), PYTHONPATH=str(ROOT), **(env or {}))
        args = [*prefix, sys.executable, str(SCRIPT), scenario, endpoint, backend, rdzv_id or "t",
                "-" if node_rank is None else str(node_rank), json.dumps(extra or {})]
        self.procs.append(subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                           text=True))

    def results(self, timeout=120.0) -> list[dict]:
        return [self.result(p, timeout) for p in self.procs]

    @staticmethod
    def result(p: subprocess.Popen, timeout: float) -> dict:
        """What node ``p`` printed, once it ended (``left``: what the hooks
        found in its process after the launch, when it ran under them)."""
        stdout, stderr = p.communicate(timeout=timeout)
        line = [x for x in stdout.splitlines() if x.startswith("RESULT ")]
        assert line, f"a node printed no result (rc {p.returncode}):\n{stdout}\n{stderr}"
        left = [json.loads(x[len("LEFT "):]) for x in stdout.splitlines() if x.startswith("LEFT ")]
        return json.loads(line[-1][len("RESULT "):]) | {"stderr": stderr, "left": left[-1] if left else None}

    def rank_pids(self) -> list[int]:
        return [int(x) for x in self.pids.read_text().split()] if self.pids.exists() else []

    def kill(self):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.fixture
def nodes(tmp_path):
    n = Nodes(tmp_path)
    yield n
    n.kill()
    assert wait_gone(n.rank_pids()) == [], "a rank outlived its node's launcher"


def check_all_reduce(results):
    by_node = sorted(results, key=lambda r: r["results"][0]["GROUP_RANK"])
    for node, res in enumerate(by_node):
        assert not res["cuda_initialized"]
        ranks = res["results"]
        assert [r["RANK"] for r in ranks] == [2 * node, 2 * node + 1]  # local ranks' results, in order
        assert [r["LOCAL_RANK"] for r in ranks] == [0, 1]
        for r in ranks:
            assert r["sum"] == 1 + 2 + 3 + 4  # every rank's all_reduce saw all four
            assert (r["WORLD_SIZE"], r["LOCAL_WORLD_SIZE"], r["GROUP_WORLD_SIZE"]) == (4, 2, 2)
            assert r["NODE_RANK"] == r["GROUP_RANK"] == node
            assert r["rank"] == r["RANK"] and r["world"] == 4


def test_two_nodes_c10d_all_reduce(nodes):
    endpoint = f"127.0.0.1:{free_port()}"
    rdzv_id = uuid.uuid4().hex
    nodes.start("ok", endpoint, "c10d", rdzv_id)
    nodes.start("ok", endpoint, "c10d", rdzv_id)
    results = nodes.results()
    check_all_reduce(results)
    for res in results:  # a clean run leaves the cell clean: no C++ store warnings
        assert "TCPStore" not in res["stderr"] and "Traceback" not in res["stderr"], res["stderr"]


def test_two_nodes_static_with_node_ranks(nodes):
    endpoint = f"127.0.0.1:{free_port()}"
    nodes.start("ok", endpoint, "static", "s", node_rank=1)  # node 1 first: it waits for node 0
    nodes.start("ok", endpoint, "static", "s", node_rank=0)
    check_all_reduce(nodes.results())


def test_a_failure_on_one_node_is_raised_on_both_naming_it(nodes):
    endpoint = f"127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    nodes.start("raise", endpoint, "c10d", "f")
    nodes.start("raise", endpoint, "c10d", "f")
    results = nodes.results()
    elapsed = time.monotonic() - t0
    for res in results:
        assert res["error"] == "WorkerError", res
        assert (res["rank"], res["node"]) == (3, 1)
        assert res["text"].startswith("rank 3 (node 1) raised ValueError: rank three gives up")
        assert 'raise ValueError("rank three gives up")' in res["text"]  # rank 3's own traceback
    # Both would otherwise wait out gloo's 30-minute collective timeout.
    assert elapsed < 60, f"the failure took {elapsed:.0f} s to surface"


def test_restart_after_a_failure_runs_every_node_again(nodes):
    endpoint = f"127.0.0.1:{free_port()}"
    nodes.start("flaky", endpoint, "c10d", "r", extra={"max_restarts": 1})
    nodes.start("flaky", endpoint, "c10d", "r", extra={"max_restarts": 1})
    results = nodes.results()
    check_all_reduce(results)
    assert all(r["restart"] == 1 for res in results for r in res["results"])


def test_an_interrupt_on_one_node_stops_the_other(nodes):
    endpoint = f"127.0.0.1:{free_port()}"
    nodes.start("forever", endpoint, "static", "i", node_rank=0)
    nodes.start("forever", endpoint, "static", "i", node_rank=1)
    deadline = time.monotonic() + 60
    while len(nodes.rank_pids()) < 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(nodes.rank_pids()) == 4, "the ranks never started"
    nodes.procs[0].send_signal(signal.SIGINT)  # the user presses stop on node 0
    interrupted, other = nodes.results(timeout=60)
    assert interrupted["error"] == "KeyboardInterrupt"
    assert other["error"] == "WorkerError"
    assert other["text"].startswith("node 0 was interrupted; its ranks were stopped"), other["text"]


# A node launcher run under hooks (pass ``hooked(...)`` to ``Nodes.start``):
# files in $NODE_TEST_MARKS say where its rendezvous is ("joining": a join has
# begun; "formed": every node has joined and node 0 is about to say where the
# ranks' store is; "joined": this node's join has returned), and it waits for
# a file "go" at the point $NODE_TEST_HOLD names ("formed" or "joined"). After
# the launch it prints what the launch left in its process, as a kernel lives
# on: threads still in a rendezvous, sockets still listening.
HOOKS = r"""
import gc, json, os, pathlib, runpy, sys, threading, time
import psutil
import nblaunch.engines.nodes as nodes

marks = pathlib.Path(os.environ["NODE_TEST_MARKS"])
join, host_store = nodes.NodeGroup.join, nodes.host_store

def mark(name):
    (marks / name).touch()
    while os.environ.get("NODE_TEST_HOLD") == name and not (marks / "go").exists():
        time.sleep(0.01)

def marked_join(self, attempt):
    mark("joining")
    placement = join(self, attempt)
    mark("joined")
    return placement

def marked_host_store(*args, **kwargs):
    mark("formed")
    return host_store(*args, **kwargs)

nodes.NodeGroup.join, nodes.host_store = marked_join, marked_host_store
sys.argv = sys.argv[2:]  # [python, node_launch.py, ...] -> node_launch.py's own
runpy.run_path(sys.argv[0], run_name="__main__")
gc.collect()
me = psutil.Process()
conns = me.net_connections("tcp") if hasattr(me, "net_connections") else me.connections("tcp")
print("LEFT " + json.dumps({
    "threads": [t.name for t in threading.enumerate() if t.name == "nblaunch-join"],
    "listening": sorted(c.laddr.port for c in conns if c.status == psutil.CONN_LISTEN)}), flush=True)
"""
# The launcher of an interrupted node ends within this (the hangs this guards
# against lasted the rendezvous timeout, 300 s by default).
INTERRUPTED_ENDS_S = 45.0
NOTHING_LEFT = {"threads": [], "listening": []}


def hooked(marks: Path, hold: str = "") -> dict:
    marks.mkdir()
    return {"prefix": (sys.executable, "-c", HOOKS), "env": {"NODE_TEST_MARKS": str(marks), "NODE_TEST_HOLD": hold}}


def wait_for(path: Path, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert path.exists(), f"{path.name!r} never came"


def interrupt(nodes: Nodes, p: subprocess.Popen) -> dict:
    """The user presses stop on node ``p``: its launcher must end soon, raise
    KeyboardInterrupt, and leave nothing in its process."""
    p.send_signal(signal.SIGINT)
    try:
        res = nodes.result(p, timeout=INTERRUPTED_ENDS_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the interrupted launcher had not ended {INTERRUPTED_ENDS_S:g} s after the interrupt")
    assert res["error"] == "KeyboardInterrupt", res
    assert res["left"] == NOTHING_LEFT, res["left"]
    return res


@pytest.mark.parametrize("backend,node_rank", [("static", 0), *matrix(("static", 1)), ("c10d", None)])
def test_an_interrupt_while_waiting_for_the_other_node_ends_the_launch_and_its_rendezvous(
        nodes, tmp_path, backend, node_rank):
    """"waiting for 2 nodes to join", the other node not there: as the host
    of the endpoint (static node 0, c10d), or as a node that waits for it."""
    endpoint = f"127.0.0.1:{free_port()}"
    nodes.start("forever", endpoint, backend, uuid.uuid4().hex, node_rank=node_rank,
                **hooked(tmp_path / "marks"))
    wait_for(tmp_path / "marks" / "joining")
    interrupt(nodes, nodes.procs[0])


def test_an_interrupt_while_node_0_is_yet_to_say_where_the_ranks_store_is(nodes, tmp_path):
    """Every node has joined; node 0 is slow to host the ranks' store, and
    node 1, waiting for its address, is interrupted. Node 1 ends at once, and
    node 0, once it goes on, is told that node 1 left."""
    endpoint = f"127.0.0.1:{free_port()}"
    nodes.start("forever", endpoint, "static", "h", node_rank=0, **hooked(tmp_path / "marks0", hold="formed"))
    nodes.start("forever", endpoint, "static", "h", node_rank=1, **hooked(tmp_path / "marks1"))
    wait_for(tmp_path / "marks0" / "formed")
    interrupt(nodes, nodes.procs[1])
    (tmp_path / "marks0" / "go").touch()
    other = nodes.result(nodes.procs[0], timeout=60)
    assert other["error"] in ("LaunchError", "WorkerError"), other
    assert "node 1 " in other["text"], other["text"]
    assert other["left"] == NOTHING_LEFT, other["left"]


def test_an_interrupt_as_the_rendezvous_ends_stops_the_node_whose_ranks_started(nodes, tmp_path):
    """Both joins are done and node 0's ranks are starting; node 1 is
    interrupted before its own ranks get their place. Node 0 is told that
    node 1 left, instead of its ranks waiting for node 1's until their
    process group's timeout."""
    endpoint = f"127.0.0.1:{free_port()}"
    nodes.start("forever", endpoint, "static", "j", node_rank=0, **hooked(tmp_path / "marks0"))
    nodes.start("forever", endpoint, "static", "j", node_rank=1, **hooked(tmp_path / "marks1", hold="joined"))
    wait_for(tmp_path / "marks0" / "joined")
    wait_for(tmp_path / "marks1" / "joined")
    nodes.procs[1].send_signal(signal.SIGINT)
    (tmp_path / "marks1" / "go").touch()  # its join returns as the interrupt is handled
    interrupted = nodes.result(nodes.procs[1], timeout=INTERRUPTED_ENDS_S)
    assert interrupted["error"] == "KeyboardInterrupt", interrupted
    assert interrupted["left"] == NOTHING_LEFT, interrupted["left"]
    other = nodes.result(nodes.procs[0], timeout=60)
    assert other["error"] == "WorkerError", other
    assert other["text"].startswith("node 1 left before its ranks were done"), other["text"]
    assert other["left"] == NOTHING_LEFT, other["left"]


@pytest.mark.parametrize("backend,delay", [("static", 0.0), *matrix(("static", 0.3), ("static", 1.0), ("static", 2.0)),
                                           ("c10d", 0.3), *matrix(("c10d", 1.0))])
def test_an_interrupt_at_any_moment_of_the_gathering_ends_every_node(nodes, tmp_path, backend, delay):
    """Both nodes start together; the first is interrupted ``delay`` s after
    its join began: before the other has arrived, while they meet, or as the
    ranks start. Each moment must end both launches (the other with an error,
    at the latest after its rdzv_timeout if the first left before it came),
    with nothing left behind."""
    endpoint = f"127.0.0.1:{free_port()}"
    rdzv_id, extra = uuid.uuid4().hex, {"rdzv_timeout": 10}
    ranks = (0, 1) if backend == "static" else (None, None)
    nodes.start("forever", endpoint, backend, rdzv_id, node_rank=ranks[0], extra=extra,
                **hooked(tmp_path / "marks0"))
    nodes.start("forever", endpoint, backend, rdzv_id, node_rank=ranks[1], extra=extra,
                **hooked(tmp_path / "marks1"))
    wait_for(tmp_path / "marks0" / "joining")
    time.sleep(delay)  # the moment; whichever it is, the same must hold
    interrupt(nodes, nodes.procs[0])
    other = nodes.result(nodes.procs[1], timeout=60)
    assert other["error"] in ("LaunchError", "WorkerError"), other
    assert other["left"] == NOTHING_LEFT, other["left"]


@pytest.mark.parametrize("backend,node_rank", [("c10d", None), ("static", 0)])
def test_a_node_that_never_comes_is_named_after_rdzv_timeout(nodes, backend, node_rank):
    endpoint = f"127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    nodes.start("ok", endpoint, backend, "m", node_rank=node_rank, extra={"rdzv_timeout": 3})
    (res,) = nodes.results()
    assert res["error"] == "LaunchError"
    assert "1 of 2 nodes joined" in res["text"], res["text"]
    assert "within 3 s" in res["text"]
    assert time.monotonic() - t0 < 60


@pytest.mark.skipif(not sys.platform.startswith("linux") or shutil.which("ip") is None,
                    reason="network namespaces are Linux's (iproute2)")
def test_two_nodes_on_their_own_network_addresses(nodes, tmp_path):
    """Two network namespaces joined by a veth pair: each node has only its own
    address (no shared loopback), so nothing may assume 127.0.0.1."""
    tag = uuid.uuid4().hex[:6]
    ns = [f"nbl{tag}a", f"nbl{tag}b"]
    addrs = ["10.213.7.1", "10.213.7.2"]
    setup = [
        ["ip", "netns", "add", ns[0]], ["ip", "netns", "add", ns[1]],
        ["ip", "link", "add", f"v{tag}a", "type", "veth", "peer", "name", f"v{tag}b"],
        ["ip", "link", "set", f"v{tag}a", "netns", ns[0]], ["ip", "link", "set", f"v{tag}b", "netns", ns[1]],
    ]
    for i, name in enumerate(ns):
        dev = f"v{tag}{'ab'[i]}"
        setup += [["ip", "-n", name, "addr", "add", f"{addrs[i]}/24", "dev", dev],
                  ["ip", "-n", name, "link", "set", dev, "up"], ["ip", "-n", name, "link", "set", "lo", "up"]]
    try:
        for cmd in setup:
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                pytest.skip(f"cannot make network namespaces here: {' '.join(cmd)}: {done.stderr.strip()}")
        endpoint = f"{addrs[0]}:29400"
        for name in ns:
            nodes.start("ok", endpoint, "c10d", "netns", prefix=("ip", "netns", "exec", name))
        check_all_reduce(nodes.results())
    finally:
        for name in ns:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


@pytest.mark.parametrize("kwargs,message", [
    ({"num_nodes": 2}, "needs rdzv_endpoint"),
    ({"num_nodes": 2, "rdzv_endpoint": "127.0.0.1"}, "must be 'host:port'"),
    ({"num_nodes": 2, "rdzv_endpoint": "127.0.0.1:99999"}, "must be 'host:port'"),
    ({"num_nodes": 2, "rdzv_endpoint": "127.0.0.1:29500", "rdzv_backend": "static"}, "needs node_rank"),
    ({"num_nodes": 2, "rdzv_endpoint": "127.0.0.1:29500", "node_rank": 2}, "node_rank must be"),
    ({"num_nodes": 2, "rdzv_endpoint": "127.0.0.1:29500", "rdzv_backend": "etcd"}, "rdzv_backend must be"),
    ({"num_nodes": 2, "rdzv_endpoint": "127.0.0.1:29500", "rdzv_timeout": 0}, "rdzv_timeout must be"),
    ({"num_nodes": 0}, "num_nodes must be"),
    ({"rdzv_endpoint": "127.0.0.1:29500"}, "give num_nodes > 1"),
    ({"max_restarts": -1}, "max_restarts must be"),
    ({"num_nodes": 2, "rdzv_endpoint": "no-such-host.invalid:29500"}, "cannot be reached"),
])
def test_bad_node_arguments_fail_before_any_process_starts(kwargs, message):
    with pytest.raises(ValueError, match=message):
        nblaunch.notebook_launcher(print, num_processes=2, display="none", **kwargs)
