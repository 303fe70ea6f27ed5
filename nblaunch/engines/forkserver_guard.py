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
* a kernel that died before that request is looked for once, now, by its
  identity: the pid and start time it put in its environment
  (``plan.FORKSERVER_STARTER_ENV``) before starting the forkserver. Only
  that process's death counts: what started the kernel (a shell script that
  has exited, cron, a CI runner, a supervisor) and which process group or
  session it is in say nothing about it. A process that merely inherited
  the value (a child of the kernel that starts a forkserver of its own)
  names a kernel that still runs, not its parent, and is let be;
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

from ..system import procid
from ..system.linux import PR_SET_PDEATHSIG as _PR_SET_PDEATHSIG
from .plan import FORKSERVER_STARTER_ENV  # importing nblaunch has imported plan already


def _starter_died(parent: int) -> bool:
    """The kernel that started this forkserver ended before the guard ran
    (so this one was handed to a new parent): decided from the kernel's
    recorded identity alone."""
    ident = os.environ.get(FORKSERVER_STARTER_ENV, "")
    try:
        return int(ident.split(":")[0]) != parent and not procid.same_process(ident)
    except ValueError:
        return False  # not started by nblaunch's kernel: the parent checks still hold


def _wait_for_exit(pid: int) -> None:
    try:
        fd = os.pidfd_open(pid)  # Linux >= 5.3: readable once the process has ended
    except (AttributeError, OSError):
        fd = -1
    if fd >= 0 and not procid.gone(pid):
        select.select([fd], [], [])
        return
    while not procid.gone(pid):
        time.sleep(0.1)


def _guard() -> None:
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    kernel, forkserver = os.getppid(), os.getpid()
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    # Armed now: a parent that dies from here on kills us. One that died
    # before shows as a new parent (or, for a moment, as a zombie).
    if os.getppid() != kernel or procid.gone(kernel) or _starter_died(kernel):
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
