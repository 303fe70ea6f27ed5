"""The Engine contract: how a session gets its ranks.

One kind of engine per way of getting ranks (this folder: local, elastic,
slurm, ray; the last two share the node agents of ``agent_engine.py``). The
session picks one, once, from the config (:func:`nblaunch.engines.engine_for`)
and from then on only uses what is declared here, and the
:class:`~nblaunch.engines.pool.RankPool` each generation of ranks is:

    engine = engine_for(config, live)        # finds its nodes: errors before any process starts
    pool = engine.new_pool(job, attempt)     # a generation, not started yet
    engine.place(pool, view)                 # starts it, says where its ranks sit
    ... pool.send / pool.poll / pool.stop / pool.close (the call watch) ...
    engine.close()                           # gives back what it holds

What a new engine implements is listed in docs/design.md.
"""
from __future__ import annotations

import abc
from typing import Any, Callable, Optional

from ..wire.payload import CloudJob, check_sendable

__all__ = ["Engine"]


class Engine(abc.ABC):
    """A way of getting ranks, for the life of one launch or live session.

    ``method`` is how its ranks are made as the view says it (``fork``,
    ``slurm``...); ``backend`` the process group's backend (None: no group),
    which ``place`` may settle (the nodes' GPUs decide); ``notice`` a line
    every view of it says first (why ``auto`` did not fork); ``world_size``
    the ranks the kernel sees before they are placed; ``pg_timeout`` the
    process group's timeout (seconds)."""

    method: str
    backend: Optional[str]
    notice: Optional[str] = None
    world_size: int
    pg_timeout: float

    def job(self, fn: Callable, args: tuple, kwargs: dict) -> Any:
        """A launch's one call as its ranks receive it: pickled by
        cloudpickle (checked now, so what cannot be sent is named before any
        process starts)."""
        check_sendable(fn, args, kwargs)
        return CloudJob(fn, args, kwargs)

    @abc.abstractmethod
    def new_pool(self, job: Any, attempt: int):
        """A generation of ranks (a ``RankPool``), not started yet. ``job``:
        a launch's one call (None: live ranks, whose calls come by
        ``send``); ``attempt``: how many generations came before. Made with
        the kernel's interrupt deferred (a press as it returned lost the
        pool and all it held): it only makes what is its own (its folder,
        its pipes) and waits on no process; waiting is ``start``'s."""

    def place(self, pool, view) -> None:
        """Start the generation's ranks and show in ``view`` where they sit in the job."""
        pl = pool.start(tick=view.tick)
        view.place(pl.first_rank, pl.world_size, pl.node_rank if pl.num_nodes > 1 else None, pl.num_nodes)

    @property
    def job_nodes(self) -> int:
        """The nodes of the whole job, as its next generation has them
        (fewer once a lost node is left out: ``min_nodes``)."""
        return 1

    @property
    def job_world_size(self) -> int:
        """The ranks of the whole job (every node's), as its next generation has them."""
        return self.world_size

    def shrink(self, failures: list) -> bool:
        """After a generation failed with ``failures``: whether the next one
        can run without the nodes they lost (``min_nodes``), its nodes then
        left out. An engine of one machine cannot: False."""
        return False

    def nodes_back(self) -> list:
        """Nodes the run left out (lost, or not used yet) that have been usable
        for ``node_back_after`` seconds, as many as ``max_nodes`` leaves room
        for: the next generation may grow onto them (:meth:`grow`). Asked every
        tick of a generation: cheap. None here: one machine cannot grow."""
        return []

    def grow(self, names: list) -> list:
        """Run the next generations on the nodes named too (from :meth:`nodes_back`);
        returns those taken (a node may have gone again since)."""
        return []

    def ungrow(self, names: list) -> bool:
        """A generation grown onto ``names`` (:meth:`grow`) could not start: whether
        the next runs without them again (True), as before. False here."""
        return False

    def resized_elsewhere(self) -> list:
        """After a generation whose ranks all returned: the nodes another node of the
        job resized onto (nodes joined by a rendezvous each watch for nodes back; one
        publishes the resize, and its ranks' notice may end the others' before their
        own watch saw it). [] here: one kernel decides for the whole job."""
        return []

    def node_label(self, name: str) -> str:
        """Node ``name`` as notices name it (a replacement says whose place it takes)."""
        return name

    def said(self) -> list:
        """What the engine did on its own since last asked, a line each, for
        the next generation's notices (SLURM: a replacement node asked for,
        granted or refused). Nothing here."""
        return []

    def close(self) -> None:
        """Give back what the engine holds (a store, a rendezvous, an
        allocation it asked for). Safe twice."""
