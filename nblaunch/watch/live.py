"""A call on live ranks: the call watch, for ranks that outlive the call.

When one rank fails, the others' calls are interrupted (``KeyboardInterrupt``
in their Python code) and every rank is kept. The ranks are only given up
(``broken``: the session restarts them) when they can no longer be trusted:
a rank died, did not answer an interrupt, left its peers in a collective,
the call timed out in a collective, or the ranks are out of step. Call 0 is
the ranks' set-up: a failure there gives them up at once, as a launch's.
"""
from __future__ import annotations

import time
from typing import Optional

from ..engines.pool import RankPool
from .. import errors
from ..errors import RankFailure, render_interrupt
from .call import CallWatch, ranks_label
from ..wire.channel import Stopping

__all__ = ["LiveCallWatch"]

INTERRUPT_GRACE_S = 5.0  # interrupt -> every rank idle again, or the ranks are given up (2 s was too short for
# ranks on SLURM nodes, behind their agent, on a busy 2-core machine: their state was lost)
# The stop button in a loop with a bar: the ranks stop together at an agreed
# step (rank.interrupts.CallInterrupt); this is how long they get to reach it.
STEP_STOP_WAIT_S = 20.0


class LiveCallWatch(CallWatch):
    """Call ``call`` on live ranks: ``run(begin)`` (``begin`` sends the
    call to each rank) returns the per-rank results or raises; ``broken``
    then says why the ranks must be replaced (None: they are kept)."""

    def __init__(self, pool: RankPool, view, call: int, **kwargs):
        super().__init__(pool, view, call, **kwargs)
        self._answer_by: Optional[float] = None  # every interrupted rank idle by then

    @property
    def interrupted(self) -> bool:
        """Whether nblaunch interrupted the call on some rank."""
        return any(p.interrupted for p in self._parts)

    # -- what differs from a launch ---------------------------------------------------

    def _drain(self) -> None:
        """The ranks stay up: nothing to drain."""

    def _over(self) -> bool:
        return self._call_over()

    def _on_exit(self, rank: int, code: int) -> None:
        super()._on_exit(rank, code)
        if self.call > 0:
            part = self._parts[rank]
            self._break(part.failure.summary() if part.failure is not None
                        else f"rank {self._pool.global_rank(rank)} exited")

    def _left_behind(self, failure: RankFailure) -> None:
        # The ranks that wait for it are in a collective: no interrupt reaches them.
        self._break(failure.summary())

    def _publish(self, failure: RankFailure) -> None:
        """Live ranks span no other kernel's nodes."""

    def _end_elsewhere(self) -> None:
        """A rank failed: interrupt the others' calls (while setting up, call 0, they are given up)."""
        if self.call > 0 and not self.broken:
            if self._answer_by is None:  # not already interrupted
                self._interrupt()
        else:
            self._begin_stop()

    def _give_up(self, what: str) -> None:
        self._stop_now()
        self.broken = self.broken or what

    def _check_others(self, now: float) -> None:
        self._check_answers(now)

    def _settle(self, failures: list) -> None:
        """Ranks whose process groups issued different numbers of collectives
        would pair their next one with the wrong operation: given up."""
        seqs = {self._pool.global_rank(r): p.seq for r, p in enumerate(self._parts)
                if not self._pool.exit_seen(r) and p.seq >= 0}
        if not self.broken and len(set(seqs.values())) > 1:
            counts = ", ".join(f"rank {rank}: {n}" for rank, n in sorted(seqs.items()))
            self._break(f"the ranks' process group is out of step (collectives issued: {counts})")

    def _break(self, reason: str) -> None:
        """Live ranks that cannot be trusted: stop them all (the session restarts them)."""
        if self.broken:
            return
        self.broken = reason
        self._view.notice(f"{reason}; restarting the ranks (what earlier calls built in them is lost)")
        self._begin_stop()

    # -- interrupts --------------------------------------------------------------------

    def _interrupt(self, at_a_step: bool = False) -> None:
        how = f"{self.call} at a step" if at_a_step else str(self.call)  # see rank.interrupts.CallInterrupt
        for r in self._in_call():
            self._parts[r].interrupted = True
            self._pool.interrupt(r, how)
        if self._answer_by is None:
            self._answer_by = time.monotonic() + INTERRUPT_GRACE_S

    def _on_stopping(self, rank: int, event: Stopping) -> None:
        part = self._parts[rank]
        if not part.interrupted or self._answer_by is None or self.broken:
            return
        if event.at and not any(p.stopping_at for p in self._parts):
            self._view.notice(f"every rank stops after step {event.at} of its loop, where no collective "
                              "is pending (press stop again to stop at once; the ranks are then restarted)")
        part.stopping_at = event.at
        self._answer_by = max(self._answer_by, time.monotonic() + STEP_STOP_WAIT_S)

    def _check_answers(self, now: float) -> None:
        if self._answer_by is None or self.broken or now < self._answer_by or self._call_over():
            return
        in_call = self._in_call()
        stuck = [self._pool.global_rank(r) for r in in_call]
        if any(p.stopping_at for p in self._parts):
            self._break(f"{ranks_label(stuck)} did not reach the agreed stop step within {STEP_STOP_WAIT_S:g} s "
                        f"of being interrupted; where each rank was:\n{self._pool.stacks()}")
            return
        self._break(f"{ranks_label(stuck)} did not stop within {INTERRUPT_GRACE_S:g} s of being interrupted "
                    "(most likely blocked in a collective that another rank never joined); where "
                    f"{'it was' if len(stuck) == 1 else 'each was'}:\n{self._pool.stacks(in_call)}")

    def _interrupt_all(self, at_a_step: bool) -> bool:
        """Interrupt every live rank still in the call; True if all are idle
        again in time (else the ranks are given up). ``at_a_step`` (the stop
        button): ranks in a loop with a bar stop together at a step they
        agree on, where no collective is pending."""
        self._answer_by = None  # a fresh grace from now
        self._interrupt(at_a_step)
        try:
            while not self._call_over() and not self.broken:
                self._pass()
        except KeyboardInterrupt:
            self._break("the interrupt was pressed again while the ranks were stopping")
        return not self.broken

    def _interrupted_by_user(self, exc: KeyboardInterrupt) -> None:
        if self.call == 0:
            super()._interrupted_by_user(exc)
            return
        where = self._pool.stacks()
        self._view.notice("interrupted (where each rank was: in the error below)")
        kept = self._interrupt_all(at_a_step=True)
        render_interrupt(exc, [f"KeyboardInterrupt: {self.name} was interrupted on every rank. "
                               f"{self._fate(kept)} Where each rank was (innermost frame first):",
                               where, f"Full output: {self._pool.log_dir}"])

    def _time_out(self) -> None:
        """Every rank's stack first, then the ranks are interrupted, and
        restarted by the session unless they are all idle and in step again
        in time (a call stuck in a collective, where no interrupt reaches, is not)."""
        where = self._pool.stacks()
        if self.call == 0:
            self._give_up(f"timed out after {self._timeout:g} s")
            raise errors.timed_out(self.name, self._timeout, where, "The ranks were stopped.", self._pool.log_dir)
        raise errors.timed_out(self.name, self._timeout, where, self._fate(self._interrupt_all(at_a_step=False)),
                               self._pool.log_dir)

    def _fate(self, kept: bool) -> str:
        return ("The ranks are idle and keep their state." if kept
                else f"The ranks could not be kept: {self.broken}.")
