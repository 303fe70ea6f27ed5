"""nblaunch: distributed PyTorch training as one call from a notebook cell."""
import sys


def _started_as_agent() -> bool:
    """This process is a cluster node's agent (``python -m nblaunch.engines.agent``)."""
    argv = getattr(sys, "orig_argv", ())
    return any(a == "-m" and b == "nblaunch.engines.agent" for a, b in zip(argv, argv[1:]))


# Where each public name lives: the doors (this folder's modules) and the
# rank-side API (``rank/``). An agent imports each on first use.
_LAZY = {"notebook_launcher": ".launcher", "LaunchResults": ".session", "Ranks": ".live", "start": ".live",
         "submit": ".background.submit", "runs": ".background.submit", "Run": ".background.in_kernel",
         "RunStopped": ".errors", "attach": ".background.detached", "debug": ".watch.postmortem",
         "progress": ".rank.progress", "log": ".rank.progress", "sharded_loader": ".rank.data",
         "preempted": ".rank.notice", "preempt_reason": ".rank.notice", "Ray": ".clusters", "Slurm": ".clusters", "Spark": ".clusters", **dict.fromkeys(
             ("LaunchError", "LaunchTimeout", "Preempted", "RankFailure", "WorkerError"), ".errors")}

if _started_as_agent():
    # A node's agent needs none of what a kernel imports here (the launcher,
    # the session, the views): about 0.25 s of CPU on every node's way to
    # its first step, where srun's rank pays only for torch. What its ranks'
    # code asks of ``nblaunch`` (``nblaunch.progress``...) is imported then.
    from .errors import LaunchError, LaunchTimeout, Preempted, RankFailure, WorkerError

    def __getattr__(name: str):
        if name not in _LAZY:
            raise AttributeError(f"module 'nblaunch' has no attribute {name!r}")
        import importlib

        value = globals()[name] = getattr(importlib.import_module(_LAZY[name], __name__), name)
        return value
else:
    from .errors import LaunchError, LaunchTimeout, Preempted, RankFailure, RunStopped, WorkerError
    from .launcher import notebook_launcher
    from .live import Ranks, start
    from .session import LaunchResults
    from .background.submit import runs, submit
    from .background.in_kernel import Run
    from .background.detached import attach
    from .watch.postmortem import debug
    from .rank.progress import log, progress
    from .rank.data import sharded_loader
    from .rank.notice import preempt_reason, preempted
    from .clusters import Ray, Slurm, Spark

__all__ = ["notebook_launcher", "start", "Ranks", "LaunchResults", "progress", "log", "sharded_loader", "LaunchError",
           "WorkerError", "LaunchTimeout", "Preempted", "preempted", "preempt_reason", "RankFailure", "Slurm", "Ray", "Spark", "debug",
           "submit", "Run", "RunStopped", "runs", "attach"]
__version__ = "0.1.0"


def load_ipython_extension(ipython) -> None:
    """``%load_ext nblaunch``: registers the ``%%nblaunch`` cell magic."""
    from .magic import load_ipython_extension as load

    load(ipython)
