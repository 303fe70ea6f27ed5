"""Nodes joined by torch's c10d rendezvous (``rdzv_endpoint``), one of them lost (issue 37):
three launcher processes on this machine, each its own node, one SIGKILLed mid-run. The
two still up stop their ranks at once and, with ``min_nodes=2``, run the next generation
on the two of them (``WORLD_SIZE``, ``RANK`` and ``TORCHELASTIC_RESTART_COUNT`` say so),
resuming from the torch.distributed.checkpoint the three saved (DCP reshards it)."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
import uuid

import psutil
import pytest

from nblaunch.config import LaunchConfig
from test_nodes import free_port, nodes  # noqa: F401 - nodes: the fixture (launchers, none left behind)

pytestmark = pytest.mark.long  # a node killed or frozen on purpose, minutes in all: pytest -m long

LOST_AFTER_S = 3  # NBLAUNCH_NODE_LOST_AFTER: seconds without a heartbeat (default 10)
RECOVERY_BOUND_S = 40.0


def _wait_for(what: str, found, timeout: float = 180.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = found()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"no {what} within {timeout:.0f} s")


def _store_host(procs: list, port: int) -> int:
    """The pid of the launcher that hosts the endpoint's store (it listens on its port)."""
    def listener():
        for p in procs:
            try:
                conns = psutil.Process(p.pid).net_connections("tcp")
            except psutil.Error:
                continue
            if any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port for c in conns):
                return p.pid
        return None
    return _wait_for("launcher listening on the endpoint", listener, 60)


def _three_nodes(nodes, tmp_path) -> int:
    """Three launchers of the ``dcp`` scenario (max_restarts=1, min_nodes=2) joined by a c10d
    rendezvous; the pid of the one hosting its store."""
    port = free_port()
    endpoint, rdzv_id = f"127.0.0.1:{port}", uuid.uuid4().hex
    extra = {"args": [str(tmp_path)], "num_processes": 1, "num_nodes": 3, "max_restarts": 1, "min_nodes": 2}
    for _ in range(3):
        nodes.start("dcp", endpoint, "c10d", rdzv_id, extra=extra, env={"NBLAUNCH_NODE_LOST_AFTER": str(LOST_AFTER_S)})
    return _store_host(nodes.procs, port)


def _outcome(p: subprocess.Popen, timeout: float) -> tuple[dict, str]:
    stdout, stderr = p.communicate(timeout=timeout)
    line = [x for x in stdout.splitlines() if x.startswith("RESULT ")]
    assert line, f"a node printed no result (rc {p.returncode}):\n{stdout}\n{stderr}"
    return json.loads(line[-1][len("RESULT "):]), stdout + stderr


def test_a_lost_node_stops_the_others_and_the_two_still_up_resume_from_the_three_nodes_checkpoint(
        nodes, tmp_path):  # noqa: F811
    host = _three_nodes(nodes, tmp_path)
    _wait_for("checkpoint of the three nodes", lambda: (tmp_path / "latest").exists())
    # Not the node that hosts the rendezvous store: without it the others could not meet again.
    lost = next(p for p in reversed(nodes.procs) if p.pid != host)
    t_lost = time.time()
    os.kill(lost.pid, signal.SIGKILL)
    up = [p for p in nodes.procs if p is not lost]
    outcomes = [_outcome(p, 180) for p in up]
    lost.wait(10)
    firsts = [json.loads((tmp_path / f"first-1-{r}").read_text()) for r in (0, 1)]
    recovery = max(f["time"] for f in firsts) - t_lost

    assert lost.returncode == -signal.SIGKILL
    assert sorted(f.name for f in tmp_path.glob("first-0-*")) == ["first-0-0", "first-0-1", "first-0-2"]
    assert not (tmp_path / "first-1-2").exists()  # the second generation has two ranks
    ranks = [r for res, _ in outcomes for r in res.get("results", [])]
    assert len(ranks) == 2, outcomes
    assert sorted(r["RANK"] for r in ranks) == [0, 1]
    for r in ranks:
        assert (r["restart"], r["WORLD_SIZE"], r["GROUP_WORLD_SIZE"]) == (1, 2, 2)
        assert r["resumed_at"] >= 4 and r["resumed_at"] % 4 == 0  # from the last whole save of the three
        assert (r["step"], r["mean"], r["rows"]) == (60, 60.0, 6)  # 12 rows: 4 a rank saved, 6 a rank loaded
    for _, text in outcomes:
        assert re.search(r"restart 1 of 1: node [0-2] lost at step \d+; 2 nodes, 2 ranks", text), text
    assert recovery < RECOVERY_BOUND_S, f"the survivors' first step came {recovery:.1f} s after the loss"
    entered = max(f["entered"] for f in firsts) - t_lost
    print(f"kill -> the survivors' first step: {recovery:.1f} s (their fn called, process group made: {entered:.1f} s)")


def test_when_the_node_hosting_the_rendezvous_store_is_lost_the_others_say_the_run_cannot_go_on(
        nodes, tmp_path):  # noqa: F811
    host = _three_nodes(nodes, tmp_path)
    _wait_for("every node's first step", lambda: len(list(tmp_path.glob("first-0-*"))) == 3)
    t_lost = time.monotonic()
    os.kill(host, signal.SIGKILL)
    outcomes = [_outcome(p, 120) for p in nodes.procs if p.pid != host]
    took = time.monotonic() - t_lost
    for res, text in outcomes:
        assert res["error"] == "WorkerError", text
        assert "and with it the rendezvous store it hosted" in res["text"], res["text"]
        assert "the run cannot go on, with or without min_nodes" in res["text"], res["text"]
        assert "restart 1 of 1" not in text  # no restart was tried
    assert not list(tmp_path.glob("first-1-*"))
    assert took < 30, f"the nodes still up took {took:.0f} s to give up"


@pytest.mark.parametrize("kwargs, message", [
    ({"num_nodes": 3, "rdzv_backend": "static", "node_rank": 0}, "min_nodes needs rdzv_backend='c10d'"),
    ({"num_nodes": 1}, "on one machine there is no node to lose"),
    ({"num_nodes": 3, "min_nodes": 4}, "between 1 and the number of nodes (3)"),
])
def test_min_nodes_is_refused_where_nothing_could_go_on_before_any_process_starts(kwargs, message):
    kwargs = {"rdzv_endpoint": "127.0.0.1:29400", "max_restarts": 1, "min_nodes": 2} | kwargs
    if kwargs["num_nodes"] == 1:
        del kwargs["rdzv_endpoint"]
    with pytest.raises(ValueError, match=re.escape(message)):
        LaunchConfig(1, **kwargs)


def test_min_nodes_is_kept_for_nodes_joined_by_the_c10d_rendezvous(monkeypatch):
    c = LaunchConfig(1, num_nodes=3, rdzv_endpoint="127.0.0.1:29400", max_restarts=1, min_nodes=2)
    assert (c.min_nodes, c.rdzv_backend) == (2, "c10d")
    monkeypatch.setenv("NBLAUNCH_NODE_LOST_AFTER", "soon")
    with pytest.raises(ValueError, match="NBLAUNCH_NODE_LOST_AFTER must be a number of seconds"):
        LaunchConfig(1, num_nodes=3, rdzv_endpoint="127.0.0.1:29400", max_restarts=1, min_nodes=2)


def test_a_frozen_node_is_lost_after_node_lost_after_and_the_two_still_up_go_on(nodes, tmp_path):  # noqa: F811
    """The same loss, but nothing closes: the launcher and its ranks SIGSTOPped (a hung machine,
    a partition), ``node_lost_after`` given to the launch (no environment variable). Thawed
    once the others are done, the node ends and leaves nothing."""
    port = free_port()
    endpoint, rdzv_id = f"127.0.0.1:{port}", uuid.uuid4().hex
    extra = {"args": [str(tmp_path)], "num_processes": 1, "num_nodes": 3, "max_restarts": 1, "min_nodes": 2,
             "node_lost_after": LOST_AFTER_S}
    for _ in range(3):
        nodes.start("dcp", endpoint, "c10d", rdzv_id, extra=extra)
    host = _store_host(nodes.procs, port)
    _wait_for("checkpoint of the three nodes", lambda: (tmp_path / "latest").exists())
    lost = next(p for p in reversed(nodes.procs) if p.pid != host)
    frozen = [lost.pid] + [c.pid for c in psutil.Process(lost.pid).children(recursive=True)]
    t_lost = time.time()
    for pid in frozen:
        os.kill(pid, signal.SIGSTOP)
    try:
        outcomes = [_outcome(p, 180) for p in nodes.procs if p is not lost]
    finally:
        for pid in frozen:
            os.kill(pid, signal.SIGCONT)
    firsts = [json.loads((tmp_path / f"first-1-{r}").read_text()) for r in (0, 1)]
    recovery = max(f["time"] for f in firsts) - t_lost
    ranks = [r for res, _ in outcomes for r in res.get("results", [])]
    assert sorted((r["RANK"], r["WORLD_SIZE"], r["restart"]) for r in ranks) == [(0, 2, 1), (1, 2, 1)], outcomes
    for _, text in outcomes:
        assert re.search(r"restart 1 of 1: node [0-2] lost at step \d+; 2 nodes, 2 ranks", text), text
    assert recovery < RECOVERY_BOUND_S, f"the survivors' first step came {recovery:.1f} s after the freeze"
    lost.communicate(timeout=60)  # thawed, it ends on its own
    assert not [pid for pid in frozen if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]
    print(f"freeze -> the survivors' first step: {recovery:.1f} s")


def test_a_launcher_started_again_is_taken_back_and_the_run_is_on_three_nodes_again(nodes, tmp_path):  # noqa: F811
    """Issue 48 on nodes joined by c10d: three launchers with ``min_nodes=2``, one SIGKILLed; the
    two still up go on; the same launcher started again (same ``rdzv_endpoint`` and ``rdzv_id``)
    knocks at their next round, and once it has waited ``node_back_after`` every rank gets the
    notice (``resize: ... is back``), saves and returns, and the three go on from the checkpoint.
    The resize is not counted against ``max_restarts``."""
    port = free_port()
    endpoint, rdzv_id = f"127.0.0.1:{port}", uuid.uuid4().hex
    extra = {"args": [str(tmp_path)], "num_processes": 1, "num_nodes": 3, "max_restarts": 1, "min_nodes": 2,
             "node_lost_after": LOST_AFTER_S, "node_back_after": 2, "preempt_grace": 20}
    for _ in range(3):
        nodes.start("grow", endpoint, "c10d", rdzv_id, extra=extra)
    host = _store_host(nodes.procs, port)
    _wait_for("the three nodes' first step", lambda: len(list(tmp_path.glob("first-a-*"))) == 3)
    _wait_for("a checkpoint", lambda: (tmp_path / "ckpt").exists())
    lost = next(p for p in reversed(nodes.procs) if p.pid != host)
    os.kill(lost.pid, signal.SIGKILL)
    lost.wait(10)
    _wait_for("the two nodes' first step", lambda: len(list(tmp_path.glob("first-b-*"))) == 2)
    t_again = time.time()
    nodes.start("grow", endpoint, "c10d", rdzv_id, extra=extra)  # the same launch, started again
    again = nodes.procs[-1]
    _wait_for("the three nodes' first step again", lambda: len(list(tmp_path.glob("first-c-*"))) == 3, 120)
    grown = max(json.loads(f.read_text())["time"] for f in tmp_path.glob("first-c-*")) - t_again
    outcomes = [_outcome(p, 120) for p in nodes.procs if p is not lost]

    ranks = [r for res, _ in outcomes for r in res.get("results", [])]
    assert sorted(r["RANK"] for r in ranks) == [0, 1, 2], outcomes
    assert all(r["phase"] == "c" and r["world"] == 3 and r["step"] == 200 for r in ranks), ranks
    starts = {json.loads(f.read_text())["start"] for f in tmp_path.glob("first-c-*")}
    assert len(starts) == 1 and starts.pop() > json.loads((tmp_path / "first-b-0").read_text())["start"] > 0
    notices = {(tmp_path / f"notice-b-{r}").read_text() for r in (0, 1)}
    assert len(notices) == 1 and re.fullmatch(r"resize: 127\.0\.0\.1 \(pid \d+\) is back", notices.pop()), notices
    for p, (res, text) in zip([p for p in nodes.procs if p is not lost], outcomes):
        if p is again:  # its own first generation: no restart of its own (torchrun's count is per agent too)
            assert [r["restart"] for r in res["results"]] == [0], res
        else:
            assert re.search(r"restart 1 of 1: node [0-2] lost at step \d+; 2 nodes, 2 ranks", text), text
            assert re.search(r"restart 2 of 2: 127\.0\.0\.1 \(pid \d+\) back; 3 nodes, 3 ranks", text), text
    print(f"started again -> the three nodes' first step: {grown:.1f} s (node_back_after=2)")
