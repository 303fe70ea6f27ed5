"""A call watch: one call on a rank pool, from its start to its verdict.

The watch runs in the thread that made the call (the cell's thread): a
``KeyboardInterrupt`` from the kernel lands right in its loop, and the view
it feeds prints into the right cell. It owns every per-call fact (each
rank's result, failure, departure, whether nblaunch stopped it), the call's
timeout, the user's interrupt and the verdict: the results, or one
:class:`~nblaunch.errors.WorkerError` whose root cause
:mod:`nblaunch.errors` picks.

What differs between a launch and live ranks is what becomes of the ranks.
A launch's ranks end with its only call (:class:`CallWatch`): when one
fails, the others are stopped (SIGTERM, SIGKILL after ``STOP_GRACE_S``).
Live ranks outlive the call (:class:`~nblaunch.watch.live.LiveCallWatch`,
which overrides the steps named for it here): the others' calls are
interrupted instead, and the ranks are only given up when they can no
longer be trusted.
"""
from __future__ import annotations

import pickle
import signal
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from .. import errors
from ..wire.channel import (RELEASE, Failure, GpuMemory, Metrics, Paused, Phase, Progress, Prompt, Result, Started,
    Stopping)
from ..errors import (Departure, LaunchTimeout, RankFailure, RunStopped, WorkerError, blame_departures,
                      render_interrupt)
from ..engines.pool import Exited, Lines, Lost, Message, RankPool, Rewriting
from .debug_desk import DebugDesk
from .postmortem import with_rank_frames
from ..system.resources import Sampler
from .rules import LeftEarly, Stalls
from .stop_button import StopButton
from ..rank.results import max_result_bytes

__all__ = ["CallWatch", "Stalls"]

LARGE_JOB_BYTES = 1 << 20
STOP_GRACE_S = 0.25  # SIGTERM -> SIGKILL; a rank blocked in a collective only dies to SIGKILL
# A failure that is only a consequence of a peer's (gloo's "Connection closed
# by peer") often arrives before its cause: the dead peer's exit or its
# exception report. Stopping the ranks at once would make the cause look
# like one of the stopped; the verdict waits this long for it.
CONSEQUENCE_HOLD_S = 0.2
TICK_S = 0.1
# Above this many ranks, stopping the rest takes the operating system
# seconds (tearing down hundreds of processes on a few cores): the view
# names the failure at once, and the error follows once every rank is gone.
NAME_AT_ONCE_ABOVE = 16
_NO_RESULT = object()


def _large_job(size: int) -> str:
    return (f"the job (fn, its arguments and what it captures) is {size / 2**20:.1f} MB per rank; tensors "
            "travel through shared memory at no cost, so large data is best passed as tensors")


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
    """A launch's one call on ``pool``: ``run(begin)`` returns the per-rank
    results or raises; the ranks end with it.

    ``begin`` starts the call (starts the pool); it runs inside the watch,
    so an interrupt or a timeout during it is handled as any other. The
    launch's failures reach the rest of the job, and theirs this node,
    through the pool (``publish``, ``news``, ``settle``): which engine, if
    any, has other nodes is the pool's business."""

    def __init__(self, pool: RankPool, view, call: int, *, timeout: Optional[float] = None,
                 stall_warning: Optional[float] = None, job_size: int = 0, name: str = "",
                 stop_requested: Optional[Callable[[], bool]] = None):
        self._pool = pool
        self._stop_requested = stop_requested or (lambda: False)  # the owner's stop (run.stop()), asked each tick
        self._view = view
        self.call = call
        self.name = name or f"call {call}"  # what the user calls it (live ranks count only their runs)
        self._timeout = timeout
        self._job_size = job_size
        self._parts = [_Part() for _ in range(pool.size)]
        self._stalls = Stalls(stall_warning)
        self._sampler: Optional[Sampler] = None
        self._remote: Optional[RankFailure] = None  # another node's failure
        self._stop_at: Optional[float] = None  # a consequence was seen: stop then unless its cause shows first
        self._stop_deadline: Optional[float] = None  # SIGKILL then
        self._left = LeftEarly()
        self._result_bytes = 0  # results received so far, all ranks
        self.broken: Optional[str] = None  # live ranks: why they cannot be trusted any more
        self._desk = DebugDesk(pool, view, self._in_call)

    # -- the call ------------------------------------------------------------------

    def run(self, begin: Callable[[], None]) -> list:
        t0 = time.monotonic()
        try:
            with StopButton() as stop:
                begin()
                self._sampler = Sampler(self._pool.gpu_devices())
                if self._job_size > LARGE_JOB_BYTES:
                    self._view.notice(_large_job(self._job_size))
                self._view.show()
                while not self._over():
                    stop.check()
                    if self._stop_requested():
                        self._stopped_by_owner()
                    self._pass()
                    if (self._timeout is not None and time.monotonic() - t0 - self._desk.held() > self._timeout
                            and not self.broken and not self._desk.paused):
                        self._time_out()
        except KeyboardInterrupt as exc:
            self._interrupted_by_user(exc)
            raise
        except (LaunchTimeout, RunStopped):
            raise
        except BaseException:
            self._give_up("stopped on an error in its launcher")
            raise
        finally:
            self._drain()
        return self._outcome()

    def _drain(self) -> None:
        """The call is over: a launch's ranks are all gone; what they wrote last is taken."""
        self._apply(self._pool.drain())

    def _over(self) -> bool:
        """A launch waits for its ranks to exit."""
        return all(self._pool.exit_seen(r) for r in range(self._pool.size))

    def _in_call(self) -> list[int]:
        """The ranks still in this call: no result, no failure, not ended."""
        return [r for r, p in enumerate(self._parts) if not p.done and not self._pool.exit_seen(r)]

    def _call_over(self) -> bool:
        """Every rank has returned, failed or ended (a held consequence's cause is then in)."""
        return not self._in_call()

    def _pass(self) -> None:
        """Whatever the ranks sent or did within a tick, then the timers (a
        consequence's hold, the kill after a grace, stalls, ranks that left,
        other nodes, interrupt answers, resources) and a redraw."""
        self._apply(self._pool.poll(TICK_S))
        self._desk.serve()
        now = time.monotonic()
        if self._stop_at is not None and (now >= self._stop_at or self._call_over()):
            self._stop_at = None
            self._end_elsewhere()
        if self._stop_deadline is not None and now >= self._stop_deadline:
            self._signal(signal.SIGKILL)  # and what the stopped ranks left behind
            self._stop_deadline = float("inf")
        running = set(self._in_call())
        if not self._desk.paused:  # its peers wait for a rank in its debugger; the stall clock stands still
            for text in self._stalls.check(now - self._desk.held(), running, self._pool.global_rank):
                self._view.notice(text)
            self._check_departures(now)
        self._check_others(now)
        if self._sampler is not None and self._stop_deadline is None:  # not while the ranks die: slow to read
            if usage := self._pool.usage(self._sampler):
                self._view.resources(usage)
                self._stalls.sampled(usage, now - self._desk.held())
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
            self._stalls.moved(rank, event.key, event.n, event.total, event.desc, time.monotonic() - self._desk.held())
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
                                             interrupted=part.interrupted, frames=event.frames))
        elif isinstance(event, Stopping):
            self._on_stopping(rank, event)
        elif isinstance(event, (Prompt, Paused)):
            self._desk.on_event(rank, event)
        elif isinstance(event, Phase):
            self._view.rank_phase(rank, event.what)

    def _take_result(self, rank: int, event: Result) -> None:
        """Unpickle a result as it arrives (its tensors' shared memory is
        fetched from the rank now), tell the rank it may go on, and keep the
        total within the limit: the kernel holds every rank's result."""
        part = self._parts[rank]
        self._result_bytes += len(event.payload) + event.shared
        try:
            part.result = _unpickle_within_limit(event.payload, self._result_bytes)
        except Exception as exc:
            self._fail(rank, errors.unreadable_result(self._pool.global_rank(rank), self._pool.node(rank),
                                                      time.time(), exc))
        else:
            part.departure = Departure.of_return(self._pool.global_rank(rank), self._pool.node(rank), event.time, event.exited)
            self._view.rank_status(rank, "finished")
        finally:
            self._pool.send(rank, RELEASE)

    def _on_exit(self, rank: int, code: int) -> None:
        part = self._parts[rank]
        if not part.done:
            self._fail(rank, errors.death(self._pool.global_rank(rank), self._pool.node(rank), time.time(), code,
                                          part.stopped, part.signals, self._pool.tail(rank)))

    def _fail(self, rank: int, failure: RankFailure) -> None:
        failure = errors.on_host(failure, self._pool.node_name(rank))  # "rank 3 on n2"
        self._parts[rank].failure = failure
        self._desk.gone(rank)
        self._view.rank_status(rank, failure.row)
        if failure.kind in errors.NBLAUNCH_ENDED or failure.kind == "interrupted":
            return
        if failure.kind == "left":
            self._left_behind(failure)
        # An exit with code 0 is held too: peers it left in a collective
        # report the lost connection within the hold, and the verdict then
        # says where they waited (errors.blame_departures).
        if failure.is_consequence or (failure.kind == "exit" and failure.exitcode == 0):
            if self._stop_at is None:
                self._stop_at = time.monotonic() + CONSEQUENCE_HOLD_S
            return
        self._publish(failure)
        self._end_elsewhere()

    # -- steps live ranks do otherwise (live_watch.LiveCallWatch) -----------------

    def _left_behind(self, failure: RankFailure) -> None:
        """A rank left its peers waiting in a collective: a launch stops them all anyway."""

    def _publish(self, failure: RankFailure) -> None:
        if self._stop_deadline is None and self._pool.size > NAME_AT_ONCE_ABOVE:  # the user, at once
            self._view.notice(f"{failure.summary()}; stopping the other ranks (the error follows once they are gone)")
        self._pool.publish(failure)  # the other nodes stop within a poll

    def _on_stopping(self, rank: int, event: Stopping) -> None:
        """A rank says where it stops after an interrupt: only live ranks are interrupted."""

    def _check_others(self, now: float) -> None:
        """Each tick: another node's failure stops this node's ranks."""
        remote = self._pool.news() if self._remote is None else None
        if remote is not None:
            self._remote = remote
            self._view.notice(f"{remote.summary()}; stopping this node's ranks")
            self._begin_stop()

    def _settle(self, failures: list) -> None:
        """The ranks are done: agree with the rest of the job (another node's failure joins ours)."""
        remote = self._pool.settle(failures, self._remote)
        if remote is not None:
            failures.append(remote)

    # -- ending the call on the other ranks -----------------------------------------

    def _end_elsewhere(self) -> None:
        """A rank failed: a launch stops the others."""
        self._begin_stop()

    def _begin_stop(self) -> None:
        """SIGTERM every rank still up, SIGKILL after a grace."""
        if self._stop_deadline is None:
            self._signal(signal.SIGTERM)
            self._stop_deadline = time.monotonic() + STOP_GRACE_S

    def _signal(self, sig: int) -> None:
        _note_signals(self._parts, self._pool, (sig,))
        self._pool.signal(sig, _healthy_first(self._parts))

    def _stop_now(self) -> None:
        """Stop every rank at once (an interrupt, a timeout, an error here)."""
        _note_signals(self._parts, self._pool, (signal.SIGTERM, signal.SIGKILL))
        self._pool.stop(STOP_GRACE_S, order=_healthy_first(self._parts))

    def _give_up(self, what: str) -> None:
        """The call ends here and so do the ranks; other nodes are told."""
        self._stop_now()
        pl = self._pool.placement
        if pl is not None:
            self._pool.publish(errors.node_lost(pl.first_rank, pl.node_rank, time.time(), what))

    def _interrupted_by_user(self, exc: KeyboardInterrupt) -> None:
        where = self._pool.stacks()
        log_dir = self._pool.log_dir
        # The user pressed stop, most likely because it looks stuck.
        self._view.notice("interrupted; every rank was stopped (where each rank was: in the error below)")
        self._give_up("was interrupted")
        render_interrupt(exc, ["KeyboardInterrupt: the launch was interrupted and every rank was "
                               "stopped; where each rank was (innermost frame first):", where,
                               f"Full output: {log_dir}"])

    def _stopped_by_owner(self) -> None:
        """Every rank's stack, then every rank stopped: the owner asked (``stop_requested``)."""
        where = self._pool.stacks()
        self._view.notice("stopped by run.stop(); every rank was stopped (where each rank was: in the error below)")
        self._give_up("was stopped")
        raise RunStopped(where=where, log_dir=str(self._pool.log_dir))

    def _time_out(self) -> None:
        """Every rank's stack first, then the ranks are stopped (their collectives
        time out later than the call: ``rank.env.pg_timeout_for``)."""
        where = self._pool.stacks()
        self._give_up(f"timed out after {self._timeout:g} s")
        raise errors.timed_out("the launch", self._timeout, where, "The ranks were stopped.", self._pool.log_dir)

    # -- ranks that left ------------------------------------------------------

    def _check_departures(self, now: float) -> None:
        """Ranks that returned while their peers still wait for them (:class:`~nblaunch.watch.rules.LeftEarly`)."""
        if self._stop_deadline is not None or self._stop_at is not None:
            return
        gone = [(r, p.departure) for r, p in enumerate(self._parts) if p.departure is not None and p.failure is None]
        found = self._left.check(now, self._pool, gone, self._in_call())
        if found is not None:
            self._fail(*found)

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
        self._settle(failures)
        if not failures:
            return [p.result for p in self._parts]
        error = WorkerError(failures, log_dir=str(self._pool.log_dir))
        raise with_rank_frames(error) from error.root.exception


def _healthy_first(parts: list[_Part]) -> list[int]:
    # A failed rank waits to be stopped so that its peers do not see its
    # sockets close, and must not go before them.
    return sorted(range(len(parts)), key=lambda r: parts[r].failure is not None)


def _note_signals(parts: list[_Part], pool: RankPool, sigs: tuple) -> None:
    """What a rank's death will be judged by: whether nblaunch stopped it
    while it was still in the call, and with which signals."""
    for r, part in enumerate(parts):
        if pool.ended_now(r):  # a rank that died on its own: its death is its own failure
            continue
        if not part.done:
            part.stopped = True
        part.signals.update(sigs)


def _unpickle_within_limit(payload: bytes, received: int):
    """A rank's result, unless the results received so far (``received``
    bytes, all ranks) are over the limit: the kernel holds every one."""
    limit = max_result_bytes()
    if received > limit:
        raise ValueError(
            f"the results received so far total {received:,} bytes, over the "
            f"{limit:,}-byte limit for all ranks together (NBLAUNCH_MAX_RESULT_BYTES). "
            "Return something smaller, or save large outputs to disk and return their paths.")
    return pickle.loads(payload)


def ranks_label(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
