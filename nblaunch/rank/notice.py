"""The preemption notice as the ranks of a node read it: a file in the
folder of their own files (the pool's folder on that node), written by the
kernel's side (``RankPool.preempt``) or by a rank that got SLURM's SIGTERM
(:mod:`nblaunch.rank.term`), read by ``nblaunch.preempted()``."""
from __future__ import annotations

import os

__all__ = ["NOTICE_FILE", "write_notice"]

NOTICE_FILE = "preempted"


def write_notice(folder: str, text: str) -> None:
    """The notice, for the ranks whose files are in ``folder``."""
    tmp = os.path.join(folder, f".{NOTICE_FILE}.{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, os.path.join(folder, NOTICE_FILE))
