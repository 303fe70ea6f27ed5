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
from conftest import wait_gone

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
              prefix=()):
        env = dict(os.environ, NODE_TEST_PIDS=str(self.pids), PYTHONPATH=str(ROOT))
        args = [*prefix, sys.executable, str(SCRIPT), scenario, endpoint, backend, rdzv_id or "t",
                "-" if node_rank is None else str(node_rank), json.dumps(extra or {})]
        self.procs.append(subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                           text=True))

    def results(self, timeout=120.0) -> list[dict]:
        out = []
        for p in self.procs:
            stdout, stderr = p.communicate(timeout=timeout)
            line = [x for x in stdout.splitlines() if x.startswith("RESULT ")]
            assert line, f"a node printed no result (rc {p.returncode}):\n{stdout}\n{stderr}"
            out.append(json.loads(line[-1][len("RESULT "):]) | {"stderr": stderr})
        return out

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
