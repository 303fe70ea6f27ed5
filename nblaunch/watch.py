"""A call watch: one call on a rank pool, from its start to its verdict.

The watch runs in the thread that made the call (the cell's thread): a
``KeyboardInterrupt`` from the kernel lands right in its loop, and the view
it feeds prints into the right cell. It owns every per-call fact (each
rank's result, failure, departure, whether nblaunch stopped it), the call's
timeout, the user's interrupt and the verdict: the results, or one
:class:`~nblaunch.errors.WorkerError` whose root cause
:mod:`nblaunch.errors` picks.

The one rule that differs between a launch and live ranks is what becomes of
the ranks (``keep_ranks``). A launch's ranks end with its only call: when one
fails, the others are stopped (SIGTERM, SIGKILL after ``STOP_GRACE_S``). Live
ranks outlive the call: the others' calls are interrupted instead, and the
ranks are only given up (``broken``: the session restarts them) when they
can no longer be trusted: a rank died, did not answer an interrupt, left its
peers in a collective, the call timed out, or the ranks are out of step.
"""
from __future__ import annotations

import pickle
import signal
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from . import errors
from .wire.channel import RELEASE, Failure, GpuMemory, Metrics, Phase, Progress, Result, Started, Stopping
from .errors import (Departure, LaunchTimeout, RankFailure, WorkerError, blame_departures, left_early,
                     render_interrupt)
from .engines.pool import Exited, Lines, Lost, Message, RankPool, Rewriting
from .resources import Sampler
from .stalls import Stalls
from .rank.results import max_result_bytes

__all__ = ["CallWatch", "Stalls"]

LARGE_JOB_BYTES = 1 << 20
STOP_GRACE_S = 0.25  # SIGTERM -> SIGKILL; a rank blocked in a collective only dies to SIGKILL
# A failure that is only a consequence of a peer's (gloo's "Connection closed
# by peer") often arrives before its cause: the dead peer's exit or its
# exception report. Stopping the ranks at once would make the cause look
# like one of the stopped; the verdict waits this long for it.
CONSEQUENCE_HOLD_S = 0.2
# Some ranks returned while others run on: after this long (then at growing
# intervals) the others' stacks are read, and if every one of them waits in
# a collective, the first rank that left is the failure (it never joins).
LEFT_GRACE_S = 3.0
LEFT_RECHECK_MAX_S = 30.0
INTERRUPT_GRACE_S = 2.0  # live ranks: interrupt -> every rank idle again, or the ranks are given up
# The stop button in a loop with a bar: the ranks stop together at an agreed
# step (rank.interrupts.CallInterrupt); this is how long they get to reach it.
STEP_STOP_WAIT_S = 20.0
TICK_S = 0.1
_NO_RESULT = object()


@dataclass
class _Part:
    """One rank's part of this call."""

    result: Any = _NO_RESULT
    failure: Optional[RankFailure] = None
    departure: Optional[Departure] = None  # how and when its fn ended, once it returned
    stopped: bool = False  # nblaunch signalled it while it was still in the call
    signals: set = field(default_factory=set)
    seq: int = -1  # collectives issued on the default group, as of its last report
    interrupted: bool = False  # live ranks: nblaunch interrupted its call
    stopping_at: Optional[int] = None  # live ranks: the loop step it stops at (the stop button)

    @property
    def done(self) -> bool:
        return self.result is not _NO_RESULT or self.failure is not None


class CallWatch:
    """Call ``call`` on ``pool``: ``run(begin)`` returns the per-rank results or raises.

    ``begin`` starts the call (starts a launch's pool, or sends a live call
    to each rank); it runs inside the watch, so an interrupt or a timeout
    during it is handled as any other. A launch's failures reach the rest
    of the job, and theirs this node, through the pool (``publish``,
    ``news``, ``settle``): which engine, if any, has other nodes is the
    pool's business."""

    def __init__(self, pool: RankPool, view, call: int, *, keep_ranks: bool, timeout: Optional[float] = None,
                 stall_warning: Optional[float] = None, job_size: int = 0, name: str = ""):
        self._pool = pool
        self._view = view
        self.call = call
        self.name = name or f"call {call}"  # what the user calls it (live ranks count only their runs)
        self._keep = keep_ranks
        self._timeout = timeout
        self._job_size = job_size
        self._parts = [_Part() for _ in range(pool.size)]
        self._stalls = Stalls(stall_warning)
        self._sampler: Optional[Sampler] = None
        self._remote: Optional[RankFailure] = None  # another node's failure
        self._stop_at: Optional[float] = None  # a consequence was seen: stop then unless its cause shows first
        self._stop_deadline: Optional[float] = None  # SIGKILL then
        self._left_check: Optional[tuple[float, float]] = None  # (next stack read, interval)
        self._answer_by: Optional[float] = None  # live ranks: every interrupted rank idle by then
        self._result_bytes = 0  # results received so far, all ranks
        self.broken: Optional[str] = None  # live ranks: why they cannot be trusted any more

    @property
    def interrupted(self) -> bool:
        """Whether nblaunch interrupted the call on some rank (live ranks)."""
        return any(p.interrupted for p in self._parts)

    # -- the call ------------------------------------------------------------------

    def run(self, begin: Callable[[], None]) -> list:
        t0 = time.monotonic()
        try:
            begin()
            self._sampler = Sampler(self._pool.gpu_devices())
            if self._job_size > LARGE_JOB_BYTES:
                self._view.notice(
                    f"the job (fn, its arguments and what it captures) is {self._job_size / 2**20:.1f} MB per "
                    "rank; tensors travel through shared memory at no cost, so large data is best passed as tensors")
            self._view.show()
            while not self._over():
                self._pass()
                if self._timeout is not None and time.monotonic() - t0 > self._timeout and not self.broken:
                    self._time_out()
        except KeyboardInterrupt as exc:
            self._interrupted_by_user(exc)
            raise
        except LaunchTimeout:
            raise
        except BaseException:
            self._give_up("stopped on an error in its launcher")
            raise
        finally:
            if not self._keep:
                self._apply(self._pool.drain())
        return self._outcome()

    def _over(self) -> bool:
        """A launch waits for its ranks to exit; live ranks for their part of the call."""
        if self._keep:
            return self._call_over()
        return all(self._pool.exited(r) for r in range(self._pool.size))

    def _in_call(self) -> list[int]:
        """The ranks still in this call: no result, no failure, not ended."""
        return [r for r, p in enumerate(self._parts) if not p.done and not self._pool.exited(r)]

    def _call_over(self) -> bool:
        """Every rank has returned, failed or ended; whatever a held
        consequence waits for (its cause) is then already in."""
        return not self._in_call()

    def _pass(self) -> None:
        """Whatever the ranks sent or did within a tick, then the timers (a
        consequence's hold, the kill after a grace, stalls, ranks that left,
        other nodes, interrupt answers, resources) and a redraw."""
        self._apply(self._pool.poll(TICK_S))
        now = time.monotonic()
        if self._stop_at is not None and (now >= self._stop_at or self._call_over()):
            self._stop_at = None
            self._end_elsewhere()
        if self._stop_deadline is not None and now >= self._stop_deadline:
            self._signal(signal.SIGKILL)  # and what the stopped ranks left behind
            self._stop_deadline = float("inf")
        running = set(self._in_call())
        for text in self._stalls.check(now, running, self._pool.global_rank):
            self._view.notice(text)
        self._check_departures(now)
        self._check_other_nodes()
        self._check_answers(now)
        if self._sampler is not None:
            usage = self._pool.usage(self._sampler)
            if usage:
                self._view.resources(usage)
        self._view.tick()

    # -- what the ranks sent --------------------------------------------------------

    def _apply(self, happened: list) -> None:
        for item in happened:
            if isinstance(item, Lines):
                self._view.rank_lines(item.rank, item.lines)
            elif isinstance(item, Rewriting):
                self._view.rank_live(item.rank, item.text)
            elif isinstance(item, Message):
                self._on_event(item.rank, item.event)
            elif isinstance(item, Exited):
                self._on_exit(item.rank, item.exitcode)
            elif isinstance(item, Lost) and not self._parts[item.rank].done:
                self._fail(item.rank, errors.node_lost(self._pool.global_rank(item.rank), self._pool.node(item.rank),
                                                       time.time(), item.why))

    def _on_event(self, rank: int, event) -> None:
        part = self._parts[rank]
        if isinstance(event, Started):
            self._view.rank_status(rank, "running")
            return
        if isinstance(event, Phase) and event.what != "in fn":  # set-up: before any call
            self._view.rank_phase(rank, event.what)
            return
        if getattr(event, "call", self.call) != self.call:
            return  # a live rank's bar of its last call, sent as that call ended
        if isinstance(event, Progress):
            self._stalls.moved(rank, event.key, event.n, event.total, event.desc, time.monotonic())
            self._view.progress(event)
        elif isinstance(event, Metrics):
            self._view.metrics(event)
        elif isinstance(event, GpuMemory):
            if self._sampler is not None:
                self._sampler.reported[rank] = (event.device, event.used, event.total, None)
        elif isinstance(event, Result):
            part.seq = event.seq
            self._take_result(rank, event)
        elif isinstance(event, Failure):
            part.seq = event.seq
            self._fail(rank, errors.reported(self._pool.global_rank(rank), self._pool.node(rank), event.time,
                                             event.exc_type, event.message, event.traceback, event.exception,
                                             interrupted=part.interrupted))
        elif isinstance(event, Stopping):
            self._on_stopping(rank, event)
        elif isinstance(event, Phase):
            self._view.rank_phase(rank, event.what)

    def _take_result(self, rank: int, event: Result) -> None:
        """Unpickle a result as it arrives (its tensors' shared memory is
        fetched from the rank now), tell the rank it may go on, and keep the
        total within the limit: the kernel holds every rank's result."""
        part = self._parts[rank]
        self._result_bytes += len(event.payload) + event.shared
        limit = max_result_bytes()
        try:
            if self._result_bytes > limit:
                raise ValueError(
                    f"the results received so far total {self._result_bytes:,} bytes, over the "
                    f"{limit:,}-byte limit for all ranks together (NBLAUNCH_MAX_RESULT_BYTES). "
                    "Return something smaller, or save large outputs to disk and return their paths.")
            part.result = pickle.loads(event.payload)
        except Exception as exc:
            self._fail(rank, errors.unreadable_result(self._pool.global_rank(rank), self._pool.node(rank),
                                                      time.time(), exc))
        else:
            part.departure = Departure(self._pool.global_rank(rank), event.time or time.time(),
                                       "exited (code 0)" if event.exited else "returned", self._pool.node(rank),
                                       exitcode=0 if event.exited else None)
            self._view.rank_status(rank, "finished")
        finally:
            self._pool.send(rank, RELEASE)

    def _on_exit(self, rank: int, code: int) -> None:
        part = self._parts[rank]
        if not part.done:
            self._fail(rank, errors.death(self._pool.global_rank(rank), self._pool.node(rank), time.time(), code,
                                          part.stopped, part.signals, self._pool.tail(rank)))
        if self._keep and self.call > 0:
            self._break(part.failure.summary() if part.failure is not None
                        else f"rank {self._pool.global_rank(rank)} exited")

    def _fail(self, rank: int, failure: RankFailure) -> None:
        self._parts[rank].failure = failure
        self._view.rank_status(rank, failure.row)
        if failure.kind in errors.NBLAUNCH_ENDED:
            return
        if failure.kind == "interrupted":
            return
        if failure.kind == "left" and self._keep:
            # The ranks that wait for it are in a collective: no interrupt reaches them.
            self._break(failure.summary())
        # An exit with code 0 is held too: peers it left in a collective
        # report the lost connection within the hold, and the verdict then
        # says where they waited (errors.blame_departures).
        if failure.is_consequence or (failure.kind == "exit" and failure.exitcode == 0):
            if self._stop_at is None:
                self._stop_at = time.monotonic() + CONSEQUENCE_HOLD_S
            return
        if not self._keep:
            self._pool.publish(failure)  # the other nodes stop within a poll
        self._end_elsewhere()

    # -- ending the call on the other ranks -----------------------------------------

    def _end_elsewhere(self) -> None:
        """A rank failed. A launch stops the others; live ranks interrupt
        their calls (while setting up, call 0, they are given up)."""
        if self._keep and self.call > 0 and not self.broken:
            if self._answer_by is None:  # not already interrupted
                self._interrupt()
        else:
            self._begin_stop()

    def _begin_stop(self) -> None:
        """SIGTERM every rank still up, SIGKILL after a grace."""
        if self._stop_deadline is None:
            self._signal(signal.SIGTERM)
            self._stop_deadline = time.monotonic() + STOP_GRACE_S

    def _order(self) -> list[int]:
        # Healthy ranks first: a failed rank waits to be stopped so that its
        # peers do not see its sockets close, and must not go before them.
        return sorted(range(self._pool.size), key=lambda r: self._parts[r].failure is not None)

    def _signal(self, sig: int) -> None:
        self._note_signals((sig,))
        self._pool.signal(sig, self._order())

    def _stop_now(self) -> None:
        """Stop every rank at once (an interrupt, a timeout, an error here)."""
        self._note_signals((signal.SIGTERM, signal.SIGKILL))
        self._pool.stop(STOP_GRACE_S, order=self._order())

    def _note_signals(self, sigs: tuple) -> None:
        """What a rank's death will be judged by: whether nblaunch stopped
        it while it was still in the call, and with which signals."""
        for r, part in enumerate(self._parts):
            if self._pool.ended(r):  # a rank that died on its own: its death is its own failure
                continue
            if not part.done:
                part.stopped = True
            part.signals.update(sigs)

    def _give_up(self, what: str) -> None:
        """The call ends here and so do the ranks; other nodes are told."""
        self._stop_now()
        if self._keep:
            self.broken = self.broken or what
        pl = self._pool.placement
        if not self._keep and pl is not None:
            self._pool.publish(errors.node_lost(pl.first_rank, pl.node_rank, time.time(), what))

    def _break(self, reason: str) -> None:
        """Live ranks that cannot be trusted: stop them all (the session restarts them)."""
        if self.broken:
            return
        self.broken = reason
        self._view.notice(f"{reason}; restarting the ranks (what earlier calls built in them is lost)")
        self._begin_stop()

    # -- interrupts (live ranks) -------------------------------------------------------

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
        stuck = [self._pool.global_rank(r) for r in self._in_call()]
        if any(p.stopping_at for p in self._parts):
            self._break(f"{ranks_label(stuck)} did not reach the agreed stop step within {STEP_STOP_WAIT_S:g} s "
                        f"of being interrupted; where each rank was:\n{self._pool.stacks()}")
            return
        self._break(f"{ranks_label(stuck)} did not stop within {INTERRUPT_GRACE_S:g} s of being interrupted "
                    "(most likely blocked in a collective that another rank never joined)")

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
        where = self._pool.stacks()
        log_dir = self._pool.log_dir
        if self._keep and self.call > 0:
            self._view.notice("interrupted (where each rank was: in the error below)")
            kept = self._interrupt_all(at_a_step=True)
            render_interrupt(exc, [f"KeyboardInterrupt: {self.name} was interrupted on every rank. "
                                   f"{self._fate(kept)} Where each rank was (innermost frame first):",
                                   where, f"Full output: {log_dir}"])
            return
        # The user pressed stop, most likely because it looks stuck.
        self._view.notice("interrupted; every rank was stopped (where each rank was: in the error below)")
        self._give_up("was interrupted")
        render_interrupt(exc, ["KeyboardInterrupt: the launch was interrupted and every rank was "
                               "stopped; where each rank was (innermost frame first):", where,
                               f"Full output: {log_dir}"])

    def _time_out(self) -> None:
        """Every rank's stack first, then the ranks: a launch's are stopped;
        live ranks are interrupted, and restarted by the session unless they
        are all idle and in step again in time (a call stuck in a collective,
        where no interrupt reaches, is not). The ranks' collectives time out
        later than the call (``plan.pg_timeout_for``), so this comes first."""
        where = self._pool.stacks()
        if self._keep and self.call > 0:
            then = self._fate(self._interrupt_all(at_a_step=False))
        else:
            self._give_up(f"timed out after {self._timeout:g} s")
            then = "The ranks were stopped."
        what = self.name if self._keep else "the launch"
        raise LaunchTimeout(f"{what} did not finish within {self._timeout:g} s; where each rank was "
                            f"(innermost frame first):\n{where}\n{then} Full output: {self._pool.log_dir}",
                            log_dir=str(self._pool.log_dir))

    def _fate(self, kept: bool) -> str:
        return ("The ranks are idle and keep their state." if kept
                else f"The ranks could not be kept: {self.broken}.")

    # -- ranks that left, other nodes ------------------------------------------------------

    def _check_departures(self, now: float) -> None:
        """Ranks that returned while their peers still wait for them in a
        collective: with gloo a peer's exit ends the wait in an error (see
        ``errors.blame_departures``), but a rank that stays up (a live rank
        between calls, one waiting for its result to be fetched) or NCCL
        leaves them waiting until the timeout. Their stacks tell."""
        if self._stop_deadline is not None or self._stop_at is not None:
            return
        gone = [r for r, p in enumerate(self._parts) if p.departure is not None and p.failure is None]
        waiting = self._in_call()
        if not gone or not waiting:
            self._left_check = None
            return
        if self._left_check is None:
            self._left_check = (now + LEFT_GRACE_S, LEFT_GRACE_S)
        due, interval = self._left_check
        if now < due or not all(self._pool.started(r) for r in waiting):
            return
        where = self._pool.collectives(waiting)
        self._left_check = (time.monotonic() + interval, min(2 * interval, LEFT_RECHECK_MAX_S))
        labels = {r: self._pool.global_rank(r) for r in waiting}
        if all(where.get(labels[r]) for r in waiting):
            first = min(gone, key=lambda r: self._parts[r].departure.time)
            self._fail(first, left_early(self._parts[first].departure,
                                         {f"rank {labels[r]}": where[labels[r]] for r in waiting}))

    def _check_other_nodes(self) -> None:
        if self._remote is not None or self._keep:
            return
        remote = self._pool.news()
        if remote is not None:
            self._remote = remote
            self._view.notice(f"{remote.summary()}; stopping this node's ranks")
            self._begin_stop()

    # -- the verdict -----------------------------------------------------------------------

    def _outcome(self) -> list:
        failures = [p.failure for p in self._parts if p.failure is not None]
        departures = [p.departure for p in self._parts if p.departure is not None and p.failure is None]
        failures = blame_departures(failures, departures)
        for failure in failures:  # a rank that left its peers waiting shows as failed too
            if failure.kind == "left":
                for r in range(self._pool.size):
                    if self._pool.global_rank(r) == failure.rank:
                        self._view.rank_status(r, "failed")
        if self._keep:
            seqs = {self._pool.global_rank(r): p.seq for r, p in enumerate(self._parts)
                    if not self._pool.exited(r) and p.seq >= 0}
            if not self.broken and len(set(seqs.values())) > 1:
                counts = ", ".join(f"rank {rank}: {n}" for rank, n in sorted(seqs.items()))
                self._break(f"the ranks' process group is out of step (collectives issued: {counts})")
        else:
            remote = self._pool.settle(failures, self._remote)
            if remote is not None:
                failures.append(remote)
        if not failures:
            return [p.result for p in self._parts]
        error = WorkerError(failures, log_dir=str(self._pool.log_dir))
        raise error from error.root.exception


def ranks_label(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
