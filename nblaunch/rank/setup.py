"""Becoming a rank: the streams and fds, the kernel's environment recreated
(:mod:`nblaunch.rank.env`), torchrun's and SLURM's variables, torch's threads,
device and process group. A zygote (:mod:`nblaunch.engines.zygote`) does the
part every rank shares once, before it forks them (:func:`prepare_for_ranks`).
"""
from __future__ import annotations

import datetime
import faulthandler
import io
import os
import sys
import time
from multiprocessing.connection import Connection
from typing import Any, Union

from .progress import torch_imported
from ..wire.channel import EventSender, Phase
from . import debugger, env as rank_env, lifeline
from .spec import WorkerSpec

__all__ = ["prepare_for_ranks", "prepared", "prepared_output", "become_rank", "point_fds", "torchrun_env",
           "slurm_env", "setup_torch", "ranks_store", "wait_for_peers_joined"]

# None: this process is not ready to be a rank; True: it is (a rank forked
# by nblaunch.engines.zygote, which made itself ready once for all its ranks); an
# exception: making it ready failed, and each rank raises it.
_prepared: Any = None
_prepared_said = b""  # what making it ready wrote on fds 1/2: each rank writes it on its own


def prepared() -> Union[None, bool, BaseException]:
    """None: :func:`prepare_for_ranks` did not run in this process; True: it
    did; an exception: it failed with that, and each rank raises it."""
    return _prepared


def prepared_output() -> bytes:
    """What :func:`prepare_for_ranks` wrote on fds 1/2, for each rank to write on its own."""
    return _prepared_said


def prepare_for_ranks(spec: WorkerSpec) -> None:
    """Everything of becoming a rank that is the same for every rank of a
    generation, done in :mod:`nblaunch.engines.zygote`'s process before it
    forks them (the rest follows in :func:`nblaunch.rank.worker.run_worker`).
    What it writes (a shim that could not adapt a library says so) is kept
    for the ranks' output; this process's fds 0-2 are /dev/null afterwards."""
    global _prepared, _prepared_said
    import tempfile

    lifeline.default_stop_signals()
    with tempfile.TemporaryFile() as said:
        os.dup2(said.fileno(), 1)
        os.dup2(said.fileno(), 2)
        try:
            become_rank(spec)
            debugger.install_hooks()
            _prepared = True
        except BaseException as exc:  # noqa: BLE001 - each rank reports it
            _prepared = exc
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        said.seek(0)
        _prepared_said = said.read()
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)


def become_rank(spec: WorkerSpec) -> None:
    """Make this process the rank ``spec`` describes (:func:`nblaunch.rank.env.become_rank`),
    on line-buffered streams of its own."""
    old_streams = _own_streams()
    rank_env.become_rank(spec.environ if spec.environ is not None else rank_env.rank_environ(),
                         old_streams, spec.logging_setup, forked=spec.forked, kernel_facts=spec.kernel_facts)


def point_fds(output: Connection) -> None:
    """Point fds 1 and 2 at the kernel's output pipe for this rank, and fd 0
    at /dev/null."""
    fd = output.fileno()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    output.close()
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)


def _own_streams() -> tuple:
    """Give Python line-buffered streams on fds 0-2 (the kernel's own
    streams, inherited through fork, would talk to the kernel's sockets).
    Returns the streams ``sys.stdout``/``sys.stderr`` were before."""
    old = (sys.stdout, sys.stderr)

    def stream(num: int) -> io.TextIOWrapper:
        raw = open(num, "wb", closefd=False)
        return io.TextIOWrapper(raw, encoding="utf-8", errors="backslashreplace", line_buffering=True)

    sys.stdout = sys.__stdout__ = stream(1)
    sys.stderr = sys.__stderr__ = stream(2)
    sys.stdin = sys.__stdin__ = open(0, "r", closefd=False)
    faulthandler.enable(file=sys.stderr, all_threads=True)
    return old


def torchrun_env(spec: WorkerSpec) -> dict[str, str]:
    """The variables torchrun gives a rank (``RANK``, ``MASTER_PORT``...), for ``spec``."""
    env = {
        "RANK": spec.rank,
        "LOCAL_RANK": spec.local_rank,
        "WORLD_SIZE": spec.world_size,
        "LOCAL_WORLD_SIZE": spec.local_world_size,
        "GROUP_RANK": spec.group_rank,
        "NODE_RANK": spec.group_rank,
        "GROUP_WORLD_SIZE": spec.num_nodes,
        "ROLE_NAME": "default",
        "ROLE_RANK": spec.rank,
        "ROLE_WORLD_SIZE": spec.world_size,
        "MASTER_ADDR": spec.master_addr,
        "MASTER_PORT": spec.master_port,
        # The kernel hosts the TCPStore (bound to a free port it chose, so two
        # launches can never race for one); env:// then makes every rank a
        # client of it, exactly as under torchrun's agent.
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RESTART_COUNT": spec.restart_count,
        "TORCHELASTIC_MAX_RESTARTS": spec.max_restarts,
        "TORCHELASTIC_RUN_ID": spec.run_id,
        "OMP_NUM_THREADS": spec.threads,
        "NBLAUNCH_RANK": spec.rank,
    }
    return {k: str(v) for k, v in env.items()}


# SLURM's per-task variables, and what each must say in a rank.
_SLURM_TASK_VARS = {
    "SLURM_PROCID": lambda s: s.rank,
    "SLURM_LOCALID": lambda s: s.local_rank,
    "SLURM_NODEID": lambda s: s.group_rank,
    "SLURM_NTASKS": lambda s: s.world_size,
    "SLURM_NPROCS": lambda s: s.world_size,
    "SLURM_STEP_NUM_TASKS": lambda s: s.world_size,
    "SLURM_NTASKS_PER_NODE": lambda s: s.local_world_size,
    "SLURM_STEP_TASKS_PER_NODE": lambda s: s.local_world_size,
    "SLURM_TASKS_PER_NODE": lambda s: s.local_world_size,
    "SLURM_NNODES": lambda s: s.num_nodes,
    "SLURM_STEP_NUM_NODES": lambda s: s.num_nodes,
    "SLURM_GTIDS": lambda s: ",".join(str(s.rank - s.local_rank + i) for i in range(s.local_world_size)),
}


def slurm_env(spec: WorkerSpec, environ) -> dict[str, str]:
    """A kernel inside a SLURM job (a Jupyter server started by ``srun`` or
    batchspawner) has one task's variables: every rank would inherit
    ``SLURM_PROCID=0`` and ``SLURM_NTASKS=1``, and code that trusts SLURM
    (Lightning's and submitit's environments, ignite) would give every rank
    the same number. Those the kernel has are rewritten to agree with
    ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE`` and the node; the job's own
    variables (its id, its allocation) are kept."""
    return {name: str(value(spec)) for name, value in _SLURM_TASK_VARS.items() if name in environ}


def setup_torch(spec: WorkerSpec, sender: EventSender) -> bool:
    """Threads, device and process group. Returns True if a group was made."""
    if "torch" not in sys.modules:  # spawn, forkserver without its preload: seconds on a busy machine
        sender.send(Phase(spec.local_rank, "importing torch"))
    import torch

    torch_imported()
    cpus = os.environ.get("NBLAUNCH_CPUS")  # plan.CPUS_ENV: a run's cpus=, before torch's threads exist
    if cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, [int(c) for c in cpus.split(",")])
    torch.set_num_threads(spec.threads)
    if torch.cuda.is_available() and spec.local_rank < torch.cuda.device_count():
        torch.cuda.set_device(spec.local_rank)
    if spec.backend is None:
        return False
    import torch.distributed as dist

    sender.send(Phase(spec.local_rank, "joining the process group"))
    dist.init_process_group(
        backend=spec.backend,
        init_method="env://",
        rank=spec.rank,
        world_size=spec.world_size,
        timeout=datetime.timedelta(seconds=spec.pg_timeout_s),
    )
    _joined_store(spec, add=1)
    return True


_JOINED_WAIT_S = 30.0


def _joined_store(spec: WorkerSpec, add: int) -> int:
    """Count this rank in (``add=1``), or read (``add=0``), how many ranks
    have made the process group, on the ranks' store (hosted by the kernel,
    so it outlives every rank). Returns the count; -1 without a store."""
    try:
        return int(ranks_store().add(f"nblaunch/joined/{spec.restart_count}", add))
    except Exception:  # a backend without a default store: nothing to wait for
        return -1


def ranks_store():
    """The store the ranks made their process group through (the kernel's
    TCPStore, under the group's prefix). torch has no public accessor."""
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_store()


def wait_for_peers_joined(spec: WorkerSpec) -> None:
    """gloo's init connects every pair of ranks, and a rank is through once
    its own pairs are: a rank whose fn returns at once could tear its pairs
    down while a slower peer is still connecting ("Gloo connectFullMesh
    failed ... Connection closed by peer", seen under load). It leaves only
    once every rank has made the group (bounded: a peer that never does is
    the kernel's to report)."""
    deadline = time.monotonic() + _JOINED_WAIT_S
    delay = 0.001
    while 0 <= _joined_store(spec, add=0) < spec.world_size and time.monotonic() < deadline:
        time.sleep(delay)
        delay = min(2 * delay, 0.05)
