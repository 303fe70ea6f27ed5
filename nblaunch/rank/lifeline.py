"""A rank dies with its kernel, and so does what it started.

The rank polls for the kernel's death (besides Linux's parent-death signal),
ends its own children when it leaves, and once it has children starts its
janitor (:mod:`nblaunch.rank.janitor`), which ends them if the rank is killed
with the kernel, when the rank can no longer do it itself.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Callable, Optional

from ..system import linux
from . import term

__all__ = ["default_stop_signals", "watch_parent", "lead_own_group", "end_children"]

_PARENT_POLL_S = 0.2

_janitor_pipe: Optional[int] = None
# Set once this rank leads its own process group, the one its janitor ends.
_leads_group = threading.Event()


def default_stop_signals() -> None:
    """Let SIGTERM, SIGHUP and SIGQUIT end this rank at once, whatever Python
    handlers the kernel had. A forked rank inherits them, and a kernel may
    well have some: torch elastic (so accelerate's launcher) leaves its
    handler for all three in the kernel after its first launch. A Python handler only
    runs between bytecodes, so a rank blocked in a collective would outlive
    SIGTERM and be stopped only by the SIGKILL that follows the grace period
    (measured: a failure took 0.33 s instead of 0.02 s to reach the cell).
    ``fn`` may still install its own handlers."""
    for name in ("SIGTERM", "SIGHUP", "SIGQUIT"):
        sig = getattr(signal, name, None)
        if sig is not None:
            signal.signal(sig, signal.SIG_DFL)


def watch_parent(kernel_pid: int, parent: int, each_poll: Callable[[], None] = lambda: None) -> None:
    """Die with the kernel: a kernel-side signal, plus a poll that catches a
    parent that died before the signal was armed (or a forkserver parent).
    ``each_poll`` runs at every poll too (it must not raise), on this thread
    that every rank has anyway."""
    if sys.platform.startswith("linux") and linux.prctl is not None:
        linux.prctl(linux.PR_SET_PDEATHSIG, signal.SIGKILL)
        # Orphans of what fn starts (a double fork, a daemon) become this
        # rank's children rather than init's, so the rank can end them.
        linux.prctl(linux.PR_SET_CHILD_SUBREAPER, 1)

    kernel_alive = _process_watch(kernel_pid)

    def alive() -> bool:
        # Under forkserver our parent is not the kernel: look at the kernel too.
        return os.getppid() == parent and kernel_alive()

    if not alive():
        os._exit(1)

    def poll() -> None:
        while alive():
            term.pause(_PARENT_POLL_S)  # and takes SIGTERM meanwhile
            # The janitor costs a fresh interpreter per rank (40 ms of a
            # 2-rank launch on 2 CPUs, measured), so it starts only once
            # the rank has a child to look after.
            if _janitor_pipe is None and _leads_group.is_set() and _has_children():
                _start_janitor()
            each_poll()
        os.kill(os.getpid(), signal.SIGKILL)

    term.start_thread(poll, "nblaunch-parent-watch")


def lead_own_group() -> None:
    """Make this rank the leader of a process group of its own, the group its
    janitor ends (the kernel's SIGINT is the kernel's to handle), then let
    SIGINT in: a rank is born with it held (``engines.procs.Starter``), and
    one sent to the kernel's group before this rank left it was not for it."""
    os.setpgid(0, 0)
    _leads_group.set()
    if hasattr(signal, "pthread_sigmask"):
        if signal.SIGINT in signal.sigpending():
            handler = signal.getsignal(signal.SIGINT)
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # a pending signal ignored is dropped
            signal.signal(signal.SIGINT, signal.SIG_DFL if handler is None else handler)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def end_children() -> None:
    """A rank's processes end with it, as under torchrun's process group
    kill: whatever fn started and left running (a server, a `sleep`, a
    daemon that is now our child as we are its subreaper)."""
    if not _has_children():  # the usual case, without scanning the process table
        return
    import psutil

    for _ in range(5):  # a killed child's own orphans come to us next
        try:
            children = psutil.Process().children(recursive=True)
        except psutil.Error:
            return
        if not children:
            return
        for child in children:
            try:
                child.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(children, timeout=1.0)


def _process_watch(pid: int) -> Callable[[], bool]:
    """A cheap "is it still running?" for the kernel. A killed kernel stays a
    zombie until the Jupyter server reaps it, which counts as ended. On Linux
    a pidfd (bound to that very process, readable once it has ended): psutil
    would run far more code in every forked rank, and each first run of
    inherited code copies pages of the kernel's (about 0.4 MiB per rank)."""
    import select

    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return lambda: False
    except (AttributeError, OSError):  # not Linux >= 5.3
        fd = -1
    if fd >= 0:
        return lambda: not select.select([fd], [], [], 0)[0]
    import psutil

    try:
        kernel = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return lambda: False

    def alive() -> bool:
        try:
            return kernel.is_running() and kernel.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    return alive


def _has_children() -> bool:
    """Whether any thread of this process has a child (Linux, without
    scanning the whole process table)."""
    try:
        for task in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{task}/children") as f:
                if f.read().strip():
                    return True
    except OSError:
        return False
    return False


def _start_janitor() -> None:
    """Start :mod:`nblaunch.rank.janitor` for this rank (Linux): it ends what the
    rank started if the rank dies with its kernel. It gets the read end of a
    pipe whose write end this rank keeps until it dies. Called by the
    parent-watch thread once the rank has children."""
    global _janitor_pipe
    if not sys.platform.startswith("linux"):
        return
    import subprocess

    read, write = os.pipe()
    import nblaunch

    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(nblaunch.__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [package_parent, os.environ.get("PYTHONPATH")])))
    try:
        subprocess.Popen([sys.executable, "-m", "nblaunch.rank.janitor", str(os.getpid()), str(read)],
                         pass_fds=(read,), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, start_new_session=True, env=env)
    except OSError:
        os.close(write)
        write = -1  # no janitor for this rank; do not try again every poll
    finally:
        os.close(read)
    _janitor_pipe = write
