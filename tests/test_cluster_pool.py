"""The kernel's side of a cluster launch (``cluster.AgentPool``) against
scripted agents: threads that connect over the real authenticated channel
and send what a node's agent would. No process is started; each test takes
well under a second. What the real agents do is tested on real SLURM and
Ray clusters (test_slurm.py, test_ray.py)."""
from __future__ import annotations

import threading

import pytest

from nblaunch.wire import agent_messages as msg, link
from nblaunch.wire.beats import Beats
from nblaunch.wire.channel import RELEASE, Interrupt, Started
from nblaunch.engines.agent_pool import AgentPool
from nblaunch.engines.agent_engine import AgentStep
from nblaunch.config import LaunchConfig
from nblaunch.engines.pool import Exited, Lines, Lost, Message

pytestmark = pytest.mark.timeout(60)


class _Agents(AgentStep):
    """The engine's handle on the scripted agents."""

    what = "scripted agents"

    def poll(self):
        return None

    def output(self) -> str:
        return ""

    def news(self) -> str:
        return ""

    def end(self, timeout: float) -> None:
        pass


class ScriptedEngine:
    """Two nodes; each agent connects, says hello, takes its setup, reports
    its ranks started, then sends ``script[node]`` and records every verb
    the kernel sends it until ``close``."""

    num_nodes = 2
    reach = "127.0.0.1"

    def __init__(self, script: dict, answers: dict | None = None, hang_up: tuple = ()):
        self.script, self.answers, self.hang_up = script, answers or {}, hang_up
        self.received: dict[int, list] = {0: [], 1: []}
        self.setups: dict[int, dict] = {}
        self.threads: list[threading.Thread] = []

    def allocate(self, notice, tick) -> None:
        pass

    def start_agents(self, env: dict, log_path: str) -> _Agents:
        host, port = env[link.ADDRESS_ENV].rsplit(":", 1)
        secret = bytes.fromhex(env[link.SECRET_ENV])
        for node in range(self.num_nodes):
            t = threading.Thread(target=self._agent, args=(node, (host, int(port)), secret), daemon=True)
            t.start()
            self.threads.append(t)
        return _Agents()

    def _agent(self, node: int, address, secret: bytes) -> None:
        conn = link.connect(address, secret)
        conn.send(msg.Hello(node, f"host{node}", "127.0.0.1", 0, 0, False))
        beat_link = link.connect(address, secret)  # the heartbeats' own link, as a real agent's
        beat_link.send(msg.BeatLink(node))
        beats = Beats(30.0)
        beats.add("kernel", beat_link)
        try:
            self._serve(node, conn)
        finally:
            beats.stop()

    def _serve(self, node: int, conn) -> None:
        setup = conn.recv()
        assert isinstance(setup, msg.Setup) and setup.placement.node_rank == node
        self.setups[node] = setup
        conn.send(msg.RanksStarted("/nowhere"))
        for message in self.script.get(node, []):
            conn.send(message)
        if node in self.hang_up:
            conn.close()
            return
        while True:
            try:
                message = conn.recv()
            except EOFError:
                return
            self.received[node].append(message)
            if isinstance(message, msg.Ask):
                conn.send(msg.Relayed([Lines(0, [f"said while answering {message.what}"])]))
                conn.send(msg.Reply(message.rid, self.answers.get(message.what)))
            if isinstance(message, msg.Close):
                conn.close()
                return


def _pool(engine, job=None) -> AgentPool:
    config = LaunchConfig(2, cluster="slurm", display="none")
    pool = AgentPool(config, engine, job=job)
    pool.start()
    return pool


def _all_events(pool: AgentPool, want: int) -> list:
    got: list = []
    for _ in range(100):
        got += pool.poll(0.05)
        if len(got) >= want:
            break
    return got


def test_a_nodes_events_carry_the_ranks_number_in_the_whole_job():
    engine = ScriptedEngine({1: [msg.Relayed([Lines(0, ["hello from node 1"]),
                                              Message(1, Started(1, 4242, 0.0)),
                                              Exited(1, 0)])]})
    pool = _pool(engine)
    try:
        got = _all_events(pool, 3)
        assert got[0] == Lines(2, ["hello from node 1"])  # node 1's local rank 0 is rank 2
        assert got[1] == Message(3, Started(3, 4242, 0.0))  # and the event inside says so too
        assert got[2] == Exited(3, 0)
        assert pool.started(3) and pool.exit_seen(3) and not pool.exit_seen(2)
        assert pool.node(3) == 1 and pool.host(3) == "host1" and pool.tail(2) == ("hello from node 1",)
        assert (pool.log_dir / "rank2.log").read_text() == "hello from node 1\n"
    finally:
        pool.close()


def test_an_engine_ending_a_node_is_that_nodes_failure_before_its_ranks_deaths():
    why = "was ended by SIGTERM, sent to its agent by the engine"
    engine = ScriptedEngine({1: [msg.Bye(why), msg.Relayed([Exited(0, -15), Exited(1, -15)])]}, hang_up=(1,))
    pool = _pool(engine)
    try:
        got = _all_events(pool, 4)
        assert got[:2] == [Lost(2, f"(host1) {why}"), Lost(3, f"(host1) {why}")]
        assert got[2:4] == [Exited(2, -15), Exited(3, -15)]
        assert not pool.up_now(2) and pool.up_now(0)
    finally:
        pool.close()


def test_an_agent_that_vanishes_loses_its_ranks_still_up():
    engine = ScriptedEngine({0: [msg.Relayed([Exited(0, 0)])]}, hang_up=(0,))
    pool = _pool(engine)
    try:
        got = _all_events(pool, 3)
        assert got[0] == Exited(0, 0)  # it had ended: nothing more to say of it
        assert got[1:] == [Lost(1, "(host0) was lost: its agent connection closed"), Exited(1, -9)]
    finally:
        pool.close()


def test_an_answer_is_awaited_and_what_came_meanwhile_is_kept_in_order():
    engine = ScriptedEngine({}, answers={"stacks": "  rank 0: in all_reduce", "collectives": {0: "all_reduce"}})
    pool = _pool(engine)
    try:
        text = pool.stacks([0, 2])
        assert "node 0 (host0):\n  rank 0: in all_reduce" in text and "node 1 (host1):" in text
        assert pool.collectives([1]) == {0: "all_reduce"}
        got = _all_events(pool, 3)
        assert [item.lines for item in got] == [["said while answering stacks"]] * 2 + [
            ["said while answering collectives"]]
        assert [item.rank for item in got] == [0, 2, 0]
    finally:
        pool.close()


def test_verbs_reach_the_node_of_the_rank_and_release_stays_on_the_node():
    engine = ScriptedEngine({})
    pool = _pool(engine)
    try:
        assert pool.send(3, "a message")
        assert pool.send(2, RELEASE)  # the agent released the rank when it fetched the result
        pool.interrupt(1, "call 4")
        pool.signal(15, [0, 3])
    finally:
        pool.close()
    for t in engine.threads:
        t.join(5)
    assert engine.received[1][:2] == [msg.Deliver(1, "a message"), msg.SignalRanks(15, [1])]
    assert engine.received[0][:2] == [msg.Deliver(1, Interrupt("call 4")), msg.SignalRanks(15, [0])]
    assert all(not isinstance(m, msg.Deliver) or m.message != RELEASE for node in engine.received.values() for m in node)
    assert engine.received[0][-1] == msg.Close() and engine.received[1][-1] == msg.Close()


def test_tensors_in_a_launchs_job_travel_in_its_bytes_not_as_shared_memory_handles():
    """A handle to this machine's shared memory means nothing on another node.
    The cluster engine packs the job once, before any node is asked for."""
    import torch

    from nblaunch.engines.slurm import SlurmEngine

    weights = torch.full((10_000,), 7.0)
    job = SlurmEngine.__new__(SlurmEngine).job(torch.sum, (weights,), {})  # job() needs no allocation
    assert job.size > weights.nbytes  # what the launch's notice of a large job reads
    engine = ScriptedEngine({})
    pool = _pool(engine, job=job)
    try:
        data = engine.setups[1].job._data
        assert len(data) > weights.nbytes  # the tensor's 40 kB are in the bytes
        fn, args, kwargs = engine.setups[1].job.load()
        assert fn(*args).item() == 70_000.0
    finally:
        pool.close()
