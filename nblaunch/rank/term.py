"""SIGTERM in a rank: nblaunch's own stop, or a notice that the job ends.

nblaunch stops a rank with SIGTERM (then SIGKILL), sent by the process that
holds the rank's pool: the kernel, a node's agent, a detached run's
supervisor (``WorkerSpec.kernel_pid``). SLURM sends SIGTERM too, to every
process of a step or job, on preemption, ``scancel`` and the time limit,
and SIGKILL only ``KillWait`` later: that one must not end the rank but
tell it (``nblaunch.preempted()``) so that it can save.

Which of the two came is decided by the sender's identity, which only
``sigtimedwait`` gives: SIGTERM is blocked in the rank from its first
instruction (a zygote forks it blocked) and the rank's parent-watch thread
(:mod:`nblaunch.rank.lifeline`) waits for it between its polls. From
the pool's process (or the rank itself): the rank ends exactly as SIGTERM
ends it otherwise (the default action, or ``fn``'s own handler). From
anyone else: the notice is written for the node's ranks at once and
reported to the kernel (a ``Preempting`` event), which tells every rank of
the job; ``fn``'s own handler, if it set one, runs too.

What the rank starts inherits the blocked SIGTERM, so a DataLoader worker
outlives SLURM's SIGTERM with its rank; nblaunch's stop ends such children
with the SIGKILL that follows its SIGTERM.
"""
from __future__ import annotations

import _thread
import os
import signal
import threading
import time

__all__ = ["block", "watch", "pause", "start_thread"]

_HOLDS = hasattr(signal, "sigtimedwait")  # Linux; elsewhere SIGTERM ends a rank as it always did
_owners: set = set()
_folder = ""
_report = None
_heard: list = []  # a notice that came before it could be reported


def block(owner: int, notice_folder: str) -> None:
    """Hold SIGTERM in this thread and every thread it starts from now on
    (call before any other thread exists). ``owner``: the pid whose SIGTERM
    is nblaunch's stop; ``notice_folder``: where the node's ranks read the
    notice (empty: none)."""
    global _folder
    if not _HOLDS:
        return
    _owners.update({owner, os.getpid()})
    _folder = notice_folder
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})


def start_thread(target, name: str) -> threading.Thread:
    """Start a daemon thread of nblaunch's own in a rank, born with SIGINT held.
    A signal sent to a process goes to a thread that does not hold it, and the
    main thread is passed over while another signal is pending for it (say the
    stack dump's, just before a timeout's interrupt); a helper thread that
    takes the SIGINT leaves the main thread asleep in a blocking call, where
    the interrupt never lands (``time.sleep(60)`` in a live call slept through
    it under load, and the ranks were given up)."""
    thread = threading.Thread(target=target, name=name, daemon=True)
    if not hasattr(signal, "pthread_sigmask"):
        thread.start()
        return thread
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        thread.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
    return thread


def watch(report) -> None:
    """``report(signal, sender_pid)`` tells the kernel of a notice (now, if one came already)."""
    global _report
    _report = report
    while _heard:
        _tell(*_heard.pop())


def pause(seconds: float) -> None:
    """Sleep ``seconds``, taking the SIGTERMs that come meanwhile: the rank's
    parent-watch thread sleeps here (one thread for both, not one more in
    every crash dump)."""
    if not _owners:
        time.sleep(seconds)
        return
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        info = signal.sigtimedwait({signal.SIGTERM}, left)
        # A rank stopped (SIGSTOP) and continued here gets back an uninitialised siginfo from
        # CPython 3.11 (si_signo garbage): not a SIGTERM, not a preemption notice.
        if info is not None and info.si_signo == signal.SIGTERM:
            _take(info.si_pid)


def _take(sender: int) -> None:
    if sender in _owners:
        _end_as_sigterm()
        return
    if callable(signal.getsignal(signal.SIGTERM)):  # fn's own handler: it decides, as without nblaunch
        _thread.interrupt_main(signal.SIGTERM)
    if _report is None:
        _heard.append(("SIGTERM", sender))
    else:
        _tell("SIGTERM", sender)


_told = False


def _tell(sig: str, sender: int) -> None:
    global _told
    if _told:
        return
    _told = True
    if _folder:
        from .notice import write_notice

        write_notice(_folder, f"{sig} from pid {sender}")
    try:
        _report(sig, sender)
    except (OSError, ValueError):
        pass  # the kernel is gone: the rank ends with it


def _end_as_sigterm() -> None:
    """What SIGTERM would have done unblocked: the default action ends the
    process (exit status: killed by SIGTERM); a handler ``fn`` set runs in
    the main thread."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    try:
        signal.pthread_kill(threading.get_ident(), signal.SIGTERM)
    finally:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
