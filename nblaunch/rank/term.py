"""SIGTERM in a rank: nblaunch's own stop, or a notice that the job ends.

nblaunch stops a rank with SIGTERM (then SIGKILL), sent by the process that
holds the rank's pool: the kernel, a node's agent, a detached run's
supervisor (``WorkerSpec.kernel_pid``). SLURM sends SIGTERM too, to every
process of a step or job, on preemption, ``scancel`` and the time limit,
and SIGKILL only ``KillWait`` later: that one must not end the rank but
tell it (``nblaunch.preempted()``) so that it can save.

Which of the two came is decided by the sender's identity, which only
``sigwaitinfo`` gives: SIGTERM is blocked in the rank from its first
instruction (a zygote forks it blocked) and one thread waits for it. From
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

__all__ = ["block", "watch"]

_watching = False


def block() -> None:
    """Hold SIGTERM in this thread and every thread it starts from now on.
    Call before any other thread exists."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})


def watch(owner: int, notice_folder: str, report) -> None:
    """Start the thread that takes this rank's SIGTERMs. ``owner``: the pid
    whose SIGTERM is nblaunch's stop; ``notice_folder``: where the node's
    ranks read the notice (empty: none); ``report(signal, sender_pid)``:
    tell the kernel."""
    global _watching
    if _watching or not hasattr(signal, "sigwaitinfo"):
        return
    _watching = True
    ours = {owner, os.getpid()}
    threading.Thread(target=_wait, args=(ours, notice_folder, report), name="nblaunch-sigterm",
                     daemon=True).start()


def _wait(ours: set, notice_folder: str, report) -> None:
    told = False
    while True:
        info = signal.sigwaitinfo({signal.SIGTERM})
        if info.si_pid in ours:
            _end_as_sigterm()
            continue
        handler = signal.getsignal(signal.SIGTERM)
        if callable(handler):  # fn's own: it decides, as it would have without nblaunch
            _thread.interrupt_main(signal.SIGTERM)
        if told:
            continue
        told = True
        if notice_folder:
            from ..preempt import write_notice

            write_notice(notice_folder, f"SIGTERM from pid {info.si_pid}")
        try:
            report("SIGTERM", info.si_pid)
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
