"""nblaunch: distributed PyTorch training as one call from a notebook cell."""
from .data import sharded_loader
from .errors import LaunchError, LaunchTimeout, Preempted, RankFailure, WorkerError
from .launcher import notebook_launcher
from .postmortem import debug
from .preempt import preempted
from .progress import log, progress
from .session import LaunchResults, Ranks, start
from .background import runs, submit
from .runs import Run, RunStopped
from .detached import attach
from .engines.ray import Ray
from .engines.slurm import Slurm

__all__ = ["notebook_launcher", "start", "Ranks", "LaunchResults", "progress", "log", "sharded_loader", "LaunchError",
           "WorkerError", "LaunchTimeout", "Preempted", "preempted", "RankFailure", "Slurm", "Ray", "debug",
           "submit", "Run", "RunStopped", "runs", "attach"]
__version__ = "0.1.0"


def load_ipython_extension(ipython) -> None:
    """``%load_ext nblaunch``: registers the ``%%nblaunch`` cell magic."""
    from .magic import load_ipython_extension as load

    load(ipython)
