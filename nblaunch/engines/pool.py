"""The rank pool contract: one generation of ranks, and what a poll of it returns.

A pool starts its ranks, reads what they send (events, output, their exit),
signals them and closes them. It knows nothing of calls, results or the
view: :class:`~nblaunch.watch.CallWatch` reads :meth:`RankPool.poll` and
decides. Each engine makes its own kind (:class:`~nblaunch.engines.local_pool.LocalPool`:
ranks on this machine; :class:`~nblaunch.engines.agent_pool.AgentPool`:
ranks on a cluster's nodes through their agents).
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Union

from ..resources import gpu_devices
from ..wire.channel import Event
from .nodes import Placement

__all__ = ["RankPool", "Lines", "Rewriting", "Message", "Exited", "Lost", "PoolEvent", "TEARDOWN_WAIT_S", "TAIL_LINES"]

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


class RankPool(abc.ABC):
    """One generation of ``size`` ranks on this node (local ranks ``0..size-1``).

    ``start()`` starts them and places them in the job; ``poll(timeout)``
    returns what happened since (at least one item, or none after
    ``timeout``); ``send`` writes to a rank's control pipe; ``signal``
    signals ranks with everything they started; ``stacks`` reads where ranks
    are; ``stop(grace)`` ends them all; ``close()`` releases everything
    (safe twice). A rank's global number and node are known once started."""

    size: int
    placement: Optional[Placement] = None
    log_dir: Path

    @abc.abstractmethod
    def start(self, tick: Callable[[], None] = lambda: None) -> Placement:
        """Start every rank and place it; ``tick`` is called while waiting."""

    @abc.abstractmethod
    def poll(self, timeout: float) -> list[PoolEvent]:
        ...

    def host(self, rank: int) -> Optional[str]:
        """The machine a rank runs on, where the pool spans several."""
        return None

    def gpu_devices(self) -> dict:
        """Local rank -> the GPU the kernel samples for it (none for ranks on other machines)."""
        return gpu_devices(list(range(self.size)))

    def usage(self, sampler) -> Optional[dict]:
        """Each running rank's resources, at most every sampler interval (None between)."""
        return sampler.sample(self.running_pids())

    @property
    def pids(self) -> list:
        """Each rank's pid, where its process is on this machine."""
        return []

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

    @abc.abstractmethod
    def send(self, rank: int, message: Any) -> bool:
        """False if the rank can no longer be told (it died: its exit says why)."""

    @abc.abstractmethod
    def signal(self, sig: int, ranks: list[int]) -> None:
        ...

    @abc.abstractmethod
    def kill_orphans(self) -> None:
        """SIGKILL what stopped ranks left behind (children that outlived SIGTERM)."""

    @abc.abstractmethod
    def interrupt(self, rank: int, how: str) -> None:
        """A live rank's SIGINT, for the call it is on (``how``: see ``rank.interrupts.CallInterrupt``)."""

    @abc.abstractmethod
    def stacks(self, ranks: Optional[list[int]] = None) -> str:
        """Each rank's main-thread stack, innermost frames first."""

    @abc.abstractmethod
    def collectives(self, ranks: list[int]) -> dict[int, Optional[str]]:
        """Global rank -> the collective it waits in (None: not in one)."""

    @abc.abstractmethod
    def stop(self, grace: float, order: Optional[list[int]] = None) -> None:
        """SIGTERM every live rank (in ``order``), SIGKILL what is left after ``grace``."""

    @abc.abstractmethod
    def wait(self, timeout: float) -> bool:
        """Until every rank's process has ended (True) or ``timeout`` passed."""

    @abc.abstractmethod
    def drain(self) -> list[PoolEvent]:
        """Kill what is left; return what the ranks wrote last."""

    @abc.abstractmethod
    def close(self) -> None:
        ...

    # what every kind knows of its ranks
    @abc.abstractmethod
    def global_rank(self, rank: int) -> int: ...

    @abc.abstractmethod
    def node(self, rank: int) -> Optional[int]: ...

    @abc.abstractmethod
    def exited(self, rank: int) -> bool: ...

    @abc.abstractmethod
    def ended(self, rank: int) -> bool:
        """Its process has ended, whether or not a poll has said so yet."""

    @abc.abstractmethod
    def alive(self, rank: int) -> bool:
        """Not exited, and not a zombie (checked now, even between calls)."""

    @abc.abstractmethod
    def started(self, rank: int) -> bool:
        """It reported ``Started``: its stack handler is armed."""

    @abc.abstractmethod
    def running_pids(self) -> dict[int, int]:
        """Local rank -> pid, of ranks started and not ended."""

    @abc.abstractmethod
    def tail(self, rank: int) -> tuple:
        """The rank's last lines of output."""

    @property
    def log_files(self) -> list[str]:
        """Each rank's full output, in local-rank order (once placed)."""
        return [str(self.log_dir / f"rank{self.global_rank(r)}.log") for r in range(self.size)]
