"""nblaunch: distributed PyTorch training as one call from a notebook cell."""
import sys


def _started_as_agent() -> bool:
    """This process is a cluster node's agent (``python -m nblaunch.engines.agent``)."""
    argv = getattr(sys, "orig_argv", ())
    return any(a == "-m" and b == "nblaunch.engines.agent" for a, b in zip(argv, argv[1:]))


# Where each public name lives (what an agent imports on first use).
_LAZY = {"sharded_loader": ".data", "notebook_launcher": ".launcher", "debug": ".postmortem",
         "preempted": ".preempt", "progress": ".progress", "log": ".progress", "LaunchResults": ".session",
         "Ranks": ".live", "start": ".live", "runs": ".background", "submit": ".background",
         "Run": ".runs", "RunStopped": ".runs", "attach": ".detached", "Ray": ".engines.ray",
         "Slurm": ".engines.slurm", **dict.fromkeys(
             ("LaunchError", "LaunchTimeout", "Preempted", "RankFailure", "WorkerError"), ".errors")}

if _started_as_agent():
    # A node's agent needs none of what a kernel imports here (the launcher,
    # the session, the views): about 0.25 s of CPU on every node's way to
    # its first step, where srun's rank pays only for torch. What its ranks'
    # code asks of ``nblaunch`` (``nblaunch.progress``...) is imported then.
    from .errors import LaunchError, LaunchTimeout, Preempted, RankFailure, WorkerError
    from .progress import log, progress  # the ranks import the module ``progress``: the function's name must win

    def __getattr__(name: str):
        if name not in _LAZY:
            raise AttributeError(f"module 'nblaunch' has no attribute {name!r}")
        import importlib

        importlib.import_module(_LAZY[name], __name__)
        # Importing a submodule binds its name here (``nblaunch.runs``, the
        # module, over ``runs``, the function): the public names win.
        for public, where in _LAZY.items():
            module = sys.modules.get(__name__ + where)
            if module is not None:
                globals()[public] = getattr(module, public)
        return globals()[name]
else:
    from .data import sharded_loader
    from .errors import LaunchError, LaunchTimeout, Preempted, RankFailure, WorkerError
    from .launcher import notebook_launcher
    from .postmortem import debug
    from .preempt import preempted
    from .progress import log, progress
    from .live import Ranks, start
    from .session import LaunchResults
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
