"""A rank's place in the launch (:class:`WorkerSpec`), and whether this
code runs in a rank at all (:func:`current_spec`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

__all__ = ["WorkerSpec", "current_spec", "set_current"]

_current: Optional["WorkerSpec"] = None


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a rank needs to know about its place in the launch."""

    rank: int  # global; until the go message, the local rank
    local_rank: int
    world_size: int
    local_world_size: int
    master_addr: str
    kernel_pid: int
    backend: Optional[str]  # None: fn initialises the process group itself
    threads: int
    pg_timeout_s: float
    env: dict = field(default_factory=dict)  # extra variables for this rank
    master_port: int = 0  # set by the go message
    stack_file: str = ""  # where faulthandler dumps this rank's stacks on SIGUSR1
    group_rank: int = 0  # this node's rank
    num_nodes: int = 1
    restart_count: int = 0
    max_restarts: int = 0
    run_id: str = "none"
    # What the rank recreates of the kernel (see rank_env): its environment
    # at launch time (None: this process's own) and its root logging set-up.
    environ: Optional[dict] = None
    logging_setup: tuple = ()
    live: bool = False  # a live session's rank: serves calls until told to close
    forked: bool = False  # started by fork: it inherited the kernel's memory (and the job)
    kernel_facts: Optional[dict] = None  # rank_env.kernel_facts(), looked up in the kernel before a fork
    interrupt_file: str = ""  # a live rank: which call the kernel's SIGINT is for


def current_spec() -> Optional[WorkerSpec]:
    """The spec of the rank this code runs in, or None outside a launch."""
    return _current


def set_current(spec: WorkerSpec) -> None:
    """This process is now the rank ``spec`` describes (once, as it starts)."""
    global _current
    _current = spec

