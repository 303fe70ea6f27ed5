"""Rank functions that live in an importable module, so that
``torch.multiprocessing`` with spawn can run them at all (it cannot run a
function defined in a notebook cell). The benchmark kernel imports this file
and hands the same functions to every launcher."""
from __future__ import annotations

import json
import os

import psutil
import torch
import torch.distributed as dist


def _group() -> None:
    if not dist.is_initialized():
        dist.init_process_group("gloo")


def job() -> float:
    """The trivial launch: a process group, one all_reduce."""
    _group()
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def torch_rank(index: int, n: int, port: int, fn=job, *args) -> None:
    """``torch.multiprocessing.start_processes`` entry: set the env, run ``fn``."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(index),
                      WORLD_SIZE=str(n), LOCAL_RANK=str(index))
    fn(*args)
    dist.destroy_process_group()


def tree_pss(pid: int) -> int:
    """Proportional set size of process ``pid`` and all its descendants.

    PSS splits each shared page among the processes that map it, so this
    sum counts a page shared copy-on-write or through shared memory once.
    """
    root = psutil.Process(pid)
    total = 0
    for proc in [root, *root.children(recursive=True)]:
        try:
            total += proc.memory_full_info().pss
        except psutil.Error:  # exited meanwhile
            pass
    return total


def hold(tensor: torch.Tensor, out_dir: str, kernel_pid: int) -> None:
    """Read the big tensor, then record memory while every rank holds it.

    ``uss``: memory only this rank owns (a copy of the tensor would show here).
    ``tree_pss`` (rank 0): the kernel's whole process tree, ranks and helpers
    included, for the kernel to compare with its reading before the launch.
    """
    _group()
    tensor.sum()  # read every page
    dist.barrier()
    record = {"uss": psutil.Process().memory_full_info().uss}
    dist.barrier()  # every rank holds the tensor and has measured itself
    if dist.get_rank() == 0:
        record["tree_pss"] = tree_pss(kernel_pid)
    dist.barrier()  # no rank exits before rank 0 has measured
    with open(os.path.join(out_dir, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(record, f)
