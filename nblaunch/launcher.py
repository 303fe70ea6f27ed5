"""``notebook_launcher``: the one public call of a launch, a session with one call."""
from __future__ import annotations

from typing import Callable, Optional, Sequence

from .config import LaunchConfig, check_call
from .errors import refuse_inside_a_rank
from .session import LaunchResults, Session, one_at_a_time

__all__ = ["notebook_launcher", "LaunchResults"]


def notebook_launcher(
    fn: Callable,
    args: Sequence = (),
    kwargs: Optional[dict] = None,
    *,
    num_processes: int,
    start_method: str = "auto",
    backend: str = "auto",
    init_process_group: bool = True,
    master_addr: Optional[str] = None,
    threads_per_rank: Optional[int] = None,
    timeout: Optional[float] = None,
    display: str = "auto",
    stall_warning: Optional[float] = 60.0,
    num_nodes: int = 1,
    node_rank: Optional[int] = None,
    rdzv_endpoint: Optional[str] = None,
    rdzv_backend: str = "c10d",
    rdzv_id: str = "nblaunch",
    rdzv_timeout: float = 300.0,
    max_restarts: int = 0,
    cluster=None,
    min_nodes: Optional[int] = None,
    preempt_grace: float = 30.0,
    node_lost_after: Optional[float] = None,
    max_nodes: Optional[int] = None,
    node_back_after: float = 10.0,
) -> list:
    """Run ``fn(*args, **kwargs)`` on ``num_processes`` ranks; return their results.

    Each rank gets the torchrun environment (``RANK``, ``LOCAL_RANK``,
    ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) and,
    unless ``init_process_group=False``, an initialised default process group
    (``backend="auto"``: NCCL when every rank has its own GPU, else gloo).

    Returns ``[result of rank 0, result of rank 1, ...]``. If any rank fails,
    every other rank is stopped and :class:`nblaunch.WorkerError` is raised,
    naming the rank that failed first and showing its traceback. An interrupt
    stops every rank and re-raises ``KeyboardInterrupt``.

    ``threads_per_rank`` (intra-op threads) defaults to
    ``cpu_count // num_processes``, at least 1 and never more than the kernel's
    own ``torch.get_num_threads()``. ``timeout`` (seconds) stops the launch and
    raises :class:`nblaunch.LaunchTimeout` when it runs longer, showing where
    each rank was. ``display``: ``"auto"`` (a live widget view in a kernel,
    text elsewhere), ``"widget"``, ``"text"`` or ``"none"`` (rank output
    only). ``stall_warning``: seconds without progress on one rank, while
    others progress, before the view says so (None: never).

    Several machines: run the same call on each with ``num_nodes``,
    ``rdzv_endpoint="host:port"`` (one address every node reaches) and the
    same ``rdzv_id``. ``rdzv_backend="c10d"`` (torch elastic's dynamic
    rendezvous; node ranks in arrival order unless ``node_rank`` is given)
    or ``"static"`` (``node_rank`` required; node 0 hosts the endpoint).
    Ranks are global (``RANK = node_rank * num_processes + LOCAL_RANK``) and
    each node returns *its own* ranks' results, in local-rank order. A
    failure on any node stops every node and is raised on each, naming the
    rank and node. ``rdzv_timeout``: seconds to wait for every node.
    ``master_addr``: on one machine, the address the ranks' store binds
    (loopback by default); with several, this node's address that the others
    reach (default: the one it uses to reach ``rdzv_endpoint``).
    ``max_restarts``: after a rank fails, start every rank (on every node)
    again this many times before raising; each rank's
    ``TORCHELASTIC_RESTART_COUNT`` says which generation it is, the view says
    why each restart came, and a ``WorkerError`` after the last lists every
    attempt's cause. ``min_nodes`` (a cluster, or nodes joined by the c10d
    rendezvous): when a node is lost, the next generation runs on the nodes
    still up if at least this many are (``WORLD_SIZE`` and ``RANK`` then say
    how many ranks are left). Every node is watched by its heartbeats (a
    cluster's agents and the kernel both ways; nodes joined by
    ``rdzv_endpoint`` on its store): one silent for ``node_lost_after``
    seconds (default ``NBLAUNCH_NODE_LOST_AFTER``, else 10) is lost, even if
    nothing closed (a hung machine, a partition); so is, to its agents, a
    kernel silent that long. The node hosting ``rdzv_endpoint``'s store
    cannot be lost without ending the run. With ``min_nodes``, a node that
    is usable again (its slurmd back in the SLURM allocation, or one of the
    allocation's not used yet) for ``node_back_after`` seconds is taken
    back, up to ``max_nodes`` (default: the nodes the launch started with):
    the ranks get the preemption notice (``nblaunch.preempt_reason()``
    starts with ``resize``), save and return within ``preempt_grace``, and
    ``fn`` is called again on the larger set of nodes (what they returned is
    dropped; a resize never counts against ``max_restarts``).

    Preemption: SIGTERM or SIGUSR1 to the kernel or a cluster's agents, or
    SIGTERM to the ranks from outside nblaunch (what SLURM sends on
    preemption, ``scancel``, the time limit, ``--signal=USR1@60``), during a launch makes
    ``nblaunch.preempted()`` true on every rank; the ranks get
    ``preempt_grace`` seconds to save and return. Their results are returned
    if all return; else they are stopped and ``nblaunch.Preempted`` is raised.

    ``cluster="slurm"`` (or ``nblaunch.Slurm(...)``): ``num_processes`` ranks
    on every node of the SLURM allocation the kernel runs in (``num_nodes``
    of them, if given), started by ``srun``, one view for all of them, and
    the results of every rank. Outside an allocation, ``Slurm(nodes=2, ...)``
    asks SLURM for one and gives it back at the end. ``cluster="ray"`` (or
    ``nblaunch.Ray(...)``): the same on the nodes of the connected Ray
    cluster. ``master_addr`` then names the kernel's address that the nodes
    reach (default: the one it uses to reach them).
    """
    args, kwargs = check_call(fn, args, kwargs)
    config = LaunchConfig(
        num_processes, start_method=start_method, backend=backend, init_process_group=init_process_group,
        master_addr=master_addr, threads_per_rank=threads_per_rank, timeout=timeout, display=display,
        stall_warning=stall_warning, num_nodes=num_nodes, node_rank=node_rank, rdzv_endpoint=rdzv_endpoint,
        rdzv_backend=rdzv_backend, rdzv_id=rdzv_id, rdzv_timeout=rdzv_timeout, max_restarts=max_restarts,
        cluster=cluster, min_nodes=min_nodes, preempt_grace=preempt_grace, node_lost_after=node_lost_after,
        max_nodes=max_nodes, node_back_after=node_back_after)
    refuse_inside_a_rank("notebook_launcher")
    with one_at_a_time(
            "another launch is running in this kernel (started from another thread); nblaunch runs "
            "one launch per kernel at a time, since forking ranks while another launch's threads run "
            "can deadlock them. Wait for it to return, or put both jobs in one fn."):
        made: list = []  # the session, from its first line: released however the launch ends
        try:
            return Session(config, live=False, kept_in=made).launch(fn, args, kwargs)
        finally:
            for session in made:
                session.release_engine()
