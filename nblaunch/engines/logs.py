"""Where each rank's full output is kept.

One folder per launch under ``$NBLAUNCH_LOG_DIR`` (default
``$XDG_CACHE_HOME/nblaunch/logs``, i.e. ``~/.cache/nblaunch/logs``), holding
``rank<N>.log`` with every byte the rank wrote to stdout/stderr. Only the
newest ``KEEP`` launch folders are kept; older ones are removed when a new
launch starts, never one still in use.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

import psutil

__all__ = ["log_root", "new_launch_dir", "release_launch_dir", "KEEP"]

KEEP = 20
_running: set = set()  # this process's launch folders in use: never pruned
_lock = threading.Lock()


def log_root() -> Path:
    explicit = os.environ.get("NBLAUNCH_LOG_DIR")
    if explicit:
        return Path(explicit)
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "nblaunch" / "logs"


def new_launch_dir() -> tuple[Path, Optional[str]]:
    """Create a fresh folder for one launch and prune the oldest ones.
    Returns ``(folder, notice)``: when the log root cannot be written (a
    read-only ``NBLAUNCH_LOG_DIR``, an unwritable home), the folder is a
    temporary one and the notice says so; the launch goes on."""
    notice = None
    try:
        root = log_root()
        path = _make_in(root)
    except OSError as exc:
        root = Path(tempfile.gettempdir()) / "nblaunch-logs"
        notice = f"cannot write logs under {log_root()} ({exc.strerror or exc}); using {root}"
        path = _make_in(root)
    with _lock:
        _running.add(path.name)  # before pruning: the new folder is in use from its first instant
    try:
        _prune(root)
    except OSError:
        pass
    return path, notice


def release_launch_dir(path: Path) -> None:
    """The launch that used ``path`` is over: pruning may take it in turn."""
    with _lock:
        _running.discard(path.name)


def _make_in(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    # One clock reading for both parts: a second read for the nanoseconds
    # could fall in the next second, and the name would sort among its elders.
    now = time.time_ns()
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now // 10**9))
    path = root / f"{stamp}-{os.getpid()}-{now % 10**9:09d}"
    path.mkdir()
    return path


def _prune(root: Path) -> None:
    """Remove all but the newest ``KEEP`` launch folders. Folders of another
    kernel that is still running are left to that kernel: one of them may
    belong to its launch in progress. Several kernels may prune at once."""
    me = os.getpid()
    launches = sorted(p.name for p in root.iterdir() if _owner(p.name) is not None)
    for name in launches[:-KEEP]:
        owner = _owner(name)
        if (owner != me and psutil.pid_exists(owner)) or name in _running:
            continue
        shutil.rmtree(root / name, ignore_errors=True)


def _owner(name: str):
    """The pid in a launch folder's name (``<date>-<time>-<pid>-<n>``)."""
    parts = name.split("-")
    return int(parts[2]) if len(parts) == 4 and parts[2].isdigit() else None
