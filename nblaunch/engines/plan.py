"""How this node's ranks will be made: start method, backend, threads, and
the part of each rank's spec that every rank shares. Decided once per launch
or live session, from its :class:`~nblaunch.config.LaunchConfig`."""
from __future__ import annotations

import contextlib
import multiprocessing
import os
import sys
from dataclasses import dataclass
from typing import Any, Optional

from ..system import procid
from ..rank import env as rank_env
from ..rank.env import pg_timeout_for

from ..config import LaunchConfig

__all__ = ["RankPlan", "plan_ranks", "choose_start_method", "default_threads", "resolve_backend", "share_env", "CPUS_ENV", "SHARED_NOTICE", "SHARED_WHY", "starting_ranks"]

#: ``"<pid>:<start time>"`` of the process that starts the forkserver, for
#: :mod:`nblaunch.engines.forkserver_guard` to know its kernel by.
FORKSERVER_STARTER_ENV = "NBLAUNCH_FORKSERVER_STARTER"


@dataclass
class RankPlan:
    method: str
    notice: Optional[str]  # why auto did not fork
    backend: Optional[str]  # None: no process group
    ctx: Any
    pg_timeout: float
    specs_base: dict  # WorkerSpec fields shared by every rank

    @property
    def forked(self) -> bool:
        return self.method == "fork"


def plan_ranks(config: LaunchConfig, live: bool = False, shared: bool = False) -> RankPlan:
    """Start method, backend, threads and the ranks' common spec. ``shared``:
    other launches' threads run in this process (see :func:`choose_start_method`)."""
    n = config.num_processes
    method, reason = choose_start_method(config.start_method, shared=shared)
    if config.background and reason == SHARED_NOTICE:
        reason = None  # a background run always starts so (README); the header says forkserver
    gpus = len(config.devices) if config.devices is not None else None
    backend = _resolve_backend(config.backend, n, gpus) if config.init_process_group else None
    threads = config.threads_per_rank or default_threads(n, config.cpus)
    if method == "forkserver":
        _preload_forkserver()
    # Live ranks set their group's timeout per call (worker._call_timeout).
    pg_timeout = pg_timeout_for(None if live else config.timeout)
    specs_base = dict(
        world_size=n, local_world_size=n, master_addr=config.addr, kernel_pid=os.getpid(), backend=backend,
        threads=threads, pg_timeout_s=pg_timeout, env={**_interface_env(config.addr), **_accelerate_env(), **share_env(config)},
        max_restarts=config.max_restarts, run_id=config.rdzv_id if config.multi_node else "none",
        environ=rank_env.rank_environ(), logging_setup=rank_env.kernel_logging(), live=live,
        forked=method == "fork", kernel_facts=rank_env.kernel_facts() if method == "fork" else None)
    return RankPlan(method, reason, backend, multiprocessing.get_context(method), pg_timeout, specs_base)


SHARED_WHY = ("other threads of this kernel run meanwhile, and a fork copies whatever lock one of them "
              "holds (a hang in the ranks)")
SHARED_NOTICE = "ranks start from the forkserver: " + SHARED_WHY


def choose_start_method(requested: str = "auto", shared: bool = False) -> tuple[str, Optional[str]]:
    """Return ``(method, notice)``; ``notice`` says why auto did not fork.

    Fork is chosen only on Linux with CUDA not initialised in this process
    (checked without initialising it). A forked rank is started from a fresh
    thread, which keeps it safe from the kernel's OpenMP state. ``shared``:
    other threads of this process run code of their own while the ranks
    are made (a background run's cell goes on; another launch's store and
    watch): a fork copies whatever lock one of them holds at that instant
    (glibc's resolver lock, held during a store's ``getnameinfo``, hung
    ranks so), and no thread of the kernel can be made quiet. The
    forkserver is the one zygote made before any of those threads: a fresh
    interpreter, single-threaded, started once per kernel by ``exec``;
    ranks forked from it inherit no lock. So ``auto`` picks it, and
    ``fork`` is refused.
    """
    available = multiprocessing.get_all_start_methods()
    cuda_busy = _cuda_initialized()
    if shared and requested in ("auto", "fork") and "forkserver" in available:
        if requested == "fork":
            raise ValueError("start_method='fork' cannot be used while other runs are in flight in this kernel: "
                             + SHARED_WHY + ". Use 'auto' (the forkserver).")
        return "forkserver", SHARED_NOTICE
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


def default_threads(num_processes: int, cpus: Optional[tuple] = None) -> int:
    """Intra-op threads for each rank: the CPUs this process may use (or the
    run's ``cpus``) split evenly, at least 1, never more than the kernel's own setting."""
    import torch

    if cpus is not None:
        count = len(cpus)
    else:
        try:
            count = len(os.sched_getaffinity(0))
        except AttributeError:
            count = os.cpu_count() or 1
    return max(1, min(torch.get_num_threads(), count // num_processes))


#: The CPUs a rank is pinned to (``cpus=``), read by ``rank.setup.setup_torch``.
CPUS_ENV = "NBLAUNCH_CPUS"


def share_env(config: LaunchConfig) -> dict:
    """A run's share of the machine, as its ranks' variables: the GPUs it
    sees (``devices=``), the CPUs each rank is pinned to (``cpus=``)."""
    env = {}
    if config.devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, config.devices))
    if config.cpus is not None:
        env[CPUS_ENV] = ",".join(map(str, config.cpus))
    return env


def _preload_forkserver() -> None:
    """Have the forkserver (started once per kernel, from a fresh interpreter
    that never touched CUDA or OpenMP) import torch, so the second and later
    launches do not pay ``import torch`` per rank. Only takes effect if this
    kernel's forkserver is not running yet. The forkserver's guard learns
    which process is its kernel from :data:`FORKSERVER_STARTER_ENV`
    (:func:`starting_ranks`)."""
    multiprocessing.get_context("forkserver").set_forkserver_preload(
        ["nblaunch.engines.forkserver_guard", "nblaunch.rank.worker", "torch", "torch.distributed", "cloudpickle"])


@contextlib.contextmanager
def starting_ranks(method: str):
    """Around the starts of a generation's processes: the forkserver, which
    the first start may start, inherits the environment as it is then, and
    :data:`FORKSERVER_STARTER_ENV` names this kernel in it only meanwhile,
    so that the kernel's own environment is left as it was."""
    if method != "forkserver" or not sys.platform.startswith("linux"):
        yield
        return
    before = os.environ.get(FORKSERVER_STARTER_ENV)
    os.environ[FORKSERVER_STARTER_ENV] = procid.identity(os.getpid())
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(FORKSERVER_STARTER_ENV, None)
        else:
            os.environ[FORKSERVER_STARTER_ENV] = before


def _cuda_initialized() -> bool:
    if "torch" not in sys.modules:
        return False
    import torch  # waits if another thread is still importing it

    return bool(torch.cuda.is_initialized())


def _resolve_backend(backend: str, num_processes: int, gpus: Optional[int] = None) -> str:
    import torch

    # NVML's count: does not initialise CUDA.
    where = "visible" if gpus is None else "in devices="
    gpus = torch.cuda.device_count() if gpus is None else gpus
    return resolve_backend(backend, num_processes, gpus, torch.distributed.is_nccl_available(), where=where)


def resolve_backend(backend: str, ranks: int, gpus: int, nccl_available: bool, where: str = "visible") -> str:
    """The one backend rule, for a machine (or a cluster's node with the
    fewest GPUs) that runs ``ranks`` ranks and has ``gpus`` GPUs: ``auto``
    is NCCL when every rank has a GPU and NCCL is built in, else gloo; NCCL
    asked for without a GPU per rank is refused."""
    if backend == "auto":
        return "nccl" if gpus >= ranks and nccl_available else "gloo"
    if backend == "nccl" and gpus < ranks:
        raise ValueError(f"backend='nccl' needs one GPU per rank: {ranks} ranks, "
                         f"{gpus} GPU(s) {where}. Use backend='gloo' or 'auto'.")
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
