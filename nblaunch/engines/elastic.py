"""The torch-elastic engine: this kernel is one node of several (a kernel on
each machine, or several launcher processes), joined through torch's elastic
rendezvous (:class:`~nblaunch.engines.nodes.NodeGroup`). Each node starts its own
ranks as the local engine does; what it adds is the relay between nodes: a
failure on one node is published to the others, which stop their ranks
within a poll instead of waiting in a collective until its timeout, and a
node whose ranks succeeded waits for the others (the exit barrier)."""
from __future__ import annotations

import time
from typing import Optional

from .. import errors
from ..errors import RankFailure
from .nodes import NodeGroup
from .local_pool import LocalPool
from .local import LocalEngine

__all__ = ["ElasticEngine", "ElasticPool"]

# A node that only saw a consequence (a peer vanished) waits this long for
# the node where the failure began to say what it was.
REMOTE_GRACE_S = 2.0
_POLL_S = 0.1


class ElasticPool(LocalPool):
    """This node's ranks, and the rest of the job through the rendezvous store."""

    def publish(self, failure: RankFailure) -> None:
        self._nodes.publish(failure)

    def news(self) -> Optional[RankFailure]:
        return self._nodes.poll()

    def settle(self, failures: list, seen: Optional[RankFailure]) -> Optional[RankFailure]:
        """On success, the exit barrier (it returns another node's failure if
        one came). On failure, when this node only saw a consequence, give
        the node where it started a moment to say so, then publish ours."""
        nodes = self._nodes
        if self.placement is None:
            return None
        if not failures:
            return nodes.finish(succeeded=True)
        remote = seen
        if remote is None:
            deadline = time.monotonic() + REMOTE_GRACE_S
            while remote is None and time.monotonic() < deadline:
                remote = nodes.poll(force=True)
                if remote is None:
                    time.sleep(_POLL_S)
            if remote is None:
                nodes.publish(errors.root_cause(failures))
        nodes.finish(succeeded=False)
        return remote


class ElasticEngine(LocalEngine):
    """``config.num_processes`` ranks here, one node of ``config.num_nodes``."""

    def _nodes(self) -> NodeGroup:
        c = self.config
        return NodeGroup(num_nodes=c.num_nodes, node_rank=c.node_rank, endpoint=c.rdzv_endpoint,
                         backend=c.rdzv_backend, run_id=c.rdzv_id, rdzv_timeout_s=float(c.rdzv_timeout),
                         local_world_size=c.num_processes, addr=c.addr, store_timeout_s=self.pg_timeout)

    def new_pool(self, job, attempt: int) -> ElasticPool:
        return ElasticPool(self.plan, self.nodes, job=job, attempt=attempt)

    def place(self, pool, view) -> None:
        view.notice(f"waiting for {self.config.num_nodes} nodes to join")
        super().place(pool, view)
