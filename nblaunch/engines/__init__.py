"""The engines: each way of getting ranks, behind one contract (:mod:`.base`).

:func:`engine_for` is the one place where a config's ``cluster`` and
``num_nodes`` choose an engine.
"""
from __future__ import annotations

import dataclasses

from .base import Engine
from ..clusters import Ray, Slurm, Spark

__all__ = ["Engine", "engine_for"]


def engine_for(config, live: bool = False, owner=None) -> Engine:
    """The engine that gets ``config``'s ranks: on this machine, on nodes
    joined by torch's elastic rendezvous (a kernel on each), or on the nodes
    of a cluster (``cluster=``), each kind of spec its own engine. A cluster
    engine finds its nodes now, so a missing allocation or cluster is a clear
    error before any process starts. ``owner``: what counts a local engine
    among the launches in flight (:mod:`nblaunch.registry`; the engine itself
    if None)."""
    spec = config.cluster
    if isinstance(spec, Slurm):
        from .slurm import SlurmEngine

        return SlurmEngine(config, live)
    if isinstance(spec, Ray):
        from .ray import RayEngine

        return RayEngine(config, live)
    if isinstance(spec, Spark):
        from .spark import SparkEngine, in_local_mode, spark_session

        if not in_local_mode(spark_session(spec)):
            return SparkEngine(config, live)
        # One JVM, no executors of its own: the ranks run here, as cluster=None would.
        here = dataclasses.replace(config, cluster=None, num_nodes=1, min_nodes=None)
        engine = _local(here, live, owner)
        engine.notice = "; ".join(filter(None, [
            "the SparkSession runs in local mode (one JVM, no executors): the ranks run on this machine",
            engine.notice]))
        return engine
    if spec is not None:
        raise TypeError(f"no engine for cluster={spec!r}")
    if config.multi_node:
        from .elastic import ElasticEngine

        return ElasticEngine(config, live, owner)
    return _local(config, live, owner)


def _local(config, live: bool, owner) -> Engine:
    from .local import LocalEngine

    return LocalEngine(config, live, owner)
