"""The local engine: ranks started on this machine, forked from a zygote
(:mod:`nblaunch.engines.zygote`), or by forkserver or spawn
(:mod:`nblaunch.engines.plan` decides which), into a
:class:`~nblaunch.engines.local_pool.LocalPool`."""
from __future__ import annotations

from typing import Any, Callable

from . import inflight
from .base import Engine
from .local_pool import LocalPool
from .nodes import SingleNode
from .plan import plan_ranks

__all__ = ["LocalEngine"]


class LocalEngine(Engine):
    """``config.num_processes`` ranks on this machine; the kernel hosts their store."""

    def __init__(self, config, live: bool):
        self.config = config
        self._counted = True  # in inflight's count until close()
        self.plan = inflight.enter(lambda others: plan_ranks(config, live=live,
                                                             shared=bool(others) or config.background))
        self.method, self.backend, self.notice = self.plan.method, self.plan.backend, self.plan.notice
        self.world_size = config.num_processes
        self.pg_timeout = self.plan.pg_timeout
        try:
            self.nodes = self._nodes()
        except BaseException:
            self._counted = False
            inflight.leave()
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
        return LocalPool(self.plan, self.nodes, job=job, attempt=attempt)

    def close(self) -> None:
        try:
            self.nodes.close()
        finally:
            if self._counted:
                self._counted = False
                inflight.leave()
