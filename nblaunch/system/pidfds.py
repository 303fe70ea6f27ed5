"""Ranks named by pidfds: a handle on a rank's very process, whatever pid
the system gives out next.

A pidfd (Linux >= 5.3) is opened once per rank, the first time the rank
is signalled, and kept until the pool closes: every later signal goes to
that process and no other (``pidfd_send_signal``), and whether it has
ended is one ``poll`` of its fd, for a whole generation at once, with no
read of /proc. Where there are no pidfds, :mod:`nblaunch.engines.procs`
names processes through psutil, as before.
"""
from __future__ import annotations

import os
import select
import signal
import time
from typing import Callable, Optional

_PF_EXITING = 0x4  # include/linux/sched.h

__all__ = ["open_pidfd", "ended", "wait", "send", "exiting"]


def open_pidfd(pid: int, still_ours: Callable[[], bool]) -> Optional[int]:
    """A pidfd naming ``pid``; None where there is no such process or no
    pidfds. ``still_ours()`` is asked once the fd is open: whether the
    rank's parent has not reported it ended yet (so the fd names the rank,
    not a process that took its pid after it was reaped: a parent reports
    a rank's end as it reaps it, and a pid is given out again only once
    the system has gone through all the others)."""
    opener = getattr(os, "pidfd_open", None)
    if opener is None:
        return None
    try:
        fd = opener(pid)
    except OSError:
        return None
    if still_ours():
        return fd
    os.close(fd)
    return None


def ended(fds: list[int]) -> set[int]:
    """Those of ``fds`` whose process has ended (zombies included), in one ``poll``."""
    if not fds:
        return set()
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    return {fd for fd, _ in poller.poll(0)}


def wait(fds: list[int], timeout: float) -> bool:
    """Until every process of ``fds`` has ended (True) or ``timeout``
    passed: one ``poll`` per wake, whatever the number of processes."""
    deadline = time.monotonic() + timeout
    poller = select.poll()
    left = set(fds)
    for fd in left:
        poller.register(fd, select.POLLIN)
    while left:
        wait_ms = max(0, int((deadline - time.monotonic()) * 1000))
        for fd, _ in poller.poll(wait_ms):
            poller.unregister(fd)
            left.discard(fd)
        if wait_ms == 0:
            break
    return not left


def exiting(pid: int) -> bool:
    """Whether ``pid`` has begun to exit (Linux's ``PF_EXITING``, in the
    flags of /proc/PID/stat): it can start nothing any more, so what it
    started need not be looked for again. Asked only of a process whose
    pidfd has not ended, so ``pid`` still names it."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return True
    return bool(int(stat[stat.rindex(b")") + 2:].split()[6]) & _PF_EXITING)


def send(fd: int, sig: int) -> None:
    """``sig`` to the process ``fd`` names; nothing if it has ended."""
    try:
        signal.pidfd_send_signal(fd, sig)
    except (OSError, AttributeError):
        pass
