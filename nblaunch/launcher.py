"""``notebook_launcher``: validate, decide, start, supervise, return."""
from __future__ import annotations

import functools
import inspect
import multiprocessing
import os
import sys
import threading
from dataclasses import dataclass
from numbers import Real
from typing import Any, Callable, Optional, Sequence

from . import rank_env, worker
from .display import SHOW_AFTER_S, make_display
from .errors import LaunchError, WorkerError
from .logs import new_launch_dir, release_launch_dir
from .nodes import NodeGroup, SingleNode, route_address
from .payload import CloudJob, check_sendable
from .supervisor import LaunchTimeout, Supervisor

__all__ = ["notebook_launcher", "LaunchResults", "choose_start_method", "default_threads"]

START_METHODS = ("auto", "fork", "forkserver", "spawn")
BACKENDS = ("auto", "gloo", "nccl", "mpi", "ucc", "xccl")
DISPLAYS = ("auto", "widget", "text", "none")
RDZV_BACKENDS = ("c10d", "static")
MAX_PROCESSES = 256
DEFAULT_PG_TIMEOUT_S = 1800.0  # torch's own default for gloo
MAX_PG_TIMEOUT_S = 30 * 86400.0  # torch's socket deadlines overflow far beyond this (found by hypothesis)

# One launch at a time per process. Two at once (cells run from threads)
# hung 1 time in 10 to 90: a rank forked while the other launch's store
# thread held glibc's resolver lock deadlocks in getnameinfo (seen with gdb),
# and every fork of every launch would have to wait for every other's
# threads to be quiet. A second launch is refused at once instead.
_one_launch = threading.Lock()


class LaunchResults(list):
    """What ``notebook_launcher`` returns: this node's per-rank results in
    local-rank order (a plain list in every other respect), plus where each
    rank's full output was kept: ``log_dir`` and ``log_files`` (one per rank,
    in the same order)."""

    def __init__(self, results, log_dir: str, log_files: list):
        super().__init__(results)
        self.log_dir = log_dir
        self.log_files = log_files


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
    again this many times before raising.
    """
    args, kwargs = _validate(fn, args, kwargs, num_processes, start_method, backend,
                             init_process_group, master_addr, threads_per_rank, timeout,
                             display, stall_warning)
    endpoint = _validate_nodes(num_nodes, node_rank, rdzv_endpoint, rdzv_backend, rdzv_id,
                               rdzv_timeout, max_restarts)
    addr = _node_address(master_addr, endpoint)
    _validate_settings(addr)
    if worker.current_spec() is not None:
        raise LaunchError(
            f"notebook_launcher was called inside rank {worker.current_spec().rank} of a running "
            "launch; nested launches are not supported. Call it from the notebook instead.")
    if not _one_launch.acquire(blocking=False):
        raise LaunchError(
            "another launch is running in this kernel (started from another thread); nblaunch runs "
            "one launch per kernel at a time, since forking ranks while another launch's threads run "
            "can deadlock them. Wait for it to return, or put both jobs in one fn.")
    try:
        return _launch(fn, args, kwargs, num_processes, start_method, backend, init_process_group,
                       threads_per_rank, timeout, display, stall_warning, num_nodes, node_rank,
                       rdzv_endpoint, rdzv_backend, rdzv_id, rdzv_timeout, max_restarts, addr)
    finally:
        _one_launch.release()


def _launch(fn, args, kwargs, num_processes, start_method, backend, init_process_group, threads_per_rank,
            timeout, display, stall_warning, num_nodes, node_rank, rdzv_endpoint, rdzv_backend, rdzv_id,
            rdzv_timeout, max_restarts, addr) -> list:
    """The validated launch, one attempt per restart."""
    plan = plan_ranks(num_processes, start_method, backend, init_process_group, threads_per_rank,
                      timeout, addr, max_restarts=max_restarts, run_id=rdzv_id if num_nodes > 1 else "none")
    method, resolved_backend, ctx = plan.method, plan.backend, plan.ctx
    if method == "fork":
        job: Any = (fn, tuple(args), kwargs)  # inherited as it is: nothing is pickled
    else:
        check_sendable(fn, args, kwargs)
        job = CloudJob(fn, args, kwargs)
    if num_nodes == 1:
        group: Any = SingleNode(addr, num_processes, plan.pg_timeout)
    else:
        group = NodeGroup(num_nodes=num_nodes, node_rank=node_rank, endpoint=rdzv_endpoint,
                          backend=rdzv_backend, run_id=rdzv_id, rdzv_timeout_s=float(rdzv_timeout),
                          local_world_size=num_processes, addr=addr, store_timeout_s=plan.pg_timeout)
    global_method = multiprocessing.get_start_method(allow_none=True)
    notices = [plan.notice] if plan.notice else []
    specs_base = plan.specs_base
    try:
        for attempt in range(max_restarts + 1):
            try:
                return _attempt(ctx, method, job, group, attempt, specs_base, num_processes,
                                resolved_backend, display, notices, timeout, stall_warning)
            except WorkerError as exc:
                # Every node sees the same failures, so every node restarts;
                # a node whose launcher was stopped (kind "node") will not.
                if attempt == max_restarts or exc.root.kind == "node":
                    raise
                notices = [f"restart {attempt + 1} of {max_restarts} after: {exc.root.summary()}"]
        raise AssertionError("unreachable")
    finally:
        group.close()
        if global_method is None:
            # Starting spawn/forkserver processes makes multiprocessing fix
            # its global default as a side effect; the kernel had none.
            multiprocessing.set_start_method(None, force=True)


def _attempt(ctx, method, job, group, attempt, specs_base, num_processes, resolved_backend,
             display, notices, timeout, stall_warning) -> list:
    """One start of every local rank, with its own view and log folder."""
    log_dir, log_notice = new_launch_dir()
    specs = [worker.WorkerSpec(rank=local, local_rank=local, restart_count=attempt,
                               stack_file=str(log_dir / f"local{local}.stacks"), **specs_base)
             for local in range(num_processes)]
    view = make_display(display, show_after=SHOW_AFTER_S)
    view.begin(num_processes, method, resolved_backend or "", str(log_dir))
    for text in notices + ([log_notice] if log_notice else []):
        view.notice(text)
    supervisor = Supervisor(ctx, specs, job, view, log_dir, group, attempt=attempt, timeout=timeout,
                            stall_warning=stall_warning)
    outcome = "failed"
    try:
        results = supervisor.run()
        outcome = "finished"
        return LaunchResults(results, str(log_dir), supervisor.log_files)
    except KeyboardInterrupt:
        outcome = "interrupted"
        raise
    except LaunchTimeout:
        outcome = "timed out"
        raise
    finally:
        release_launch_dir(log_dir)
        view.close(outcome)


@dataclass
class RankPlan:
    """How this node's ranks will be made: decided once per launch or session."""

    method: str
    notice: Optional[str]  # why auto did not fork
    backend: Optional[str]  # None: no process group
    ctx: Any
    pg_timeout: float
    specs_base: dict  # WorkerSpec fields shared by every rank


def plan_ranks(num_processes: int, start_method: str, backend: str, init_process_group: bool,
               threads_per_rank: Optional[int], timeout: Optional[float], addr: str,
               max_restarts: int = 0, run_id: str = "none", live: bool = False) -> RankPlan:
    """Start method, backend, threads and the ranks' common spec."""
    method, reason = choose_start_method(start_method)
    resolved_backend = _resolve_backend(backend, num_processes) if init_process_group else None
    threads = threads_per_rank or default_threads(num_processes)
    if method == "forkserver":
        _preload_forkserver()
    # Collectives give up a little after the launch would: the launch timeout
    # then fires first and shows where every rank is, instead of gloo's error.
    pg_timeout = DEFAULT_PG_TIMEOUT_S if timeout is None else min(
        float(timeout) + max(10.0, 0.1 * float(timeout)), MAX_PG_TIMEOUT_S)
    specs_base = dict(
        world_size=num_processes, local_world_size=num_processes, master_addr=addr,
        kernel_pid=os.getpid(), backend=resolved_backend, threads=threads,
        pg_timeout_s=pg_timeout, env={**_interface_env(addr), **_accelerate_env()}, max_restarts=max_restarts,
        run_id=run_id, environ=rank_env.rank_environ(), logging_setup=rank_env.kernel_logging(),
        live=live)
    return RankPlan(method, reason, resolved_backend, multiprocessing.get_context(method), pg_timeout, specs_base)


def choose_start_method(requested: str = "auto") -> tuple[str, Optional[str]]:
    """Return ``(method, notice)``; ``notice`` says why auto did not fork.

    Fork is chosen only on Linux with CUDA not initialised in this process
    (checked without initialising it). A forked rank is started from a fresh
    thread, which keeps it safe from the kernel's OpenMP state.
    """
    available = multiprocessing.get_all_start_methods()
    cuda_busy = _cuda_initialized()
    if requested == "fork":
        if "fork" not in available:
            raise ValueError(f"start_method='fork' is not available on {sys.platform}; "
                             "use 'auto' or 'spawn'")
        if cuda_busy:
            raise ValueError(
                "start_method='fork' cannot be used: CUDA is initialised in this kernel and a "
                "forked rank cannot use it. Use start_method='auto' (or 'forkserver'), or restart "
                "the kernel and launch before anything touches the GPU.")
        return "fork", None
    if requested in ("forkserver", "spawn"):
        if requested not in available:
            raise ValueError(f"start_method={requested!r} is not available on {sys.platform}; "
                             f"available: {available}")
        return requested, None
    fallback = "forkserver" if "forkserver" in available else "spawn"
    if not sys.platform.startswith("linux"):
        return "spawn", None  # the platform default on macOS and Windows
    if cuda_busy:
        return fallback, f"CUDA is initialised in this kernel; starting ranks with {fallback}"
    return "fork", None


def default_threads(num_processes: int) -> int:
    """Intra-op threads for each rank: the CPUs this process may use split
    evenly, at least 1, never more than the kernel's own setting."""
    import torch

    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus = os.cpu_count() or 1
    return max(1, min(torch.get_num_threads(), cpus // num_processes))


def _preload_forkserver() -> None:
    """Have the forkserver (started once per kernel, from a fresh interpreter
    that never touched CUDA or OpenMP) import torch, so the second and later
    launches do not pay ``import torch`` per rank. Only takes effect if this
    kernel's forkserver is not running yet."""
    multiprocessing.get_context("forkserver").set_forkserver_preload(
        ["nblaunch.worker", "torch", "torch.distributed", "cloudpickle"])


def _cuda_initialized() -> bool:
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_initialized())


def _resolve_backend(backend: str, num_processes: int) -> str:
    import torch

    gpus = torch.cuda.device_count()  # NVML count: does not initialise CUDA
    if backend == "auto":
        return "nccl" if gpus >= num_processes and torch.distributed.is_nccl_available() else "gloo"
    if backend == "nccl" and gpus < num_processes:
        raise ValueError(f"backend='nccl' needs one GPU per rank: {num_processes} ranks, "
                         f"{gpus} GPU(s) visible. Use backend='gloo' or 'auto'.")
    return backend


def _interface_env(addr: str) -> dict:
    """Make gloo/NCCL bind the interface that holds this node's address
    (loopback for a single-node launch); they otherwise bind whatever the
    host name resolves to, which need not be the network the others share."""
    import psutil

    loopback = addr.startswith("127.") or addr in ("localhost", "::1")
    names = [name for name, addrs in psutil.net_if_addrs().items()
             if any(a.address.startswith("127.") if loopback else a.address == addr for a in addrs)]
    if not names:
        return {}
    return {var: names[0] for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "TP_SOCKET_IFNAME")
            if var not in os.environ}


def _accelerate_env() -> dict:
    """On a machine without GPUs, tell accelerate its ranks are CPU ranks, as
    its own launchers do (``accelerate launch --cpu``, its notebook_launcher).
    Without it, ``Accelerator()`` in a CPU rank finds no accelerator backend
    and sets itself up as one process (DistributedType.NO) in every rank,
    each believing it is the main process."""
    import torch

    if "ACCELERATE_USE_CPU" in os.environ or torch.cuda.device_count() > 0:
        return {}
    return {"ACCELERATE_USE_CPU": "yes"}


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


def _validate_settings(addr: str) -> None:
    """What would otherwise fail only inside the ranks, after fn ran."""
    import socket

    try:
        worker.max_result_bytes()
    except ValueError:
        raise ValueError("NBLAUNCH_MAX_RESULT_BYTES must be a whole number of bytes, got "
                         f"{os.environ.get('NBLAUNCH_MAX_RESULT_BYTES')!r}") from None
    try:
        socket.getaddrinfo(addr, None)
    except (socket.gaierror, UnicodeError) as exc:
        raise ValueError(f"master_addr {addr!r} is not an address or host name this machine can "
                         f"resolve ({exc})") from None


def _validate_nodes(num_nodes, node_rank, endpoint, backend, run_id, rdzv_timeout,
                    max_restarts) -> Optional[tuple[str, int]]:
    """Check the multi-node arguments; return the endpoint as ``(host, port)``."""
    if isinstance(num_nodes, bool) or not isinstance(num_nodes, int) or num_nodes < 1:
        raise ValueError(f"num_nodes must be a positive int, got {num_nodes!r}")
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
        raise ValueError(f"max_restarts must be an int >= 0, got {max_restarts!r}")
    if node_rank is not None and (isinstance(node_rank, bool) or not isinstance(node_rank, int)
                                  or not 0 <= node_rank < num_nodes):
        raise ValueError(f"node_rank must be an int in [0, num_nodes={num_nodes}), got {node_rank!r}")
    if num_nodes == 1:
        if endpoint is not None:
            raise ValueError("rdzv_endpoint is for a launch across machines: give num_nodes > 1 too")
        return None
    if backend not in RDZV_BACKENDS:
        raise ValueError(f"rdzv_backend must be one of {RDZV_BACKENDS}, got {backend!r}")
    if backend == "static" and node_rank is None:
        raise ValueError("rdzv_backend='static' needs node_rank (0 on the machine at rdzv_endpoint)")
    if not isinstance(run_id, str) or not run_id:
        raise ValueError(f"rdzv_id must be a non-empty string, got {run_id!r}")
    if isinstance(rdzv_timeout, bool) or not isinstance(rdzv_timeout, Real) or not 0 < rdzv_timeout < 1e7:
        raise ValueError(f"rdzv_timeout must be a positive number of seconds, got {rdzv_timeout!r}")
    if not isinstance(endpoint, str) or not endpoint:
        raise ValueError(f"num_nodes={num_nodes} needs rdzv_endpoint='host:port', an address every "
                         "node can reach (the first node's machine, for instance)")
    host, _, port = endpoint.rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"rdzv_endpoint must be 'host:port', got {endpoint!r}")
    return host, int(port)


def _validate(fn, args, kwargs, num_processes, start_method, backend, init_process_group,
              master_addr, threads, timeout, display, stall_warning):
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
    if isinstance(num_processes, bool) or not isinstance(num_processes, int):
        raise TypeError(f"num_processes must be an int, got {type(num_processes).__name__}: {num_processes!r}")
    if not 1 <= num_processes <= MAX_PROCESSES:
        raise ValueError(f"num_processes must be between 1 and {MAX_PROCESSES}, got {num_processes}")
    if start_method not in START_METHODS:
        raise ValueError(f"start_method must be one of {START_METHODS}, got {start_method!r}")
    if not isinstance(backend, str) or not (backend in BACKENDS or ":" in backend):
        raise ValueError(f"backend must be one of {BACKENDS} or a 'cpu:gloo,cuda:nccl' style "
                         f"string, got {backend!r}")
    if not isinstance(init_process_group, bool):
        raise TypeError(f"init_process_group must be True or False, got {init_process_group!r}")
    if master_addr is not None and (not isinstance(master_addr, str) or not master_addr):
        raise TypeError(f"master_addr must be a host name or address string, got {master_addr!r}")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ValueError(f"threads_per_rank must be a positive int or None, got {threads!r}")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, Real)
                                or not timeout > 0 or timeout != timeout or timeout == float("inf")):
        raise ValueError(f"timeout must be a positive number of seconds or None, got {timeout!r}")
    if display not in DISPLAYS:
        raise ValueError(f"display must be one of {DISPLAYS}, got {display!r}")
    if stall_warning is not None and (isinstance(stall_warning, bool) or not isinstance(stall_warning, Real)
                                      or not stall_warning > 0):
        raise ValueError(f"stall_warning must be a positive number of seconds or None, got {stall_warning!r}")
    return list(args), dict(kwargs)
