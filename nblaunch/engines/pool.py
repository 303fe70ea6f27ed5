"""The rank pool contract: one generation of ranks, and what a poll of it returns.

A pool starts its ranks, reads what they send (events, output, their exit),
signals them and closes them. It knows nothing of calls, results or the
view: :class:`~nblaunch.watch.call.CallWatch` reads :meth:`RankPool.poll` and
decides. Each engine makes its own kind (:class:`~nblaunch.engines.local_pool.LocalPool`:
ranks on this machine; :class:`~nblaunch.engines.agent_pool.AgentPool`:
ranks on a cluster's nodes through their agents).
"""
from __future__ import annotations

import abc
import collections
import signal
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Mapping, Optional, Union

from ..system.resources import gpu_devices
from ..wire.channel import Event, Interrupt
from .nodes import Placement

__all__ = ["RankPool", "RankFacts", "Lines", "Rewriting", "Message", "Exited", "Lost", "PoolEvent", "TEARDOWN_WAIT_S", "TAIL_LINES"]

TEARDOWN_WAIT_S = 2.0  # the most any wait in teardown takes
TAIL_LINES = 40  # a rank's last lines, kept for its failure report


# -- what a poll returns ------------------------------------------------------------

@dataclass(frozen=True)
class Lines:
    """Whole lines a rank wrote (as a terminal shows a line rewritten with ``\\r``)."""
    rank: int
    lines: list


@dataclass(frozen=True)
class Rewriting:
    """The line a rank is still writing or rewriting with ``\\r`` (None: it ended)."""
    rank: int
    text: Optional[str]


@dataclass(frozen=True)
class Message:
    """An event the rank sent (:mod:`nblaunch.wire.channel`)."""
    rank: int
    event: Event


@dataclass(frozen=True)
class Exited:
    """The rank's process ended; everything it sent or wrote came before this."""
    rank: int
    exitcode: int


@dataclass(frozen=True)
class Lost:
    """The rank's machine left the launch (its agent's connection closed, or
    the engine ended it): ``why`` says what is known. An ``Exited`` follows."""
    rank: int
    why: str


PoolEvent = Union[Lines, Rewriting, Message, Exited, Lost]


@dataclass
class RankFacts:
    """What every pool knows of one of its ranks, kept up to date by the
    pool's kind where it reads them (a kind's per-rank record extends this)."""

    global_rank: int = -1  # known once placed
    node: Optional[int] = None  # set where the job spans nodes
    started: bool = False  # it reported ``Started``: its stack handler is armed
    exited: bool = False  # a poll has returned its ``Exited``
    tail: collections.deque = field(default_factory=lambda: collections.deque(maxlen=TAIL_LINES))


class RankPool(abc.ABC):
    """One generation of ``size`` ranks (numbered ``0..size-1`` in the pool).

    The verbs the call watch uses are written here once: ``stop`` (SIGTERM,
    a grace, SIGKILL), ``close`` (``drain``, then ``_release``, once),
    ``interrupt`` (a message like any other), ``stacks`` and
    ``collectives`` (one ``_ask``), and what is known of each rank
    (``self.facts``: its number in the job, node, whether it started or
    exited, its last lines). A kind fills in eight steps:

    * ``start(tick)``: start every rank and place it in the job;
    * ``poll(timeout)``: what happened since (at least one item, or none
      after ``timeout``), noting it in ``facts``;
    * ``send(rank, message)``: a control message, or an ``Interrupt``;
      False if the rank can no longer be told;
    * ``signal(sig, ranks)``: the ranks with everything they started
      (SIGKILL also ends what stopped ranks left behind);
    * ``_ask(what, ranks)``: ``"stacks"`` (text) or ``"collectives"``
      (global rank -> the collective it waits in, or None);
    * ``wait(timeout)``: until every rank's process ended (True) or not;
    * ``drain()``: end what is left; return what the ranks wrote last;
    * ``_release()``: free everything the pool holds.
    """

    size: int
    placement: Optional[Placement] = None
    # (signal, where): a preemption signal reached the engine's side of the job
    # (a node's agent); the call watch tells every rank (``preempt``).
    preempting: Optional[tuple] = None
    log_dir: Path
    facts: list  # a RankFacts (or a kind's extension of it) per rank
    # Nodes found lost by the pool's own thread (heartbeats), even between calls: node -> the
    # line naming it; ``on_lost(line)`` is called from that thread as each is found (live ranks
    # say it at once). The next poll reports their ranks ``Lost`` as for any lost node.
    lost_nodes: Mapping[int, str] = MappingProxyType({})
    on_lost: Optional[Callable[[str], None]] = None
    _closed = False

    @abc.abstractmethod
    def start(self, tick: Callable[[], None] = lambda: None) -> Placement:
        """Start every rank and place it; ``tick`` is called while waiting."""

    @abc.abstractmethod
    def poll(self, timeout: float) -> list[PoolEvent]:
        """What happened within ``timeout``."""

    @abc.abstractmethod
    def send(self, rank: int, message: Any) -> bool:
        """False if the rank can no longer be told (it died: its exit says why)."""

    @abc.abstractmethod
    def signal(self, sig: int, ranks: list[int]) -> None:
        """Signal ``ranks`` and what they started; SIGKILL also what they left behind."""

    @abc.abstractmethod
    def _ask(self, what: str, ranks: list[int]) -> Any:
        """``"stacks"``: each rank's main-thread stack as text, innermost
        frame first; ``"collectives"``: global rank -> the collective it
        waits in (None: not in one)."""

    @abc.abstractmethod
    def wait(self, timeout: float) -> bool:
        """Until every rank's process has ended (True) or ``timeout`` passed."""

    @abc.abstractmethod
    def drain(self) -> list[PoolEvent]:
        """Kill what is left; return what the ranks wrote last."""

    @abc.abstractmethod
    def _release(self) -> None:
        """Free what the pool holds (pipes, connections, logs, its folder)."""

    # -- written once --------------------------------------------------------------

    def stop(self, grace: float, order: Optional[list[int]] = None) -> None:
        """SIGTERM every live rank (in ``order``), SIGKILL what is left after ``grace``."""
        everyone = list(range(self.size)) if order is None else order
        self.signal(signal.SIGTERM, everyone)
        self.wait(grace)
        self.signal(signal.SIGKILL, everyone)

    def close(self) -> None:
        """Kill what is left and release everything; safe twice."""
        if self._closed:
            return
        self._closed = True
        try:
            self.drain()
        finally:
            self._release()

    def preempt(self, why: str) -> None:
        """Tell every rank the job is preempted (``nblaunch.preempted()``
        turns true): a file in the folder of the ranks' own files."""
        from ..rank.notice import write_notice

        write_notice(str(self.log_dir), why)

    def interrupt(self, rank: int, how: str) -> None:
        """A live rank's SIGINT, for the call it is on (``how``: see ``rank.interrupts.CallInterrupt``)."""
        self.send(rank, Interrupt(how))

    def stacks(self, ranks: Optional[list[int]] = None) -> str:
        """Each rank's main-thread stack, innermost frames first."""
        return self._ask("stacks", list(range(self.size)) if ranks is None else ranks)

    def collectives(self, ranks: list[int]) -> dict[int, Optional[str]]:
        """Global rank -> the collective it waits in (None: not in one)."""
        return self._ask("collectives", ranks)

    def global_rank(self, rank: int) -> int:
        return self.facts[rank].global_rank

    def node(self, rank: int) -> Optional[int]:
        return self.facts[rank].node

    def exit_seen(self, rank: int) -> bool:
        """A poll has reported its exit (what the watch knows)."""
        return self.facts[rank].exited

    def ended_now(self, rank: int) -> bool:
        """Its process has ended, checked now, whether or not a poll has said so yet."""
        return self.facts[rank].exited

    def up_now(self, rank: int) -> bool:
        """Started and still up, checked now (even between calls)."""
        return not self.ended_now(rank)

    def started(self, rank: int) -> bool:
        """It reported ``Started``: its stack handler is armed."""
        return self.facts[rank].started

    def tail(self, rank: int) -> tuple:
        """The rank's last lines of output."""
        return tuple(self.facts[rank].tail)

    @property
    def log_files(self) -> list[str]:
        """Each rank's full output, in pool order (once placed)."""
        return [str(self.log_dir / f"rank{self.global_rank(r)}.log") for r in range(self.size)]

    # -- what a kind may say more of -------------------------------------------------

    def host(self, rank: int) -> Optional[str]:
        """The machine a rank runs on, where the pool spans several."""
        return None

    def node_name(self, rank: int) -> Optional[str]:
        """The rank's machine, where its name tells the job's nodes apart
        (messages then say ``rank 3 on n2``); None elsewhere."""
        hosts = [self.host(r) for r in range(self.size)]
        host, nodes = hosts[rank], {self.node(r) for r in range(self.size)}
        if host is None or len({h for h in hosts if h is not None}) != len(nodes):
            return None
        return host

    def running_pids(self) -> dict[int, int]:
        """Rank -> pid, of ranks started and not ended, whose process is on this machine."""
        return {}

    @property
    def pids(self) -> list:
        """Each rank's pid, where its process is on this machine."""
        return []

    def gpu_devices(self) -> dict:
        """Rank -> the GPU the kernel samples for it (none for ranks on other machines)."""
        return gpu_devices(list(range(self.size)))

    def usage(self, sampler) -> Optional[dict]:
        """Each running rank's resources, at most every sampler interval (None between)."""
        return sampler.sample(self.running_pids())

    # -- the rest of the job: other nodes with kernels of their own. None,
    # unless the engine joins some (engines/elastic.py).

    def publish(self, failure) -> None:
        """Tell the rest of the job that this generation failed here."""

    def news(self):
        """A failure published elsewhere in the job (a ``RankFailure``), or None."""
        return None

    def settle(self, failures: list, seen=None):
        """A launch's ranks are done here (``failures``: theirs; ``seen``:
        another node's already heard of): agree on the outcome with the rest
        of the job; returns a failure from elsewhere, or None."""
        return None
