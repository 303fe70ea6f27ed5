"""The cluster specs a launch may be given as ``cluster=``: where its ranks
run, checked when made. Plain data: the engines that act on them
(:mod:`nblaunch.engines.slurm`, :mod:`nblaunch.engines.ray`,
:mod:`nblaunch.engines.spark`) import these,
never the other way round."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

__all__ = ["Slurm", "Ray", "Spark"]


@dataclass(frozen=True)
class Slurm:
    """``cluster=nblaunch.Slurm(...)``: ranks on the nodes of a SLURM allocation.

    In a kernel that runs inside an allocation (``$SLURM_JOB_ID`` is set, or
    ``job`` names one), its nodes are used: every node, or the first
    ``nodes`` of them. Outside one, ``nodes`` is required and SLURM is asked
    for an allocation (``salloc --no-shell -N nodes``, with ``partition``,
    ``time`` and ``extra_args``); the view shows it while it is pending, and
    it is given back when the launch (or the live ranks) end. ``srun_args``
    are added to the ``srun`` that starts the agents (``--gres=gpu:4``...).
    """

    nodes: Optional[int] = None
    partition: Optional[str] = None
    time: Optional[str] = None
    extra_args: Sequence[str] = ()
    job: Optional[str] = None
    srun_args: Sequence[str] = ()

    def __post_init__(self):
        if self.nodes is not None and (isinstance(self.nodes, bool) or not isinstance(self.nodes, int)
                                       or self.nodes < 1):
            raise ValueError(f"Slurm(nodes=...) must be a positive int or None, got {self.nodes!r}")
        for name in ("partition", "time", "job"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise TypeError(f"Slurm({name}=...) must be a non-empty string or None, got {value!r}")
        for name in ("extra_args", "srun_args"):
            value = getattr(self, name)
            if isinstance(value, str) or not all(isinstance(a, str) for a in value):
                raise TypeError(f"Slurm({name}=...) must be a list of strings, got {value!r}")
            object.__setattr__(self, name, tuple(value))


@dataclass(frozen=True)
class Ray:
    """``cluster=nblaunch.Ray(...)``: ranks on the nodes of a Ray cluster.

    ``address``: the cluster to connect to when the kernel is not connected
    yet (``ray.init(address=...)``; None: ``"auto"``). ``nodes``: how many
    of its alive nodes (default all). ``resources_per_rank``: what each rank
    reserves on its node (default ``{"CPU": 1}``; ``{"CPU": 4, "GPU": 1}``...).
    """

    address: Optional[str] = None
    nodes: Optional[int] = None
    resources_per_rank: Mapping = field(default_factory=lambda: {"CPU": 1})

    def __post_init__(self):
        if self.nodes is not None and (isinstance(self.nodes, bool) or not isinstance(self.nodes, int)
                                       or self.nodes < 1):
            raise ValueError(f"Ray(nodes=...) must be a positive int or None, got {self.nodes!r}")
        if self.address is not None and (not isinstance(self.address, str) or not self.address):
            raise TypeError(f"Ray(address=...) must be a non-empty string or None, got {self.address!r}")
        res = self.resources_per_rank
        if not isinstance(res, Mapping) or not all(isinstance(k, str) and isinstance(v, (int, float)) and v >= 0
                                                   for k, v in res.items()):
            raise TypeError(f"Ray(resources_per_rank=...) must map resource names to amounts, got {res!r}")
        object.__setattr__(self, "resources_per_rank", dict(res))

    def __hash__(self):
        return hash((self.address, self.nodes, tuple(sorted(self.resources_per_rank.items()))))


@dataclass(frozen=True)
class Spark:
    """``cluster=nblaunch.Spark(...)``: ranks on the executors of a Spark application.

    ``session``: the ``SparkSession`` whose executors run the ranks (None:
    the notebook's active one). It stays in this kernel: a pickled
    ``Spark`` (sent to the nodes with the launch) leaves it out. ``nodes``:
    how many barrier tasks, each one node's agent with ``num_processes``
    ranks (None: one per executor). GPUs come from Spark's task resources
    (``spark.task.resource.gpu.amount``): a task's GPUs are its ranks'.
    """

    nodes: Optional[int] = None
    session: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if self.nodes is not None and (isinstance(self.nodes, bool) or not isinstance(self.nodes, int)
                                       or self.nodes < 1):
            raise ValueError(f"Spark(nodes=...) must be a positive int or None, got {self.nodes!r}")
        if self.session is not None and not hasattr(self.session, "sparkContext"):
            raise TypeError(f"Spark(session=...) must be a SparkSession or None, got {type(self.session).__name__}")

    def __getstate__(self):
        return {"nodes": self.nodes, "session": None}  # a session is the kernel's: never sent

    def __setstate__(self, state):
        for name, value in state.items():
            object.__setattr__(self, name, value)
