"""Where each rank's full output is kept.

One folder per launch under ``$NBLAUNCH_LOG_DIR`` (default
``$XDG_CACHE_HOME/nblaunch/logs``, i.e. ``~/.cache/nblaunch/logs``), holding
``rank<N>.log`` with every byte the rank wrote to stdout/stderr. Only the
newest ``KEEP`` launch folders are kept; older ones are removed when a new
launch starts.
"""
from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import psutil

__all__ = ["log_root", "new_launch_dir", "KEEP"]

KEEP = 20


def log_root() -> Path:
    explicit = os.environ.get("NBLAUNCH_LOG_DIR")
    if explicit:
        return Path(explicit)
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "nblaunch" / "logs"


def new_launch_dir() -> Path:
    """Create a fresh folder for one launch and prune the oldest ones."""
    root = log_root()
    root.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = root / f"{stamp}-{os.getpid()}-{time.time_ns() % 10**9:09d}"
    path.mkdir()
    _prune(root)
    return path


def _prune(root: Path) -> None:
    """Remove all but the newest ``KEEP`` launch folders. Folders of another
    kernel that is still running are left to that kernel: one of them may
    belong to its launch in progress. Several kernels may prune at once."""
    me = os.getpid()
    launches = sorted(p.name for p in root.iterdir() if _owner(p.name) is not None)
    for name in launches[:-KEEP]:
        owner = _owner(name)
        if owner != me and psutil.pid_exists(owner):
            continue
        shutil.rmtree(root / name, ignore_errors=True)


def _owner(name: str):
    """The pid in a launch folder's name (``<date>-<time>-<pid>-<n>``)."""
    parts = name.split("-")
    return int(parts[2]) if len(parts) == 4 and parts[2].isdigit() else None
