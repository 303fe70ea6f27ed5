"""What a launch or a live session is asked to do, checked once, before any process starts.

:class:`LaunchConfig` holds every setting of ``notebook_launcher`` and
``nblaunch.start`` and refuses a bad one with a clear error when it is made;
it then travels whole (to the plan, the session, the rank pool). What comes
with each call (``fn``, its arguments, the call's own ``timeout`` and
``display``) is checked by :func:`check_call` and :func:`check_call_options`.
"""
from __future__ import annotations

import functools
import inspect
import os
import socket
from dataclasses import dataclass, field
from numbers import Real
from typing import Any, Callable, Optional

from .clusters import Ray, Slurm, Spark
from .rank.results import max_result_bytes
from .system.network import route_address

__all__ = ["LaunchConfig", "check_call", "check_call_options", "check_max_nodes", "lost_after", "LOST_AFTER_S",
           "BACK_AFTER_S"]

LOST_AFTER_S = 10.0  # NBLAUNCH_NODE_LOST_AFTER's default
BACK_AFTER_S = 10.0  # node_back_after's default: usable this long before a node is taken back

START_METHODS = ("auto", "fork", "forkserver", "spawn")
BACKENDS = ("auto", "gloo", "nccl", "mpi", "ucc", "xccl")
DISPLAYS = ("auto", "widget", "text", "none")
RDZV_BACKENDS = ("c10d", "static")
MAX_PROCESSES = 256


@dataclass(frozen=True)
class LaunchConfig:
    """The settings of one launch or live session (see ``notebook_launcher``
    for what each means). Made once; raises ``TypeError``/``ValueError`` on a
    bad setting. ``addr`` (this node's address for the ranks' store) and
    ``endpoint`` (the rendezvous ``(host, port)``, None on one machine) are
    worked out from the others."""

    num_processes: int
    start_method: str = "auto"
    backend: str = "auto"
    init_process_group: bool = True
    master_addr: Optional[str] = None
    threads_per_rank: Optional[int] = None
    timeout: Optional[float] = None
    display: str = "auto"
    stall_warning: Optional[float] = 60.0
    num_nodes: int = 1
    node_rank: Optional[int] = None
    rdzv_endpoint: Optional[str] = None
    rdzv_backend: str = "c10d"
    rdzv_id: str = "nblaunch"
    rdzv_timeout: float = 300.0
    max_restarts: int = 0
    min_nodes: Optional[int] = None  # with max_restarts: a lost node's generation restarts on the others if this many are up
    preempt_grace: float = 30.0  # seconds the ranks get to save and return once preempted
    node_lost_after: Optional[float] = None  # seconds without a heartbeat before a node is lost (None: lost_after())
    max_nodes: Optional[int] = None  # with min_nodes: the most nodes a generation grows back to (None: as it started)
    node_back_after: float = BACK_AFTER_S  # seconds a node stays usable before it is taken back (no flapping)
    cluster: Any = None  # None (this machine), "slurm"/"ray" or Slurm(...)/Ray(...): made one of those when checked
    # A background run's share of the machine (nblaunch.background): CPU numbers
    # and GPU indices, made sorted tuples when checked (_check_share).
    cpus: Any = None
    devices: Any = None
    background: bool = False  # the watch runs off the cell (nblaunch.submit)
    addr: str = field(init=False)
    endpoint: Optional[tuple] = field(init=False)

    def __post_init__(self):
        _check_ranks(self)
        check_call_options(self.timeout, self.display)
        _check_cluster(self)
        _check_counts(self)
        _check_resilience(self)
        _check_growth(self)
        _check_share(self)
        endpoint = None if self.cluster is not None else _check_nodes(self)
        object.__setattr__(self, "endpoint", endpoint)
        object.__setattr__(self, "addr", _node_address(self.master_addr, endpoint))
        _check_settings(self.addr)

    @property
    def lost_after(self) -> float:
        """Seconds without a heartbeat after which a node (or, to a node's agent, the kernel) is
        lost: ``node_lost_after``, else ``NBLAUNCH_NODE_LOST_AFTER``, else :data:`LOST_AFTER_S`."""
        return float(self.node_lost_after) if self.node_lost_after is not None else lost_after()

    @property
    def multi_node(self) -> bool:
        """Several machines joined by the elastic rendezvous (each with its own kernel)."""
        return self.num_nodes > 1 and self.cluster is None


def check_call(fn: Callable, args: Any, kwargs: Any) -> tuple[list, dict]:
    """``fn`` and its arguments: what a rank can run. Returns them as a list and a dict."""
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}: {fn!r:.80}")
    target = fn.func if isinstance(fn, functools.partial) else fn
    if inspect.iscoroutinefunction(target) or inspect.iscoroutinefunction(getattr(target, "__call__", None)):
        raise TypeError("fn is an async function; notebook_launcher runs plain functions. "
                        "Wrap it: notebook_launcher(lambda: asyncio.run(fn()), ...)")
    if inspect.isgeneratorfunction(target) or inspect.isasyncgenfunction(target):
        raise TypeError("fn is a generator function; its generator cannot be returned from a rank. "
                        "Return a list or a value instead.")
    if isinstance(args, (str, bytes)) or not isinstance(args, (tuple, list)):
        raise TypeError(f"args must be a tuple or list, got {type(args).__name__}")
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise TypeError(f"kwargs must be a dict with str keys, got {type(kwargs).__name__}")
    return list(args), dict(kwargs)


def check_call_options(timeout: Optional[float], display: str) -> None:
    """A call's ``timeout`` (seconds or None) and ``display``."""
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, Real)
                                or not timeout > 0 or timeout != timeout or timeout == float("inf")):
        raise ValueError(f"timeout must be a positive number of seconds or None, got {timeout!r}")
    if display not in DISPLAYS:
        raise ValueError(f"display must be one of {DISPLAYS}, got {display!r}")


def _check_ranks(c: LaunchConfig) -> None:
    n = c.num_processes
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"num_processes must be an int, got {type(n).__name__}: {n!r}")
    if not 1 <= n <= MAX_PROCESSES:
        raise ValueError(f"num_processes must be between 1 and {MAX_PROCESSES}, got {n}")
    if c.start_method not in START_METHODS:
        raise ValueError(f"start_method must be one of {START_METHODS}, got {c.start_method!r}")
    if not isinstance(c.backend, str) or not (c.backend in BACKENDS or ":" in c.backend):
        raise ValueError(f"backend must be one of {BACKENDS} or a 'cpu:gloo,cuda:nccl' style "
                         f"string, got {c.backend!r}")
    if not isinstance(c.init_process_group, bool):
        raise TypeError(f"init_process_group must be True or False, got {c.init_process_group!r}")
    if c.master_addr is not None and (not isinstance(c.master_addr, str) or not c.master_addr):
        raise TypeError(f"master_addr must be a host name or address string, got {c.master_addr!r}")
    t = c.threads_per_rank
    if t is not None and (isinstance(t, bool) or not isinstance(t, int) or t < 1):
        raise ValueError(f"threads_per_rank must be a positive int or None, got {t!r}")
    s = c.stall_warning
    if s is not None and (isinstance(s, bool) or not isinstance(s, Real) or not s > 0):
        raise ValueError(f"stall_warning must be a positive number of seconds or None, got {s!r}")


def _check_cluster(c: LaunchConfig) -> None:
    """``cluster``: made a :class:`~nblaunch.clusters.Slurm`,
    :class:`~nblaunch.clusters.Ray` or :class:`~nblaunch.clusters.Spark`; ``num_nodes`` then means how many of
    its nodes (1, the default: all of them; see :func:`_check_counts`)."""
    if c.cluster is None:
        return
    specs = {"slurm": Slurm, "ray": Ray, "spark": Spark}
    if isinstance(c.cluster, str) and c.cluster.lower() in specs:
        object.__setattr__(c, "cluster", specs[c.cluster.lower()]())
    elif not isinstance(c.cluster, tuple(specs.values())):
        raise ValueError(f"cluster must be None, 'slurm', 'ray', 'spark', nblaunch.Slurm(...), nblaunch.Ray(...) "
                         f"or nblaunch.Spark(...), got {c.cluster!r}")
    if c.rdzv_endpoint is not None or c.node_rank is not None:
        raise ValueError("cluster=... starts the ranks on every node itself; rdzv_endpoint and node_rank are for "
                         "a launch run by hand on each machine. Leave them out.")


def _check_counts(c: LaunchConfig) -> None:
    """``num_nodes`` (with a cluster: agreeing with its ``nodes``) and
    ``max_restarts``, checked here only, with or without a cluster (after
    :func:`_check_cluster`, before :func:`_check_nodes`)."""
    if isinstance(c.num_nodes, bool) or not isinstance(c.num_nodes, int) or c.num_nodes < 1:
        raise ValueError(f"num_nodes must be a positive int, got {c.num_nodes!r}")
    if isinstance(c.max_restarts, bool) or not isinstance(c.max_restarts, int) or c.max_restarts < 0:
        raise ValueError(f"max_restarts must be an int >= 0, got {c.max_restarts!r}")
    if (c.cluster is not None and c.num_nodes > 1 and c.cluster.nodes is not None
            and c.cluster.nodes != c.num_nodes):
        raise ValueError(f"num_nodes={c.num_nodes} and {type(c.cluster).__name__}(nodes={c.cluster.nodes}) "
                         "disagree; give one of them")


def _check_resilience(c: LaunchConfig) -> None:
    """``min_nodes`` (1 <= min_nodes <= the nodes asked for; only where a
    generation can run on fewer nodes: a cluster's, or nodes joined by
    torch's c10d rendezvous; a launch's restarts need ``max_restarts`` too),
    ``node_lost_after`` (or ``NBLAUNCH_NODE_LOST_AFTER`` where nodes can be lost)
    and ``preempt_grace``."""
    t = c.node_lost_after
    if t is not None and (isinstance(t, bool) or not isinstance(t, Real) or not 0.5 <= t < 1e6):
        raise ValueError(f"node_lost_after must be a number of seconds >= 0.5 (or None: NBLAUNCH_NODE_LOST_AFTER, "
                         f"default {LOST_AFTER_S:.0f}), got {t!r}")
    if t is None and (c.cluster is not None or c.num_nodes > 1):
        lost_after()  # NBLAUNCH_NODE_LOST_AFTER decides: read by every node's heartbeat watch
    g = c.preempt_grace
    if isinstance(g, bool) or not isinstance(g, Real) or not 0 <= g < 1e7:
        raise ValueError(f"preempt_grace must be a number of seconds >= 0, got {g!r}")
    m = c.min_nodes
    if m is None:
        return
    if isinstance(m, bool) or not isinstance(m, int):
        raise TypeError(f"min_nodes must be an int or None, got {type(m).__name__}: {m!r}")
    if c.cluster is None and c.num_nodes == 1:
        raise ValueError("min_nodes is for a launch on several nodes (num_nodes > 1 with rdzv_endpoint, or "
                         "cluster='slurm', 'ray' or 'spark'); on one machine there is no node to lose")
    if c.cluster is None and c.rdzv_backend == "static":
        raise ValueError("min_nodes needs rdzv_backend='c10d': with 'static' every node keeps the node_rank it was "
                         "given and node 0 hosts the rendezvous, so the others cannot meet again without a lost "
                         "node. Leave rdzv_backend at 'c10d' (node ranks are then given again after a loss)")
    nodes = c.num_nodes if c.num_nodes > 1 else c.cluster.nodes
    if not 1 <= m <= (nodes or m):
        raise ValueError(f"min_nodes must be between 1 and the number of nodes ({nodes}), got {m}")
    # Nodes joined by the rendezvous meet in rounds of at most num_nodes; a
    # cluster's engine knows what its allocation holds once it has found it.
    check_max_nodes(c.max_nodes, m, c.num_nodes if c.cluster is None else None, "the c10d rendezvous of num_nodes")


def _check_growth(c: LaunchConfig) -> None:
    """``max_nodes`` (only with ``min_nodes``: a run whose size cannot change has no
    size to grow back to) and ``node_back_after``."""
    b = c.node_back_after
    if isinstance(b, bool) or not isinstance(b, Real) or not 0 <= b < 1e6:
        raise ValueError(f"node_back_after must be a number of seconds >= 0, got {b!r}")
    if c.max_nodes is not None and c.min_nodes is None:
        raise ValueError("max_nodes is the size a run grows back to after it lost nodes: give min_nodes too")


def check_max_nodes(max_nodes: Optional[int], min_nodes: Optional[int], holds: Optional[int], what: str) -> None:
    """The rule on ``max_nodes``, one line when refused: an int, at least
    ``min_nodes``, at most ``holds`` (what ``what`` can hold: the nodes of the
    rendezvous or of the allocation; None: not known yet)."""
    if max_nodes is None:
        return
    if isinstance(max_nodes, bool) or not isinstance(max_nodes, int):
        raise TypeError(f"max_nodes must be an int or None, got {type(max_nodes).__name__}: {max_nodes!r}")
    if min_nodes is not None and max_nodes < min_nodes:
        raise ValueError(f"max_nodes={max_nodes} is below min_nodes={min_nodes}: a run may not grow to fewer "
                         "nodes than it may shrink to")
    if holds is not None and max_nodes > holds:
        raise ValueError(f"max_nodes={max_nodes} is more than {what} can hold ({holds} nodes)")


def _check_share(c: LaunchConfig) -> None:
    """``cpus`` (CPU numbers this process may use) and ``devices`` (GPU
    indices of this machine): distinct ints, made sorted tuples. Only for
    ranks on this machine; overlap with another run is checked by
    :mod:`nblaunch.background.in_kernel`, which knows the others."""
    for name, allowed in (("cpus", _usable_cpus), ("devices", _gpu_indices)):
        value = getattr(c, name)
        if value is None:
            continue
        if isinstance(value, int) and not isinstance(value, bool):
            value = (value,)
        if (isinstance(value, (str, bytes)) or not hasattr(value, "__iter__")
                or not all(isinstance(v, int) and not isinstance(v, bool) for v in value)):
            raise TypeError(f"{name} must be a list of ints, got {value!r}")
        value = tuple(sorted(value))
        if not value or len(set(value)) != len(value):
            raise ValueError(f"{name} must list at least one {name[:-1]}, each once, got {list(value)}")
        if c.cluster is not None or c.num_nodes > 1:
            raise ValueError(f"{name}= splits this machine between runs; it is not for a launch on several nodes")
        usable = allowed()
        outside = [v for v in value if v not in usable]
        if outside:
            raise ValueError(f"{name} {outside} not on this machine (it has {name} {_span(usable)})")
        object.__setattr__(c, name, value)
    if not isinstance(c.background, bool):
        raise TypeError(f"background must be True or False, got {c.background!r}")


def _usable_cpus() -> list:
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # macOS: no affinity; every CPU
        return list(range(os.cpu_count() or 1))


def _gpu_indices() -> list:
    import torch

    return list(range(torch.cuda.device_count()))  # NVML's count: does not initialise CUDA


def _span(values: list) -> str:
    if not values:
        return "none"
    if values == list(range(values[0], values[-1] + 1)):
        return f"{values[0]}-{values[-1]}" if len(values) > 1 else str(values[0])
    return ", ".join(map(str, values))


def _check_nodes(c: LaunchConfig) -> Optional[tuple[str, int]]:
    """The multi-node settings without a cluster (``num_nodes`` is checked
    already); returns the endpoint as ``(host, port)``."""
    num_nodes, node_rank = c.num_nodes, c.node_rank
    if node_rank is not None and (isinstance(node_rank, bool) or not isinstance(node_rank, int)
                                  or not 0 <= node_rank < num_nodes):
        raise ValueError(f"node_rank must be an int in [0, num_nodes={num_nodes}), got {node_rank!r}")
    if num_nodes == 1:
        if c.rdzv_endpoint is not None:
            raise ValueError("rdzv_endpoint is for a launch across machines: give num_nodes > 1 too")
        return None
    if c.rdzv_backend not in RDZV_BACKENDS:
        raise ValueError(f"rdzv_backend must be one of {RDZV_BACKENDS}, got {c.rdzv_backend!r}")
    if c.rdzv_backend == "static" and node_rank is None:
        raise ValueError("rdzv_backend='static' needs node_rank (0 on the machine at rdzv_endpoint)")
    if not isinstance(c.rdzv_id, str) or not c.rdzv_id:
        raise ValueError(f"rdzv_id must be a non-empty string, got {c.rdzv_id!r}")
    t = c.rdzv_timeout
    if isinstance(t, bool) or not isinstance(t, Real) or not 0 < t < 1e7:
        raise ValueError(f"rdzv_timeout must be a positive number of seconds, got {t!r}")
    endpoint = c.rdzv_endpoint
    if not isinstance(endpoint, str) or not endpoint:
        raise ValueError(f"num_nodes={num_nodes} needs rdzv_endpoint='host:port', an address every "
                         "node can reach (the first node's machine, for instance)")
    host, _, port = endpoint.rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"rdzv_endpoint must be 'host:port', got {endpoint!r}")
    return host, int(port)


def _node_address(master_addr: Optional[str], endpoint: Optional[tuple[str, int]]) -> str:
    if master_addr is not None:
        return master_addr
    if endpoint is None:
        return "127.0.0.1"
    try:
        return route_address(*endpoint)
    except OSError as exc:
        raise ValueError(f"rdzv_endpoint {endpoint[0]}:{endpoint[1]} cannot be reached from this "
                         f"machine ({exc}); give a host name or address every node can reach") from None


def _check_settings(addr: str) -> None:
    """What would otherwise fail only inside the ranks, after fn ran."""
    try:
        max_result_bytes()
    except ValueError:
        raise ValueError("NBLAUNCH_MAX_RESULT_BYTES must be a whole number of bytes, got "
                         f"{os.environ.get('NBLAUNCH_MAX_RESULT_BYTES')!r}") from None
    try:
        socket.getaddrinfo(addr, None)
    except (socket.gaierror, UnicodeError) as exc:
        raise ValueError(f"master_addr {addr!r} is not an address or host name this machine can "
                         f"resolve ({exc})") from None


def lost_after() -> float:
    """``NBLAUNCH_NODE_LOST_AFTER``: seconds without a heartbeat after which a node is lost."""
    text = os.environ.get("NBLAUNCH_NODE_LOST_AFTER", "").strip()
    if not text:
        return LOST_AFTER_S
    value = float(text) if text.replace(".", "", 1).isdigit() else -1.0
    if not 0.5 <= value < 1e6:
        raise ValueError(f"NBLAUNCH_NODE_LOST_AFTER must be a number of seconds >= 0.5, got {text!r}")
    return value
