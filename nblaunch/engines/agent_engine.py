"""Engines whose ranks run on a cluster's nodes through one agent per node
(:mod:`nblaunch.engines.agent`), which starts its node's ranks and relays
for them over the authenticated link: SLURM (:mod:`.slurm`) and Ray
(:mod:`.ray`). What they share is here: the contract of an engine of this
kind (:class:`AgentEngine`) and of its handle on the agents
(:class:`AgentStep`); the kernel's side of the agents is
:class:`~nblaunch.engines.agent_pool.AgentPool`."""
from __future__ import annotations

import abc
from typing import Any, Callable, Optional

from .agent_pool import AgentPool
from .base import Engine
from .regrow import Comebacks
from ..rank.env import pg_timeout_for
from ..wire.payload import PackedJob

__all__ = ["AgentEngine", "AgentStep"]


class AgentStep(abc.ABC):
    """An engine's handle on the agents it started (SLURM's ``srun`` step,
    Ray's actors), as the pool sees it. ``what`` names it in errors."""

    what: str

    @abc.abstractmethod
    def poll(self) -> Optional[int]:
        """An exit code once the agents (or any of them) ended; None while they run."""

    @abc.abstractmethod
    def output(self) -> str:
        """What the agents printed (their last 20,000 characters)."""

    @abc.abstractmethod
    def news(self) -> str:
        """Why an agent vanished without a word, as far as the engine knows ("" if not)."""

    @abc.abstractmethod
    def end(self, timeout: float) -> None:
        """The agents were told to leave and waited for: wait up to
        ``timeout`` for them to be gone, then end them (before the verdict
        reaches the cell; a step slow to end may be ended apart)."""

    def preempting(self) -> Optional[tuple]:
        """``(what, where)`` once the engine says a node is about to be taken
        (Ray: a node being drained); None until then. Called every poll: a
        kind that must ask a service asks it at its own pace."""
        return None


class AgentEngine(Engine):
    """Ranks on the nodes of a cluster, through one agent per node
    (:mod:`nblaunch.engines.agent`) that starts its node's ranks and relays for
    them. An engine of this kind says how many nodes it has
    (``num_nodes``), where the kernel reaches them (``reach``), gets them
    (``allocate``), starts the agents (``start_agents``) and gives back what
    it asked for (``close``)."""

    name: str  # the engine's name in the view: "slurm", "ray"
    label: str  # the nodes' owner in messages: "SLURM job 12", "Ray cluster at ..."

    def __init__(self, config, live: bool):
        self.config, self.live = config, live
        self.method = self.name
        self.backend = config.backend if config.init_process_group else None  # "auto": the nodes' GPUs decide
        self.pg_timeout = pg_timeout_for(None if live else config.timeout)
        self._first_nodes: Optional[int] = None  # the nodes of the first generation: max_nodes' default
        self._comebacks: Optional[Comebacks] = None  # the probes of the nodes left out, once asked

    @property
    def world_size(self) -> int:
        return self.config.num_processes * self.num_nodes

    @property
    def job_nodes(self) -> int:
        return self.num_nodes

    @property
    @abc.abstractmethod
    def num_nodes(self) -> int:
        """How many nodes the ranks run on."""

    @property
    @abc.abstractmethod
    def reach(self) -> str:
        """An address of the nodes' network: the kernel listens on its route to it."""

    @abc.abstractmethod
    def allocate(self, notice: Callable[[str], None], tick: Callable[[], None]) -> None:
        """Have the nodes (an allocation asked for may be pending: say so with ``notice``)."""

    @abc.abstractmethod
    def start_agents(self, env: dict, log_path: str) -> AgentStep:
        """One agent per node, with ``env`` added to its environment and its output to ``log_path``."""

    def without(self, names: list[str]) -> None:
        """Run the next generations without the nodes named (lost ones)."""
        raise NotImplementedError

    # -- growing back (min_nodes): an engine that can fills in spare, usable and with_nodes

    def spare(self) -> list[str]:
        """The nodes the run could use and does not now (lost ones, unused ones of the allocation)."""
        return []

    def usable(self, name: str) -> bool:
        """Whether node ``name`` can run an agent now (a probe; may take seconds)."""
        return False

    def with_nodes(self, names: list[str]) -> None:
        """Run the next generations on the nodes named too."""
        raise NotImplementedError

    @property
    def max_nodes(self) -> int:
        """The most nodes a generation runs on: ``max_nodes``, else as many as the first had."""
        return self.config.max_nodes or self._first_nodes or self.num_nodes

    def nodes_back(self) -> list[str]:
        """Spare nodes usable for ``node_back_after`` seconds, as many as
        ``max_nodes`` leaves room for; probed in a thread from the first ask."""
        room = self.max_nodes - self.num_nodes
        if self.config.min_nodes is None or room <= 0:
            return []
        if self._comebacks is None:
            if not self.spare():
                return []
            self._comebacks = Comebacks(self._candidates, self.usable, self.config.node_back_after)
        return self._comebacks.back()[:room]

    def _candidates(self) -> list[str]:
        # At max_nodes, the allocation's other nodes are not probed: nothing would take them.
        return self.spare() if self.num_nodes < self.max_nodes else []

    def grow(self, names: list[str]) -> list[str]:
        """The next generations on ``names`` too, each probed once more first: one
        gone since would fail the next generation's start, and the launch with it."""
        names = [n for n in names if self.usable(n)]
        if names:
            self.with_nodes(names)
        if self._comebacks is not None:
            self._comebacks.taken(names)
        return names

    def ungrow(self, names: list[str]) -> bool:
        """The nodes taken back went again before their generation started: left out, and probed anew."""
        self.without(names)
        return True

    def close(self) -> None:
        """Stop probing; a kind gives back what it asked for, then calls this."""
        if self._comebacks is not None:
            self._comebacks.close()
            self._comebacks = None

    def shrink(self, failures: list) -> bool:
        """After a generation that lost nodes (failures of kind ``node``):
        the next runs on the nodes still up, if ``min_nodes`` allows (True).
        A node whose agent vanished is left out until a probe has found it
        usable for ``node_back_after`` (:meth:`nodes_back`): its daemon may be
        gone too, and SLURM would say so only after its ``SlurmdTimeout``."""
        lost = sorted({f.host or str(f.node) for f in failures if f.kind == "node"})
        least = self.config.min_nodes
        if least is None or not lost or self.num_nodes - len(lost) < least:
            return False
        self.without(lost)
        self.nodes_back()  # their probes start now: a node back is known by the time it is asked
        return True

    def job(self, fn: Callable, args: tuple, kwargs: dict) -> PackedJob:
        """Packed once, before any node is asked for: tensors travel in its
        bytes (a shared-memory handle means nothing on another machine), and
        what cannot be packed is said before an allocation or an agent."""
        return PackedJob(super().job(fn, args, kwargs).pack(sharing=False))

    def new_pool(self, job: Any, attempt: int) -> "AgentPool":
        if self._first_nodes is None:
            self._first_nodes = self.num_nodes
        return AgentPool(self.config, self, job=job, attempt=attempt, live=self.live, pg_timeout=self.pg_timeout)

    def place(self, pool, view) -> None:
        self.allocate(view.notice, view.tick)
        pl = pool.start(tick=view.tick)
        self.backend = pool.backend  # decided by the nodes' GPUs
        view.place(0, pl.world_size, None, pl.num_nodes, hosts=[pool.host(r) for r in range(pool.size)],
                   backend=pool.backend or "no process group")
