"""The preemption notice as the ranks of a node read it: a file in the
folder of their own files (the pool's folder on that node), written by the
kernel's side (``RankPool.preempt``) or by a rank that got SLURM's SIGTERM
(:mod:`nblaunch.rank.term`), read by ``nblaunch.preempted()``."""
from __future__ import annotations

import os

from ..system.files import write_atomically
from .spec import current_spec

__all__ = ["NOTICE_FILE", "write_notice", "preempted", "preempt_reason"]

NOTICE_FILE = "preempted"


def write_notice(folder: str, text: str) -> None:
    """The notice, for the ranks whose files are in ``folder``."""
    write_atomically(os.path.join(folder, NOTICE_FILE), text)


_seen = False
_agreed = ""  # the reason of the notice that reached another rank, learnt when ``agree=True`` turned true


def preempted(agree: bool = False) -> bool:
    """In a rank: True once the job was told to end (SLURM's SIGTERM or
    SIGUSR1 to the kernel, a node's agent or a rank, a Ray node being
    drained: see the module doc); the rank then has the launch's
    ``preempt_grace`` seconds to save and return. False outside a rank.

    ``agree=True`` makes it a collective on the default process group (every
    rank must call it at the same point, as with any collective): True on
    every rank if the notice reached any, so that all save at the same step
    (and ``preempt_reason()`` then says why on every rank, those the notice
    had not reached yet too). The notice reaches every rank within a few
    milliseconds, but a rank between two checks may see it one step later
    than another."""
    global _seen, _agreed
    if not _seen:
        _seen = _notice_here()
    if not agree:
        return _seen
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return _seen
    flag = torch.tensor([1.0 if _seen else 0.0])
    if dist.get_backend() == "nccl":
        flag = flag.cuda()
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item() and not _agreed:  # every rank is here at once, on the same call: one more collective
        reasons: list = [None] * dist.get_world_size()
        dist.all_gather_object(reasons, preempt_reason())
        _agreed = next((r for r in reasons if r), "") or "a notice to another rank"
    _seen = bool(flag.item())
    return _seen


def preempt_reason() -> str:
    """In a rank: why ``preempted()`` turned true, "" before (and outside a rank):
    ``resize: n3 is back`` (nodes came back: the launch calls ``fn`` again on
    more nodes once the ranks return), ``SIGTERM to the kernel``, ``SIGUSR1 to
    this node's agent``... Either way: save and return."""
    path = _notice_path()
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip()
    except (OSError, TypeError):
        return _agreed


def _notice_path():
    spec = current_spec()
    if spec is None or not spec.stack_file:
        return None
    return os.path.join(os.path.dirname(spec.stack_file), NOTICE_FILE)


def _notice_here() -> bool:
    path = _notice_path()
    return path is not None and os.path.exists(path)
