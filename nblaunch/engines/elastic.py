"""The torch-elastic engine: this kernel is one node of several (a kernel on
each machine, or several launcher processes), joined through torch's elastic
rendezvous (:class:`~nblaunch.engines.nodes.NodeGroup`). Each node starts its own
ranks as the local engine does; what it adds is the relay between nodes: a
failure on one node is published to the others, which stop their ranks
within a poll instead of waiting in a collective until its timeout, and a
node whose ranks succeeded waits for the others (the exit barrier). The
nodes watch each other's heartbeats: a lost node stops the others' ranks
too, and with ``min_nodes`` the next generation runs on the nodes still up
(:mod:`nblaunch.engines.lost_nodes`)."""
from __future__ import annotations

from typing import Optional

from .. import errors
from ..errors import RankFailure
from .lost_nodes import WatchedNodes
from .local_pool import LocalPool
from .local import LocalEngine

__all__ = ["ElasticEngine", "ElasticPool"]

# A node that only saw a consequence (a peer vanished) waits this long for
# the node where the failure began to say what it was.
REMOTE_GRACE_S = 2.0


class ElasticPool(LocalPool):
    """This node's ranks, and the rest of the job through the rendezvous store."""

    def publish(self, failure: RankFailure) -> None:
        self._nodes.publish(failure)

    def news(self) -> Optional[RankFailure]:
        return self._nodes.poll()

    def settle(self, failures: list, seen: Optional[RankFailure]) -> Optional[RankFailure]:
        """On success, the exit barrier (it returns another node's failure if
        one came). On failure, when this node only saw a consequence, give
        the node where it started a moment to say so, then publish ours. A
        node found lost meanwhile joins ``failures`` (``lost_nodes``)."""
        nodes = self._nodes
        if self.placement is None:
            return None
        if not failures:
            return nodes.finish(succeeded=True)
        remote, lost = nodes.causes(seen, REMOTE_GRACE_S)
        if lost is not None:
            failures.append(lost)
        if remote is None:
            nodes.publish(errors.root_cause(failures))
        nodes.finish(succeeded=False)
        return remote


class ElasticEngine(LocalEngine):
    """``config.num_processes`` ranks here, one node of ``config.num_nodes``."""

    def _nodes(self) -> WatchedNodes:
        c = self.config
        return WatchedNodes(num_nodes=c.num_nodes, node_rank=c.node_rank, endpoint=c.rdzv_endpoint,
                            backend=c.rdzv_backend, run_id=c.rdzv_id, rdzv_timeout_s=float(c.rdzv_timeout),
                            local_world_size=c.num_processes, addr=c.addr, store_timeout_s=self.pg_timeout,
                            min_nodes=c.min_nodes, lost_after_s=c.lost_after, max_nodes=c.max_nodes,
                            back_after_s=c.node_back_after)

    def shrink(self, failures: list) -> bool:
        """After a generation that lost nodes: the next runs on the nodes still up, if ``min_nodes`` allows."""
        return self.nodes.shrink(failures)

    def nodes_back(self) -> list:
        """Launchers started again with the same rdzv_endpoint, waiting to be taken back
        (``min_nodes``; live ranks never grow: a launch only)."""
        return [] if self.live else self.nodes.nodes_back()

    def resized_elsewhere(self) -> list:
        return self.nodes.resized_elsewhere()

    def grow(self, names: list) -> list:
        return self.nodes.grow(names)

    @property
    def job_nodes(self) -> int:
        return self.nodes.num_nodes

    @property
    def job_world_size(self) -> int:
        return self.nodes.num_nodes * self.config.num_processes

    def new_pool(self, job, attempt: int) -> ElasticPool:
        return ElasticPool(self.plan, self.nodes, job=job, attempt=attempt)

    def place(self, pool, view) -> None:
        view.notice(f"waiting for {self.nodes.num_nodes} nodes to join")
        super().place(pool, view)
