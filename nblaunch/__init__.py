"""nblaunch: distributed PyTorch training as one call from a notebook cell."""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__all__ = ["notebook_launcher", "start", "Ranks", "LaunchResults", "progress", "log", "sharded_loader", "LaunchError",
           "WorkerError", "LaunchTimeout", "RankFailure"]
__version__ = "0.1.0"

# ``progress`` is bound here, at once, and stays the bar (the submodule of the
# same name is ``nblaunch.progress`` in sys.modules). It is light; the other
# public names are imported when first used (PEP 562), so that importing one
# submodule (a rank's worker, the forkserver's guard) does not import the
# whole package.
from .progress import log, progress  # noqa: E402

_HOME = {"notebook_launcher": "launcher", "LaunchResults": "session", "start": "session", "Ranks": "session",
         "sharded_loader": "data", "LaunchError": "errors",
         "WorkerError": "errors", "LaunchTimeout": "errors", "RankFailure": "errors"}

if TYPE_CHECKING:
    from .data import sharded_loader
    from .errors import LaunchError, LaunchTimeout, RankFailure, WorkerError
    from .launcher import notebook_launcher
    from .session import LaunchResults, Ranks, start


def __getattr__(name: str):
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'nblaunch' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{home}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOME])


def load_ipython_extension(ipython) -> None:
    """``%load_ext nblaunch``: registers the ``%%nblaunch`` cell magic."""
    from .magic import load_ipython_extension as load

    load(ipython)
