"""The local engine: ranks started on this machine, forked from a zygote
(:mod:`nblaunch.engines.zygote`), or by forkserver or spawn
(:mod:`nblaunch.engines.plan` decides which), into a
:class:`~nblaunch.engines.local_pool.LocalPool`."""
from __future__ import annotations

import sys
from typing import Any, Callable

from .. import registry
from .base import Engine
from .local_pool import LocalPool
from .nodes import SingleNode
from .plan import plan_ranks

__all__ = ["LocalEngine", "FIRST_DIRECT_MAX_RANKS"]

#: A notebook kernel's first forked generation of at most this many ranks
#: forks them itself rather than through a zygote (see ``LocalEngine.new_pool``).
FIRST_DIRECT_MAX_RANKS = 3
_forked_before = False  # this process has started a forked generation


class LocalEngine(Engine):
    """``config.num_processes`` ranks on this machine; the kernel hosts their
    store. ``owner`` is what counts it among the launches in flight until
    ``close`` (the engine itself if None): the session that makes it, whose
    maker can then take it out even if an interrupt came before the engine
    was handed back."""

    def __init__(self, config, live: bool, owner=None):
        self.config, self.live = config, live
        self._owner = self if owner is None else owner
        try:
            self.plan = registry.enter(self._owner, lambda others: plan_ranks(
                config, live=live, shared=bool(others) or config.background))
            self.method, self.backend, self.notice = self.plan.method, self.plan.backend, self.plan.notice
            self.world_size = config.num_processes
            self.pg_timeout = self.plan.pg_timeout
            self.nodes = self._nodes()
        except BaseException:
            registry.leave(self._owner)
            raise

    def _nodes(self):
        """Where this node's ranks sit in the job: here, the whole job."""
        c = self.config
        return SingleNode(c.addr, c.num_processes, self.pg_timeout)

    def job(self, fn: Callable, args: tuple, kwargs: dict) -> Any:
        if self.plan.forked:
            return (fn, tuple(args), kwargs)  # inherited as it is: nothing is pickled
        return super().job(fn, args, kwargs)

    def new_pool(self, job: Any, attempt: int) -> LocalPool:
        """A forked generation's ranks come from one zygote, a copy of the
        kernel made ready to be a rank once (memory: each rank shares that
        work's pages). Making it is one more fork of the whole kernel on the
        launch's way (about 30 ms with torch imported), which a notebook's
        first launch, the one a user waits for with nothing warm, pays
        against torch's 60 ms. So a kernel's first forked generation of up to
        :data:`FIRST_DIRECT_MAX_RANKS` ranks is forked by the starter thread
        directly (each rank then copies about 1.7 MiB more of the kernel's
        pages, once); every later or larger one comes from a zygote, which
        from 4 ranks on is the faster too (it sets up once what each rank
        would: bench/README.md). A node agent (not a kernel) always uses it."""
        global _forked_before
        direct = (self.plan.forked and not _forked_before and _in_kernel()
                  and self.config.num_processes <= FIRST_DIRECT_MAX_RANKS)
        if self.plan.forked:
            _forked_before = True
        return LocalPool(self.plan, self.nodes, job=job, attempt=attempt, zygote=not direct)

    def close(self) -> None:
        try:
            self.nodes.close()
        finally:
            registry.leave(self._owner)


def _in_kernel() -> bool:
    """This process is a Jupyter kernel (as ``view.base.in_kernel`` says)."""
    ip = sys.modules.get("IPython")
    shell = ip.get_ipython() if ip is not None else None
    return shell is not None and getattr(shell, "kernel", None) is not None
