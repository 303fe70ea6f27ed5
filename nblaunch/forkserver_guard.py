"""Imported first by the kernel's forkserver (see ``plan._preload_forkserver``).

The forkserver imports torch before it serves its first fork (most of a
second, seconds on a busy machine) and only notices that its kernel is gone
once it serves: a kernel killed in that window left it running for 1.1-1.5 s
(measured). Its own watch cannot be trusted earlier either: the kernel's
first request, queued on the forkserver's socket, holds a copy of the
"alive" pipe's write end, so that pipe never reaches EOF. Here, before torch
(importing nblaunch does not import it):

* Linux is asked to end the forkserver when the thread that started it
  (nblaunch's starter thread, which lives as long as the kernel) ends;
* a kernel that died before that request is looked for once, now;
* a small watcher process, forked now (before any thread or torch), waits
  for the kernel's exit (a pidfd) and ends the forkserver: a process, since
  a thread would wait for the GIL while torch initialises (0.5-0.8 s
  measured). The watcher ends with the forkserver.
"""
import ctypes
import os
import select
import signal
import sys
import time

_PR_SET_PDEATHSIG = 1


def _gone(pid: int) -> bool:
    """Ended: no process, or a zombie waiting to be reaped."""
    try:
        with open(f"/proc/{pid}/status") as f:
            state = next((line.split()[1] for line in f if line.startswith("State:")), "")
    except (OSError, IndexError):
        return True
    return state in ("Z", "X")


def _orphaned(parent: int) -> bool:
    """The kernel ended before this ran and the forkserver was handed to
    another parent. Jupyter starts a kernel as the leader of its own process
    group, which the forkserver is in: a group whose leader is gone, while
    the parent is someone else, is that case."""
    leader = os.getpgid(0)
    return parent != leader and leader != os.getpid() and _gone(leader)


def _wait_for_exit(pid: int) -> None:
    try:
        fd = os.pidfd_open(pid)  # Linux >= 5.3: readable once the process has ended
    except (AttributeError, OSError):
        fd = -1
    if fd >= 0 and not _gone(pid):
        select.select([fd], [], [])
        return
    while not _gone(pid):
        time.sleep(0.1)


def _guard() -> None:
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    kernel, forkserver = os.getppid(), os.getpid()
    if _gone(kernel) or _orphaned(kernel):
        os._exit(1)
    if os.fork() == 0:  # the watcher
        try:
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)  # ends with the forkserver
            if os.getppid() == forkserver:
                _wait_for_exit(kernel)
                os.kill(forkserver, signal.SIGKILL)
        finally:
            os._exit(0)


try:
    _guard()
except (OSError, AttributeError):  # no prctl or no fork: the forkserver's own watch, once it serves
    pass
