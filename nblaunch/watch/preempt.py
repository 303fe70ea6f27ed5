"""Preemption: a notice to every rank that the job is about to end.

SLURM says a job is about to end with a signal: SIGTERM on preemption,
``scancel JOB`` and the time limit (to every process of the job's steps,
SIGKILL following ``KillWait`` later), SIGUSR1 (or any signal) with
``scancel --signal=USR1`` or ``--signal=USR1@60`` before the time limit.
Whoever gets it first says so: the kernel (:class:`Catcher`, while a
launch's ranks run, for a signal nothing else there handles: a kernel that
registered ``faulthandler`` on SIGUSR1 keeps its stack dump), a node's agent
(SIGTERM or SIGUSR1), or a rank (SIGTERM from anyone but nblaunch,
:mod:`nblaunch.rank.term`). The kernel then tells every rank of the
generation at once (``RankPool.preempt``: a file beside the rank's other
files, on every node), and the ranks get ``grace`` seconds, never cut short
by nblaunch, to save and return. In a rank,
:func:`nblaunch.rank.notice.preempted` says so::

    for step in range(start, steps):
        train_step()
        if nblaunch.preempted(agree=True):   # every rank, the same step
            dcp.save(state, checkpoint_id=...)
            return step

nblaunch writes no checkpoint of its own: ``torch.distributed.checkpoint``
saves and reloads (resharding when fewer ranks load it).
"""
from __future__ import annotations

import os
import signal
import threading
import time
from typing import Optional

__all__ = ["Catcher", "Grace", "CAUGHT", "unhandled"]

# What SLURM sends before a job ends: SIGTERM (preemption, scancel, the time
# limit) and, where asked for, SIGUSR1 (--signal=USR1@60, scancel --signal=USR1).
CAUGHT = (signal.SIGTERM, signal.SIGUSR1)


class Catcher:
    """SIGTERM to the kernel, while a launch's ranks run: held
    as a notice instead of ending the kernel (``signal``: the name of the
    first one, None until one came). Outside the main thread no handler can
    be set: nothing is caught there. A node's agent's notice comes through
    :meth:`note` as well. ``grace``: the seconds the ranks get."""

    def __init__(self, grace: float):
        self.grace = grace
        self.signal: Optional[str] = None
        self.where = ""
        self.at: Optional[float] = None
        self._previous: dict = {}

    def arm(self) -> None:
        """Catch from now on: before the generation's ranks start, since a
        rank may be in ``fn`` before the kernel hears it started (a notice
        then ended the kernel: a test under load). What the kernel forks
        meanwhile (a zygote, a rank) has the default actions back from its
        first instant (:func:`_defaults_in_child`): a rank's own SIGUSR1 is
        its stack dump."""
        global _armed
        if threading.current_thread() is threading.main_thread() and not self._previous:
            for sig in CAUGHT:
                # Only a signal nothing else handles (it would end the kernel):
                # one the process set itself means something else there (a
                # detached run's supervisor: SIGTERM is run.stop()), and a
                # handler set outside Python (faulthandler.register(SIGUSR1),
                # a stack dump many set in their kernel) could not be put back.
                if unhandled(sig):
                    self._previous[sig] = signal.signal(sig, self._handler)
            _armed = self

    def disarm(self) -> None:
        """The kernel's own handlers back."""
        global _armed
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()
        if _armed is self:
            _armed = None

    def __enter__(self) -> "Catcher":
        self.arm()
        return self

    def __exit__(self, *exc) -> None:
        self.disarm()

    def _handler(self, signum, frame) -> None:
        self.note(signal.Signals(signum).name, "the kernel")

    def note(self, name: str, where: str) -> None:
        """A notice came (``name``: the signal; ``where``: who got it)."""
        if self.signal is None:
            self.signal, self.where, self.at = name, where, time.monotonic()

    @property
    def caught(self) -> bool:
        return self.signal is not None


_armed: Optional[Catcher] = None  # the catcher whose handlers are set now


def _defaults_in_child() -> None:
    """Right after a fork: a catcher's handlers are the kernel's alone."""
    global _armed
    catcher, _armed = _armed, None
    if catcher is not None:
        for sig, previous in catcher._previous.items():
            signal.signal(sig, previous)
        catcher._previous = {}  # this process's copy


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_defaults_in_child)


def unhandled(sig: int) -> bool:
    """Whether ``sig`` has its default action here, for Python and below it
    (``signal.getsignal`` does not see a handler set in C, as faulthandler's)."""
    if signal.getsignal(sig) != signal.SIG_DFL:
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        action = ctypes.create_string_buffer(512)  # a struct sigaction, its handler first (glibc, musl, macOS)
        if libc.sigaction(int(sig), None, action) != 0:
            return True
        return not ctypes.c_void_p.from_buffer(action).value  # SIG_DFL is 0
    except (OSError, AttributeError):
        return True


class Grace:
    """The call watch's side of a notice: the ranks are told once
    (``pool.preempt``), then have ``catcher.grace`` seconds, never cut short.
    :meth:`check` says, once, when the grace is over with ranks still in
    the call (the watch then stops them); :meth:`error` is the verdict."""

    def __init__(self, catcher: Optional[Catcher]):
        self.catcher = catcher  # None: nothing is caught (live ranks)
        self.until: Optional[float] = None
        self.expired = False

    def check(self, now: float, pool, view, in_call: list) -> bool:
        c = self.catcher
        if c is not None and pool.preempting is not None:  # a node's agent got the signal
            c.note(*pool.preempting)
        if c is None or not c.caught or self.expired:
            return False
        if self.until is None:
            self.until = now + c.grace
            pool.preempt(f"{c.signal} to {c.where}")
            view.notice(f"preempted ({c.signal} to {c.where}): saving; the ranks have {c.grace:g} s to save "
                        "and return (nblaunch.preempted() is true on every rank)")
            for r in in_call:
                view.rank_status(r, "preempted: saving")
            return False
        if now >= self.until and in_call:
            self.expired = True
            view.notice(f"the {c.grace:g} s grace after the preemption is over; stopping the ranks")
            return True
        return False

    def error(self, pool, returned: list, steps: dict, ended: bool = False):
        """``Preempted``: what came, at which step (the furthest of ``steps``,
        global rank -> its bar's last step), who did not return in time
        (``ended``: they were ended before the grace was over, by whoever
        sent the notice: SLURM's SIGKILL after KillWait)."""
        from ..errors import Preempted

        c = self.catcher
        left = [pool.global_rank(r) for r in range(pool.size) if r not in returned]
        returned = [pool.global_rank(r) for r in returned]
        step = max(steps.values()) if steps else None
        at = f" at step {step}" if step is not None else ""
        back = f"; {_ranks(returned)} returned" if returned else ""
        how = (f"were ended before the {c.grace:g} s grace (preempt_grace) was over (SLURM's KillWait is the "
               "longest a job gets)" if ended else f"did not return within the {c.grace:g} s grace (preempt_grace) "
               "and were stopped")
        return Preempted(f"the launch was preempted ({c.signal} to {c.where}){at}: {_ranks(left)} {how}{back}. Save when "
                         f"nblaunch.preempted() turns true, and resume from that checkpoint. Full output: "
                         f"{pool.log_dir}", signal=c.signal, step=step, returned=tuple(returned),
                         log_dir=str(pool.log_dir))


def _ranks(ranks: list) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
