"""The engines: each way of getting ranks, behind one contract (:mod:`.base`).

:func:`engine_for` is the one place where a config's ``cluster`` and
``num_nodes`` choose an engine.
"""
from __future__ import annotations

from .base import Engine

__all__ = ["Engine", "engine_for"]


def engine_for(config, live: bool = False, owner=None) -> Engine:
    """The engine that gets ``config``'s ranks: on this machine, on nodes
    joined by torch's elastic rendezvous (a kernel on each), or on the nodes
    of a cluster (``cluster=``). A cluster engine finds its nodes now, so a
    missing allocation or cluster is a clear error before any process starts.
    ``owner``: what counts a local engine among the launches in flight
    (:mod:`nblaunch.registry`; the engine itself if None)."""
    if config.cluster is not None:
        from .ray import Ray, RayEngine
        from .slurm import SlurmEngine

        kind = RayEngine if isinstance(config.cluster, Ray) else SlurmEngine
        return kind(config, live)
    if config.multi_node:
        from .elastic import ElasticEngine

        return ElasticEngine(config, live, owner)
    from .local import LocalEngine

    return LocalEngine(config, live, owner)
