"""A process's identity: its pid with its start time, so a pid the kernel
reuses for another process is never taken for the one that ended. Facts
about a process are decided from this, never from its process group,
session, TTY or parent being init."""
from __future__ import annotations

from typing import Optional

__all__ = ["start_time", "identity", "same_process", "gone"]


def start_time(pid: int) -> Optional[int]:
    """``pid``'s start time (clock ticks after boot, the 22nd field of
    /proc/PID/stat); None where there is no such process (or no /proc)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name (2nd field) may hold spaces and parentheses: split after its last ')'.
    return int(stat[stat.rindex(b")") + 2:].split()[19])


def identity(pid: int) -> str:
    """``"<pid>:<start time>"``, for another process to check with :func:`same_process`."""
    return f"{pid}:{start_time(pid)}"


def same_process(ident: str) -> bool:
    """Whether the process named by :func:`identity` still runs (a zombie has ended)."""
    pid, started = ident.split(":")
    return str(start_time(int(pid))) == started and not gone(int(pid))


def gone(pid: int) -> bool:
    """Ended: no process, or a zombie waiting to be reaped."""
    try:
        with open(f"/proc/{pid}/status") as f:
            state = next((line.split()[1] for line in f if line.startswith("State:")), "")
    except (OSError, IndexError):
        return True
    return state in ("Z", "X")
