"""A rank pool whose ranks run on the nodes of a cluster engine (SLURM, Ray).

The engine starts one agent per node (:mod:`nblaunch.engines.agent`); each agent
starts its node's ranks and relays between them and this pool over the
authenticated channel (:mod:`nblaunch.wire.link`). To the call watch this is a
rank pool like any other: ranks are numbered ``0..world_size-1`` (node
``i`` holds ``i * num_processes`` on), every rank's output, events and exit
arrive through :meth:`AgentPool.poll`, and the verbs go to the agent of the
rank's node. A node whose agent's connection closes, that the engine
ended, or that stopped answering (no heartbeat for the launch's lost-after
time, :mod:`nblaunch.wire.beats`: it is told it was dropped, should it come
back, and its links are closed) is a :class:`~nblaunch.engines.pool.Lost`
for each of its ranks still up.

The kernel hosts the ranks' TCPStore on the address it uses to reach the
nodes, and the agents' listener beside it; both exist only as long as the
pool.
"""
from __future__ import annotations

import dataclasses
import itertools
import signal
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Optional

from ..wire import agent_messages as msg, link
from ..wire.beats import Beats
from ..wire.channel import RELEASE, Progress, Started
from ..errors import LaunchError
from .logs import new_launch_dir, release_launch_dir
from .nodes import Placement, host_store
from ..system.network import route_address
from ..wire.modules import local_sources
from .plan import resolve_backend
from .pool import TEARDOWN_WAIT_S, Exited, Lines, Lost, Message, RankFacts, RankPool

__all__ = ["AgentPool"]

AGENTS_START_S = 300.0  # srun to every agent connected (they import torch first)
REPLY_WAIT_S = 10.0  # an agent's answer (stacks take up to ~1 s)


@dataclass
class _Node:
    """A node, as the kernel knows it: its agent's connection and what it said."""

    node: int
    name: str
    conn: Connection
    open: bool = True
    started: bool = False  # its ranks are started
    why: str = ""  # why it ended, when it said


@dataclass
class _Rank(RankFacts):
    log: Any = None  # its output, as it arrives
    step: Optional[int] = None  # its progress bar's last count


class AgentPool(RankPool):
    """``engine.num_nodes`` nodes of ``config.num_processes`` ranks each.

    ``job`` is a launch's one call (a ``payload.PackedJob``, packed by the
    engine; None for live ranks, whose calls come by ``send``)."""

    def __init__(self, config, engine, job: Any = None, attempt: int = 0, live: bool = False, pg_timeout: float = 1800.0):
        self._config, self._engine, self._job, self._attempt, self._live = config, engine, job, attempt, live
        self._pg_timeout = pg_timeout
        self.per_node = config.num_processes
        self.size = engine.num_nodes * self.per_node
        self.log_dir, self.notice = new_launch_dir()
        self._ranks = self.facts = [_Rank(global_rank=r, node=r // self.per_node) for r in range(self.size)]
        self._agents: list[_Node] = []
        self._buffer: list = []  # events read while waiting for an answer, for the next poll
        self._replies: dict[int, Any] = {}
        self._usage: dict = {}
        self._ids = itertools.count(1)
        self._listener: Optional[link.Listener] = None
        self._step = None  # the engine's handle on the agents (poll, output, end)
        self._store = None
        self._beats: Optional[_NodeBeats] = None  # the heartbeats with every node's agent
        self.backend: Optional[str] = None  # decided at start, from every node's GPUs

    # -- starting ----------------------------------------------------------------

    def start(self, tick: Callable[[], None] = lambda: None) -> Placement:
        engine = self._engine
        # The kernel's address on the nodes' network (master_addr: the user's choice of it).
        host = self._config.master_addr or route_address(engine.reach, 1)
        secret = link.new_secret()
        self._listener = link.Listener(host, secret)
        lhost, lport = self._listener.address
        lost_after = self._config.lost_after
        self._beats = _NodeBeats(self, lost_after)
        self._step = engine.start_agents({link.ADDRESS_ENV: f"{lhost}:{lport}", link.SECRET_ENV: secret.hex(),
                                          "NBLAUNCH_NODE_LOST_AFTER": repr(float(lost_after))},
                                         str(self.log_dir / "agents.log"))
        hellos = self._gather(tick)
        backend = self.backend = _backend(self._config, hellos)
        self._store, port = host_store(lhost, self.size, self._pg_timeout)
        for r, rank in enumerate(self._ranks):  # before any rank can print: every line is kept
            rank.log = open(self.log_dir / f"rank{r}.log", "w", encoding="utf-8", buffering=1)
        sources = local_sources()  # the notebook's own modules, for nodes that cannot import them
        for agent, hello in zip(self._agents, hellos):
            placement = Placement(agent.node, len(self._agents), self.per_node, lhost, port)
            self._tell(agent, msg.Setup(self._config, self._live, self._job, placement, hello.addr, backend,
                                        self._attempt, sources))  # False: gone, said below
        waiting = {a.node for a in self._agents}
        deadline = time.monotonic() + AGENTS_START_S
        while waiting:
            for item in self._read(0.1):
                self._buffer.append(item)
            waiting -= {a.node for a in self._agents if a.started}
            gone = [a for a in self._agents if not a.open and not a.started]
            if gone:
                raise LaunchError(f"the agent on node {gone[0].node} ({gone[0].name}) ended before it started its "
                                  f"ranks; the agents' output:\n{_last_lines(self._step)}")
            self._check_step(deadline, "start their ranks")
            tick()
        self.placement = Placement(0, len(self._agents), self.per_node, lhost, port)
        return self.placement

    def _gather(self, tick: Callable[[], None]) -> "list[msg.Hello]":
        """Every node's agent connected and authenticated (both its links), in node order."""
        deadline = time.monotonic() + AGENTS_START_S
        got: dict[int, tuple] = {}
        beating: set = set()
        while len(got) < self._engine.num_nodes or len(beating) < self._engine.num_nodes:
            item = self._listener.get(0.1)
            if item is not None:
                conn, hello = item
                if isinstance(hello, msg.BeatLink) and hello.node not in beating:
                    beating.add(hello.node)
                    self._beats.beats.add(hello.node, conn)
                    continue
                if not isinstance(hello, msg.Hello) or hello.node in got:
                    conn.close()
                    continue
                got[hello.node] = (conn, hello)
            self._check_step(deadline, "connect")
            tick()
        self._listener.close()  # every agent is in: the port closes
        self._agents = [_Node(n, got[n][1].name, got[n][0]) for n in sorted(got)]
        return [got[n][1] for n in sorted(got)]

    def _check_step(self, deadline: float, what: str) -> None:
        code = self._step.poll()
        if code is not None:
            raise LaunchError(f"the agents ({self._step.what}) ended (code {code}) before every node's agent could "
                              f"{what}; their output:\n{_last_lines(self._step)}")
        if time.monotonic() > deadline:
            raise LaunchError(f"the nodes' agents did not {what} within {AGENTS_START_S:.0f} s; their output:\n"
                              f"{_last_lines(self._step)}")

    # -- reading -----------------------------------------------------------------

    def poll(self, timeout: float) -> list:
        if self.preempting is None and self._step is not None:
            self.preempting = self._step.preempting()
        out, self._buffer = self._buffer, []
        out += self._read(0 if out else timeout)
        return out

    def _read(self, timeout: float, only: Optional[_Node] = None) -> list:
        out: list = []
        self._drop_silent(out)
        agents = [a for a in ([only] if only else self._agents) if a.open]
        if not agents:
            time.sleep(timeout)
            return out
        by_conn = {a.conn: a for a in agents}
        for conn in wait(list(by_conn), timeout=timeout):
            agent = by_conn[conn]
            while agent.open and conn.poll(0):
                try:
                    message = conn.recv()
                except (EOFError, OSError):
                    self._lose(agent, out)
                    break
                self._beats.beats.heard(agent.node)
                self._take(agent, message, out)
        return out

    def _take(self, agent: _Node, message, out: list) -> None:
        """One message from ``agent`` (:mod:`nblaunch.wire.agent_messages`), in the order it sent them."""
        first = agent.node * self.per_node
        if isinstance(message, msg.Relayed):
            for item in message.items:
                item = _renumber(item, first + item.rank)
                rank = self._ranks[item.rank]
                if isinstance(item, Lines):
                    rank.tail.extend(item.lines)
                    if rank.log is not None:
                        rank.log.write("".join(line + "\n" for line in item.lines))
                elif isinstance(item, Message) and isinstance(item.event, Started):
                    rank.started = True
                elif isinstance(item, Message) and isinstance(item.event, Progress):
                    rank.step = item.event.n
                elif isinstance(item, Exited):
                    rank.exited = True
                out.append(item)
        elif isinstance(message, (msg.Heartbeat, msg.BeatLink)):
            pass  # on the heartbeat link (wire.beats); any message counts as one
        elif isinstance(message, msg.Reply):
            self._replies[message.rid] = message.value
        elif isinstance(message, msg.Usage):
            self._usage.update({first + local: u for local, u in message.by_rank.items()})
        elif isinstance(message, msg.RanksStarted):
            agent.started = True
        elif isinstance(message, msg.PreemptNotice):  # its cluster told the node's agent the job is ending
            self.preempting = self.preempting or (message.signal, f"the agent on {agent.name}")
        elif isinstance(message, msg.Bye):  # the engine is ending this node: that, not its ranks' deaths, is the news
            agent.why = message.why
            for r in range(first, first + self.per_node):
                if not self._ranks[r].exited:
                    out.append(Lost(r, f"({agent.name}) {agent.why}"))

    @property
    def lost_nodes(self) -> dict:
        return self._beats.lines if self._beats is not None else {}

    def _drop_silent(self, out: list) -> None:
        """Nodes the heartbeats found silent (told they were dropped, their heartbeat link
        closed): each of their ranks still up is lost, and their agent's connection closed."""
        for agent in self._agents:
            why = self._beats.silent.get(agent.node) if self._beats is not None else None
            if agent.open and why is not None:
                self._lose(agent, out, why)

    def _lose(self, agent: _Node, out: list, why: str = "") -> None:
        """The agent's connection closed (or it stopped answering, ``why``): each of its ranks still up is lost."""
        agent.open = False
        agent.conn.close()
        # What the engine said of an agent that vanished without a word (srun reports a SIGKILL)
        news = self._step.news() if self._step is not None else ""
        why = f"({agent.name}) {why or agent.why or news or 'was lost: its agent connection closed'}"
        first = agent.node * self.per_node
        for r in range(first, first + self.per_node):
            if not self._ranks[r].exited:
                self._ranks[r].exited = True
                out += [Lost(r, why), Exited(r, -signal.SIGKILL)]

    # -- telling -----------------------------------------------------------------

    def _agent_of(self, rank: int) -> _Node:
        return self._agents[rank // self.per_node]

    def _tell(self, agent: _Node, message) -> bool:
        if not agent.open:
            return False
        try:
            agent.conn.send(message)
            return True
        except (OSError, ValueError):
            return False

    def send(self, rank: int, message: Any) -> bool:
        if message == RELEASE:
            return True  # the agent released the rank when it fetched the result
        if rank // self.per_node >= len(self._agents):
            return False
        return self._tell(self._agent_of(rank), msg.Deliver(rank % self.per_node, message))

    def preempt(self, why: str) -> None:
        for agent in self._agents:
            self._tell(agent, msg.Preempt(why))

    def signal(self, sig: int, ranks: list[int]) -> None:
        for node, locals_ in _by_node(ranks, self.per_node, len(self._agents)).items():
            self._tell(self._agents[node], msg.SignalRanks(sig, locals_))

    def _request(self, node: int, what: str, ranks: Optional[list] = None) -> Any:
        """An agent's answer; what else it sends meanwhile is kept for the next poll."""
        agent, rid = self._agents[node], next(self._ids)
        if not self._tell(agent, msg.Ask(rid, what, list(ranks or []))):
            return None
        deadline = time.monotonic() + REPLY_WAIT_S
        while rid not in self._replies and agent.open and time.monotonic() < deadline:
            self._buffer += self._read(0.1, only=agent)
        return self._replies.pop(rid, None)

    # -- looking -----------------------------------------------------------------

    def _ask(self, what: str, ranks: list[int]) -> Any:
        """Each node's agent answers for its ranks; stacks come under a line naming the node."""
        if what == "collectives":
            found: dict = {}
            for node, locals_ in _by_node(ranks, self.per_node, len(self._agents)).items():
                found.update(self._request(node, what, locals_) or {})
            return found
        texts = []
        for node, locals_ in _by_node(ranks, self.per_node, len(self._agents)).items():
            text = self._request(node, what, locals_)
            agent = self._agents[node]
            texts.append(f"node {node} ({agent.name}):\n" + (text if text is not None else "  (its agent did not answer)"))
        return "\n".join(texts) or "  (no rank was running)"

    def host(self, rank: int) -> Optional[str]:
        return self._agents[rank // self.per_node].name if self._agents else None

    def up_now(self, rank: int) -> bool:
        return (not self._ranks[rank].exited and bool(self._agents) and self._agent_of(rank).open
                and rank // self.per_node not in self.lost_nodes)

    def gpu_devices(self) -> dict:
        return {}  # each node's agent samples its own

    def usage(self, sampler) -> Optional[dict]:
        usage, self._usage = self._usage, {}
        return usage or None

    # -- ending ------------------------------------------------------------------

    def wait(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while self._up() and time.monotonic() < deadline:
            self._buffer += self._read(0.05)
        return not self._up()

    def _up(self) -> list[int]:
        """Ranks that may still run: not exited, on a node whose agent is connected."""
        return [r for r, rank in enumerate(self._ranks) if not rank.exited
                and r // self.per_node < len(self._agents) and self._agents[r // self.per_node].open]

    def drain(self) -> list:
        for node, agent in enumerate(self._agents):
            if agent.open:
                self._request(node, "drain")
        out, self._buffer = self._buffer, []
        return out

    def _release(self) -> None:
        if self._beats is not None:
            self._beats.closing = True  # the agents' links close now: no node is lost by that
        try:
            for agent in self._agents:
                self._tell(agent, msg.Close())
            deadline = time.monotonic() + TEARDOWN_WAIT_S * 2
            for agent in self._agents:
                while agent.open and time.monotonic() < deadline:
                    self._read(0.05, only=agent)
        finally:
            for agent in self._agents:
                agent.conn.close()
            if self._beats is not None:
                self._beats.beats.stop()
            if self._listener is not None:
                self._listener.close()
            self._store = None
            if self._step is not None:
                self._step.end(TEARDOWN_WAIT_S)
            for rank in self._ranks:
                if rank.log is not None:
                    rank.log.close()
            release_launch_dir(self.log_dir)


class _NodeBeats:
    """The kernel's heartbeats with every node's agent (:mod:`nblaunch.wire.beats`) and the nodes
    they found lost, written by the heartbeat thread, even between calls: ``silent`` (node -> why,
    for the pool's next read) and ``lines`` (node -> the line naming it, handed to ``on_lost``)."""

    def __init__(self, pool: AgentPool, lost_after: float):
        self.pool = pool
        self.silent: dict[int, str] = {}
        self.lines: dict[int, str] = {}
        self.closing = False
        self.beats = Beats(lost_after, on_silent=self._silent, on_word=self._word)

    def _silent(self, node: int, seconds: float) -> msg.Dropped:
        """``node`` stood silent ``seconds``: noted, said, and it is told it was dropped."""
        first = node * self.pool.per_node
        self.silent[node] = _silence(seconds, self.pool.facts[first:first + self.pool.per_node])
        self._found(node, self.silent[node])
        return msg.Dropped(f"no heartbeat for {seconds:.0f} s")

    def _word(self, node: int, message) -> None:
        """``None``: the node's heartbeat link closed, its agent gone (the pool's next read says how)."""
        if message is None and not self.closing:
            self._found(node, "was lost: its agent's connection closed")

    def _found(self, node: int, why: str) -> None:
        agents = self.pool._agents
        if node in self.lines or node >= len(agents):
            return
        self.lines[node] = f"node {node} ({agents[node].name}) {why}"
        if self.pool.on_lost is not None:
            self.pool.on_lost(self.lines[node])


def _by_node(ranks, per_node: int, nodes: int) -> dict:
    """Node -> its local ranks among ``ranks`` (nodes past ``nodes``, whose agent never connected, left out)."""
    groups: dict = {}
    for r in ranks:
        if r // per_node < nodes:
            groups.setdefault(r // per_node, []).append(r % per_node)
    return groups


def _last_lines(step) -> str:
    """What the agents printed, the last 20 lines."""
    text = step.output() if step is not None else ""
    return "\n".join("  " + line for line in text.strip().splitlines()[-20:]) or "  (none)"


def _backend(config, hellos: "list[msg.Hello]") -> Optional[str]:
    """The process group's backend, by the rule a single machine uses, for
    the node with the fewest GPUs."""
    if not config.init_process_group:
        return None
    try:
        return resolve_backend(config.backend, config.num_processes, min(h.gpus for h in hellos),
                               all(h.nccl for h in hellos), where="on the node with the fewest")
    except ValueError as exc:
        raise LaunchError(str(exc)) from None


def _silence(seconds: float, ranks: "list[_Rank]") -> str:
    """Why a silent node is lost: ``stopped answering: no heartbeat for 10 s (its ranks were at step 85)``."""
    steps = [r.step for r in ranks if r.step is not None]
    at = f" (its ranks were at step {max(steps)})" if steps else ""
    return f"stopped answering: no heartbeat for {seconds:.0f} s{at}"


def _renumber(item: Any, rank: int) -> Any:
    """A node's event, with the rank's number in the whole job (its events carry it too)."""
    if isinstance(item, Message) and hasattr(item.event, "rank"):
        return Message(rank, dataclasses.replace(item.event, rank=rank))
    return dataclasses.replace(item, rank=rank)
