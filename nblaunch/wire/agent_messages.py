"""What the kernel and a node's agent say to each other over the link
(:mod:`nblaunch.wire.link`), one type per message, beside the ranks' own
events (:mod:`nblaunch.wire.channel`).

The kernel's side is :class:`~nblaunch.engines.agent_pool.AgentPool`, the
node's :mod:`nblaunch.engines.agent`. An agent says :class:`Hello` once
connected, gets its :class:`Setup`, starts its ranks and says
:class:`RanksStarted`; then it relays what its ranks sent
(:class:`Relayed`), their resource use (:class:`Usage`), a preemption
signal it got (:class:`PreemptNotice`) and, when its cluster ends the node,
:class:`Bye`. The kernel tells it a rank's message (:class:`Deliver`), a
signal for some ranks (:class:`SignalRanks`), a preemption notice for its
ranks (:class:`Preempt`), asks it something (:class:`Ask`, answered by a
:class:`Reply` with the same ``rid``) and ends it (:class:`Close`).
Messages on one link arrive in the order they were sent.

Each agent has a second link that carries heartbeats only
(:mod:`nblaunch.wire.beats`): it opens it with :class:`BeatLink`, and both
sides send :class:`Heartbeat` on it every second or so. A node the kernel
found silent is told :class:`Dropped` there (read if it ever comes back),
and its links are closed.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

__all__ = ["Hello", "Setup", "RanksStarted", "Relayed", "Usage", "PreemptNotice", "Bye", "Reply",
           "Deliver", "SignalRanks", "Preempt", "Ask", "Close", "Heartbeat", "BeatLink", "Dropped",
           "TO_AGENT", "TO_KERNEL"]


# -- from a node's agent ----------------------------------------------------------

@dataclass(frozen=True)
class Hello:
    """The agent's first word: which node it is, where, and what it has."""

    node: int
    name: str
    addr: str  # this node's address on the route to the kernel
    pid: int
    gpus: int
    nccl: bool


@dataclass(frozen=True)
class RanksStarted:
    """The node's ranks are started; their files are in ``log_dir`` on the node."""

    log_dir: str


@dataclass(frozen=True)
class Relayed:
    """What the node's ranks sent since the last relay, in order (the pool's
    items: ``Lines``, ``Rewriting``, ``Message``, ``Exited``), local ranks."""

    items: list


@dataclass(frozen=True)
class Usage:
    """Each local rank's resources, as the node's sampler read them."""

    by_rank: dict


@dataclass(frozen=True)
class PreemptNotice:
    """A preemption signal (its name) reached the node's agent: every rank of the job is told."""

    signal: str


@dataclass(frozen=True)
class Bye:
    """The node's cluster is ending it (``why``): that, not its ranks' deaths, is the news."""

    why: str


@dataclass(frozen=True)
class Reply:
    """The answer to the kernel's :class:`Ask` ``rid``."""

    rid: int
    value: Any = None


@dataclass(frozen=True)
class BeatLink:
    """The first word on an agent's heartbeat link: the node it beats for."""

    node: int


# -- both ways ----------------------------------------------------------------------

@dataclass(frozen=True)
class Heartbeat:
    """I am here (on the heartbeat link; any message received counts as one)."""


# -- from the kernel ------------------------------------------------------------------

@dataclass(frozen=True)
class Setup:
    """This node's part of the job: the launch's config, the call (None for
    live ranks), where its ranks sit, its address, the backend, the
    attempt, and the notebook's modules the node cannot import."""

    config: Any
    live: bool
    job: Any
    placement: Any
    node_addr: str
    backend: Optional[str]
    attempt: int
    modules: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Deliver:
    """``message`` (a call, an answer to a debugger, CLOSE) for local rank ``local``."""

    local: int
    message: Any


@dataclass(frozen=True)
class SignalRanks:
    """``sig`` to the local ranks ``ranks``."""

    sig: int
    ranks: list


@dataclass(frozen=True)
class Preempt:
    """Tell every rank of the node the job is ending (``why``)."""

    why: str


@dataclass(frozen=True)
class Ask:
    """A question the agent answers with a :class:`Reply`: ``"stacks"`` or
    ``"collectives"`` of the local ``ranks``, or ``"drain"`` (relay every
    rank's last output first, then reply)."""

    rid: int
    what: str
    ranks: list = field(default_factory=list)


@dataclass(frozen=True)
class Close:
    """Leave: stop the node's ranks and end."""


@dataclass(frozen=True)
class Dropped:
    """The kernel found this node silent and went on without it (``why``): a
    node that comes back ends its ranks and itself."""

    why: str


TO_AGENT = (Setup, Deliver, SignalRanks, Preempt, Ask, Close, Heartbeat, Dropped)
TO_KERNEL = (Hello, RanksStarted, Relayed, Usage, PreemptNotice, Bye, Reply, Heartbeat, BeatLink)
