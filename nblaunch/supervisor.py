"""Start the ranks, watch them, stop them, and turn what happened into an outcome.

The supervisor runs in the thread that called ``notebook_launcher`` (the cell's
thread): a ``KeyboardInterrupt`` from the kernel lands right in its wait loop,
and the display it drives prints into the right cell.

Ranks are *started* from a helper thread instead (:class:`_Starter`, one per
kernel). A forked child's main thread is a copy of the thread that forked
it, and GNU OpenMP keeps its worker pool per thread: forking from a thread
that never ran a parallel region gives the child a clean pool, so a kernel
that already ran ``torch.randn(n).sum()`` cannot hang the ranks. The helper
thread lives as long as the kernel because Linux sends the ranks'
parent-death signal when the *thread* that forked them ends.
"""
from __future__ import annotations

import collections
import os
import pickle
import signal
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, BinaryIO, Callable, Optional

import psutil

from .channel import RELEASE, Failure, GpuMemory, Metrics, Progress, Result, Started, Stopping, decode
from .errors import (NBLAUNCH_ENDED, Departure, LaunchError, RankFailure, WorkerError, blame_departures, left_early,
                     render_interrupt, root_cause)
from .resources import Sampler, gpu_devices
from .stacks import collect, collectives, format_stacks
from .worker import WorkerSpec, max_result_bytes, run_worker

__all__ = ["Supervisor", "LaunchTimeout"]

LARGE_JOB_BYTES = 1 << 20
TEARDOWN_WAIT_S = 2.0  # the most any wait in teardown takes
STOP_GRACE_S = 0.25  # SIGTERM -> SIGKILL; a rank blocked in a collective only dies to SIGKILL
# A failure that is only a consequence of a peer's (gloo's "Connection closed
# by peer") often arrives before its cause: the dead peer's sentinel or its
# exception report. Stopping the ranks at once would make the cause look
# like one of the stopped; the verdict waits this long for it.
CONSEQUENCE_HOLD_S = 0.2
REMOTE_GRACE_S = 2.0  # how long a node that only saw a peer vanish waits for the cause
# Some ranks returned while others run on: after this long (then at growing
# intervals) the others' stacks are read, and if every one of them waits in
# a collective, the first rank that left is the failure (it never joins).
LEFT_GRACE_S = 3.0
LEFT_RECHECK_MAX_S = 30.0
TAIL_LINES = 40
READS_PER_PASS = 8  # 64 KiB chunks of one rank's output per pass of the watch loop
MAX_PARTIAL_BYTES = 1 << 20  # a "line" this long without a newline is shown as it is
MAX_LIVE_BYTES = 8192  # of an unfinished line, what the live view looks at
_TICK_S = 0.1
_NO_RESULT = object()


class LaunchTimeout(LaunchError):
    """The launch ran past its ``timeout``; the ranks were stopped.
    ``log_dir``: where each rank's full output is kept."""

    def __init__(self, message: str, log_dir: Optional[str] = None):
        super().__init__(message)
        self.log_dir = log_dir

    def __reduce__(self):
        return (type(self), (str(self), self.log_dir))


@dataclass
class _Rank:
    spec: WorkerSpec
    proc: Any
    go: Connection
    events: Connection
    output: Connection
    log: Optional[BinaryIO] = None  # opened once the rank's global rank is known
    global_rank: int = -1
    node: Optional[int] = None  # set in a multi-node launch
    partial: bytearray = field(default_factory=bytearray)
    tail: collections.deque = field(default_factory=lambda: collections.deque(maxlen=TAIL_LINES))
    result: Any = _NO_RESULT
    failure: Optional[RankFailure] = None
    exited: bool = False
    stopped: bool = False  # nblaunch sent it a signal
    signals_sent: set = field(default_factory=set)
    started: bool = False  # it reported Started: its stack handler is armed
    # Every process of its tree nblaunch has seen: a child that outlives
    # SIGTERM is orphaned when the rank dies, and must still get the SIGKILL.
    tree: dict = field(default_factory=dict)
    events_open: bool = True
    output_open: bool = True
    seq: int = -1  # collectives issued on the default group, as of its last report (live ranks)
    departure: Optional[Departure] = None  # how and when fn ended, once it returned

    @property
    def rank(self) -> int:
        """The local rank: what events and the display index by."""
        return self.spec.local_rank

    def failure_at(self, kind: str, when: float, **fields) -> RankFailure:
        return RankFailure(self.global_rank, kind, when, node=self.node, **fields)


class Supervisor:
    """One launch: ``run()`` returns the per-rank results or raises."""

    def __init__(self, ctx, specs: list[WorkerSpec], job: Any, display, log_dir: Path,
                 group, attempt: int = 0, timeout: Optional[float] = None,
                 stall_warning: Optional[float] = None):
        """``group`` is a :mod:`nblaunch.nodes` group: it places this node's
        ranks in the job and carries failures between nodes."""
        self._ctx = ctx
        self._job = job
        self._display = display
        self._group = group
        self._attempt = attempt
        self._remote: Optional[RankFailure] = None  # another node's failure
        self._placement = None
        self._stall_warning = stall_warning
        self._stalled: set[int] = set()
        self._log_dir = log_dir
        self._timeout = timeout
        self._stop_deadline: Optional[float] = None
        self._result_bytes = 0  # results received so far, all ranks
        self._sampler = Sampler(gpu_devices([spec.local_rank for spec in specs]))
        self._stop_at: Optional[float] = None  # a consequence was seen: stop then unless its cause shows first
        self._left_check: Optional[tuple[float, float]] = None  # (next stack read, interval) while ranks wait on leavers
        self._call = 0  # events of other calls (a live session's) are not this watch's
        self._release = threading.Event()  # set: start no more ranks
        self._started = threading.Event()  # set: the starter has started every rank
        self._starter: Optional[_Starter] = None
        self._ranks: list[_Rank] = []
        child_ends = []
        for spec in specs:
            go_r, go_w = ctx.Pipe(duplex=False)
            ev_r, ev_w = ctx.Pipe(duplex=False)
            out_r, out_w = ctx.Pipe(duplex=False)
            os.set_blocking(out_r.fileno(), False)
            proc = ctx.Process(target=run_worker, args=(spec, job, go_r, ev_w, out_w),
                               name=f"nblaunch-rank{spec.local_rank}", daemon=False)
            self._ranks.append(_Rank(spec, proc, go_w, ev_r, out_r))
            child_ends += [go_r, ev_w, out_w]
        self._child_ends = child_ends

    # -- public -----------------------------------------------------------------

    def run(self) -> list:
        try:
            self._start()
            self._watch()
        except KeyboardInterrupt as exc:
            # The user pressed stop, most likely because it looks stuck.
            where = self._where()
            self._display.notice("interrupted; every rank was stopped (where each rank was: in the error below)")
            self._stop(grace=STOP_GRACE_S)
            self._tell_other_nodes("was interrupted")
            render_interrupt(exc, ["KeyboardInterrupt: the launch was interrupted and every rank was "
                                   "stopped; where each rank was (innermost frame first):", where,
                                   f"Full output: {self._log_dir}"])
            raise
        except LaunchTimeout:
            self._stop(grace=STOP_GRACE_S)
            self._tell_other_nodes(f"timed out after {self._timeout:g} s")
            raise
        except BaseException:
            self._stop(grace=STOP_GRACE_S)
            self._tell_other_nodes("stopped on an error in its launcher")
            raise
        finally:
            self._cleanup()
        return self._outcome()

    # -- starting ----------------------------------------------------------------

    def _start(self) -> None:
        errors: list[BaseException] = []

        def start_all() -> None:
            try:
                for r in self._ranks:
                    if self._release.is_set():  # interrupted: start no more
                        break
                    r.proc.start()
            except BaseException as exc:  # noqa: BLE001 - re-raised in the cell's thread
                errors.append(exc)

        self._starter = _Starter.get()
        self._started = self._starter.submit(start_all)
        while not self._started.wait(_TICK_S):
            pass
        for end in self._child_ends:
            end.close()
        if errors:
            raise LaunchError(f"could not start the ranks: {errors[0]!r}") from errors[0]
        size = getattr(self._job, "size", 0)
        if size > LARGE_JOB_BYTES:
            self._display.notice(
                f"the job (fn, its arguments and what it captures) is {size / 2**20:.1f} MB per rank; "
                "tensors travel through shared memory at no cost, so large data is best passed as tensors")
        # Only now, with every fork done, may the kernel run a store's
        # server thread: a fork while that thread holds a libc lock (its
        # getnameinfo on accept) hands the child a lock no one will release.
        p = self._placement = self._join()
        multi = p.num_nodes > 1
        self._display.state.place(p.first_rank, p.world_size, p.node_rank if multi else None, p.num_nodes)
        for r in self._ranks:
            r.global_rank = p.first_rank + r.rank
            r.node = p.node_rank if multi else None
            r.log = open(self._log_path(r), "wb", buffering=0)  # on disk as it arrives: a killed kernel keeps every line
            place = {"rank": r.global_rank, "world_size": p.world_size, "group_rank": p.node_rank,
                     "num_nodes": p.num_nodes, "master_addr": p.master_addr, "master_port": p.master_port,
                     "restart_count": self._attempt}
            try:
                r.go.send(place)
            except OSError:
                pass  # that rank already died; its sentinel will tell
        self._display.show()

    def _log_path(self, r: _Rank) -> Path:
        return self._log_dir / f"rank{r.global_rank}.log"

    @property
    def log_files(self) -> list[str]:
        """Each rank's full output, in local-rank order (once placed)."""
        return [str(self._log_path(r)) for r in self._ranks]

    def _join(self):
        """``group.join`` in a helper thread, so that the cell's thread stays
        interruptible (and the view alive) while the nodes gather."""
        if self._group.num_nodes == 1:
            return self._group.join(self._attempt)  # hosts a store: nothing to wait for
        box: dict = {}

        def join() -> None:
            try:
                box["placement"] = self._group.join(self._attempt)
            except BaseException as exc:  # noqa: BLE001 - re-raised in the cell's thread
                box["error"] = exc

        self._display.notice(f"waiting for {self._group.num_nodes} nodes to join")
        thread = threading.Thread(target=join, name="nblaunch-join", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(_TICK_S)
            self._display.tick()
        if "error" in box:
            raise box["error"]
        return box["placement"]

    # -- watching ----------------------------------------------------------------

    def _watch(self) -> None:
        t0 = time.monotonic()
        while any(not r.exited for r in self._ranks):
            self._pass()
            if self._timeout is not None and time.monotonic() - t0 > self._timeout:
                raise LaunchTimeout(self._timeout_message("The ranks were stopped."), log_dir=str(self._log_dir))

    def _timeout_message(self, then: str) -> str:
        return (f"the launch did not finish within {self._timeout:g} s; where each rank was "
                f"(innermost frame first):\n{self._where()}\n{then} Full output: {self._log_dir}")

    def _pass(self) -> None:
        """One pass of the watch loop: whatever the ranks sent or did within
        a tick, then the timers (a consequence's hold, the kill after a
        grace, stalls, other nodes, resources) and a redraw."""
        handles: dict[Any, tuple[_Rank, Callable]] = {}
        for r in self._ranks:
            if r.exited:
                continue
            if r.events_open:
                handles[r.events] = (r, self._read_events)
            if r.output_open:
                handles[r.output] = (r, self._read_output)
            handles[r.proc.sentinel] = (r, self._on_exit)
        for ready in wait(list(handles), timeout=_TICK_S):
            rank, handler = handles[ready]
            if not rank.exited:
                handler(rank)
        now = time.monotonic()
        if self._stop_at is not None and (now >= self._stop_at or self._call_over()):
            self._stop_at = None
            self._begin_stop()
        if self._stop_deadline is not None and now >= self._stop_deadline:
            self._signal_live(signal.SIGKILL)
            self._kill_orphans()
            self._stop_deadline = float("inf")
        self._check_stalls(now)
        self._check_departures(now)
        self._check_other_nodes()
        usage = self._sampler.sample({r.rank: r.proc.pid for r in self._ranks
                                      if r.started and not r.exited and r.proc.pid is not None})
        if usage:
            self._display.state.resources(usage)
        self._display.tick()

    def _call_over(self) -> bool:
        """Every rank has returned, failed or ended (on live ranks: this
        call's part of it); whatever a held consequence waits for (its
        cause) is then already in."""
        return all(r.exited or r.result is not _NO_RESULT or r.failure is not None for r in self._ranks)

    def _read_output(self, r: _Rank, max_reads: Optional[int] = READS_PER_PASS) -> None:
        """Take what the rank wrote: at most ``max_reads`` chunks per pass, so
        a flooding rank cannot keep the watch loop from its timers (None:
        until the pipe is empty)."""
        reads = 0
        while r.output_open and (max_reads is None or reads < max_reads):
            reads += 1
            try:
                data = os.read(r.output.fileno(), 1 << 16)
            except BlockingIOError:
                break
            except OSError:
                data = b""
            if not data:
                r.output_open = False
                self._end_output(r)
                return
            if r.log is not None:
                r.log.write(data)
            r.partial += data
            if b"\n" in data:
                *whole, rest = r.partial.split(b"\n")
                r.partial = bytearray(rest)
                self._emit(r, [w.decode("utf-8", "replace") for w in whole])
            if len(r.partial) > MAX_PARTIAL_BYTES:  # no newline in sight: show it as it is
                self._emit(r, [r.partial.decode("utf-8", "replace")])
                r.partial = bytearray()
        if r.partial:
            # The line the rank is still writing, or rewriting with \r
            # (a progress bar that is not tqdm): shown live, as a terminal would.
            current = r.partial[-MAX_LIVE_BYTES:].decode("utf-8", "replace").rstrip("\r").rsplit("\r", 1)[-1]
            self._display.rank_live(r.rank, current)

    def _end_output(self, r: _Rank) -> None:
        if r.partial:
            self._emit(r, [r.partial.decode("utf-8", "replace")])
            r.partial = bytearray()
        self._display.rank_live(r.rank, None)

    def _emit(self, r: _Rank, lines: list[str]) -> None:
        # What a terminal would show of a line rewritten with carriage returns.
        lines = [line.rstrip("\r").rsplit("\r", 1)[-1] for line in lines]
        r.tail.extend(lines)
        self._display.rank_lines(r.rank, lines)

    def _read_events(self, r: _Rank) -> None:
        while r.events_open and r.events.poll(0):
            # The stop button's KeyboardInterrupt waits until the event is
            # read and applied: one landing between a message's length and
            # its body would leave the rest of the rank's stream unreadable
            # (seen on live ranks: a rank's report lost after an interrupt).
            with _InterruptsDeferred():
                self._read_event(r)

    def _read_event(self, r: _Rank) -> None:
        try:
            event = decode(r.events.recv_bytes())
        except (EOFError, OSError):
            r.events_open = False
            return
        state = self._display.state
        if getattr(event, "call", 0) != self._call:
            return  # a live rank's bar of its last call, sent as that call ended
        if isinstance(event, Progress):
            state.progress(event)
        elif isinstance(event, Metrics):
            state.metrics(event)
        elif isinstance(event, GpuMemory):
            self._sampler.reported[r.rank] = (event.device, event.used, event.total, None)
        elif isinstance(event, Result):
            self._take_result(r, event)
        elif isinstance(event, Failure):
            r.failure = self._failure_of(r, event)
            state.set_rank(r.rank, r.failure.kind if r.failure.kind in NBLAUNCH_ENDED else "failed")
            self._on_failure(r.failure)
        elif isinstance(event, Started):
            r.started = True
            state.set_rank(r.rank, "running")
        elif isinstance(event, Stopping):
            self._on_stopping(r, event)

    def _on_stopping(self, r: _Rank, event: Stopping) -> None:
        """A live rank stops at a loop step (a launch's interrupt ends its ranks)."""

    def _take_result(self, r: _Rank, event: Result) -> None:
        """Unpickle a result as it arrives (its tensors' shared memory is
        fetched from the rank now), tell the rank it may leave, and keep the
        total within the limit: the kernel holds every rank's result."""
        self._result_bytes += len(event.payload) + event.shared
        limit = max_result_bytes()
        try:
            if self._result_bytes > limit:
                raise ValueError(
                    f"the results received so far total {self._result_bytes:,} bytes, over the "
                    f"{limit:,}-byte limit for all ranks together (NBLAUNCH_MAX_RESULT_BYTES). "
                    "Return something smaller, or save large outputs to disk and return their paths.")
            r.result = pickle.loads(event.payload)
        except Exception as exc:
            why = str(exc) if isinstance(exc, ValueError) and "NBLAUNCH_MAX_RESULT_BYTES" in str(exc) else (
                f"the result of rank {r.global_rank} could not be unpickled in the kernel: {exc}")
            r.failure = r.failure_at("exception", time.time(), exc_type=type(exc).__qualname__, message=why)
            self._display.state.set_rank(r.rank, "failed")
            self._on_failure(r.failure)
        else:
            r.departure = Departure(r.global_rank, event.time or time.time(),
                                    "exited (code 0)" if event.exited else "returned", r.node,
                                    exitcode=0 if event.exited else None)
            self._display.state.set_rank(r.rank, "finished")
        finally:
            try:
                r.go.send(RELEASE)
            except OSError:
                pass

    def _failure_of(self, r: _Rank, event: Failure) -> RankFailure:
        return _failure_from_event(r, event)

    def _on_exit(self, r: _Rank) -> None:
        r.proc.join()
        self._read_events(r)
        self._read_output(r, max_reads=None)
        self._end_output(r)
        r.exited = True
        code = r.proc.exitcode
        if r.failure is None and r.result is _NO_RESULT:
            r.failure = self._death(r, code)
        if r.failure is not None:
            self._display.state.set_rank(r.rank, r.failure.kind if r.failure.kind in NBLAUNCH_ENDED else "failed")
            if r.failure.kind not in NBLAUNCH_ENDED:
                self._on_failure(r.failure)

    def _death(self, r: _Rank, code: int) -> RankFailure:
        tail = tuple(r.tail)
        now = time.time()
        # Stopped by us, unless it died of a signal we never sent (a segfault,
        # or a SIGKILL from elsewhere between our SIGTERM and our SIGKILL).
        if r.stopped and not (code < 0 and -code not in r.signals_sent):
            return r.failure_at("stopped", now, exitcode=code, signal=-code if code < 0 else None,
                                last_lines=tail)
        if code < 0:
            return r.failure_at("signal", now, exitcode=code, signal=-code, last_lines=tail)
        return r.failure_at("exit", now, exitcode=code, last_lines=tail)

    def _check_stalls(self, now: float) -> None:
        """Warn once when a rank's progress stands still while others move."""
        if not self._stall_warning:
            return
        ranks = self._display.state.ranks
        moving = [i for i, r in enumerate(ranks) if r.last_change and now - r.last_change < self._stall_warning]
        for i, r in enumerate(ranks):
            if r.last_change and now - r.last_change >= self._stall_warning and r.status == "running":
                if moving and i not in self._stalled:
                    self._stalled.add(i)
                    step = f"{r.n}/{r.total}" if r.total else str(r.n)
                    self._display.notice(
                        f"rank {i} has made no progress for {now - r.last_change:.0f} s "
                        f"(last at {r.desc + ' ' if r.desc else ''}{step}) while ranks "
                        f"{', '.join(map(str, moving))} moved on")
            else:
                self._stalled.discard(i)

    def _check_departures(self, now: float) -> None:
        """Ranks that returned while their peers still wait for them in a
        collective: with gloo a peer's exit ends the wait in an error (see
        ``errors.blame_departures``), but a rank that stays up (a live rank
        between calls, one waiting for its result to be fetched) or NCCL
        leaves them waiting until the timeout. Their stacks tell."""
        if self._stop_deadline is not None or self._stop_at is not None:
            return
        gone = [r for r in self._ranks if r.departure is not None and r.failure is None]
        waiting = [r for r in self._ranks if r.result is _NO_RESULT and r.failure is None and not r.exited]
        if not gone or not waiting:
            self._left_check = None
            return
        if self._left_check is None:
            self._left_check = (now + LEFT_GRACE_S, LEFT_GRACE_S)
        due, interval = self._left_check
        if now < due or not all(r.started and r.spec.stack_file for r in waiting):
            return
        live = {r.global_rank: (r.proc.pid, r.spec.stack_file) for r in waiting}
        where = collectives(collect(live), live)
        self._left_check = (time.monotonic() + interval, min(2 * interval, LEFT_RECHECK_MAX_S))
        if all(where.get(r.global_rank) for r in waiting):
            first = min(gone, key=lambda r: r.departure.time)
            first.failure = left_early(first.departure, {f"rank {r.global_rank}": where[r.global_rank]
                                                         for r in waiting})
            self._display.state.set_rank(first.rank, "failed")
            self._on_failure(first.failure)

    def _where(self) -> str:
        """Each live rank's main-thread stack, innermost frames first. Only
        ranks that reported ``Started`` are asked (their handler is armed):
        one still starting would not answer, and waiting for it would delay
        an early interrupt by the whole answer time."""
        def label(r: _Rank) -> int:
            return r.global_rank if r.global_rank >= 0 else r.rank

        live = {label(r): (r.proc.pid, r.spec.stack_file) for r in self._ranks
                if r.started and not r.exited and r.proc.pid is not None and r.spec.stack_file}
        starting = [label(r) for r in self._ranks if not r.started and not r.exited]
        text = format_stacks(collect(live), live) if live else ""
        if starting:
            text += ("\n" if text else "") + "".join(
                f"  rank {rank}: still starting (fn not called yet)\n" for rank in starting).rstrip("\n")
        return text or "  (no rank was running)"

    # -- other nodes -------------------------------------------------------------

    def _on_failure(self, failure: RankFailure) -> None:
        # An exit with code 0 is held too: peers it left in a collective
        # report the lost connection within the hold, and the verdict then
        # says where they waited (errors.blame_departures).
        if failure.is_consequence or (failure.kind == "exit" and failure.exitcode == 0):
            if self._stop_at is None:
                self._stop_at = time.monotonic() + CONSEQUENCE_HOLD_S
            return
        self._group.publish(failure)  # the other nodes stop within a poll
        self._begin_stop()

    def _check_other_nodes(self) -> None:
        if self._remote is not None:
            return
        remote = self._group.poll()
        if remote is not None:
            self._remote = remote
            self._display.notice(f"{remote.summary()}; stopping this node's ranks")
            self._begin_stop()

    def _tell_other_nodes(self, what: str) -> None:
        p = self._placement
        if p is not None and p.num_nodes > 1:
            self._group.publish(RankFailure(p.first_rank, "node", time.time(), message=what, node=p.node_rank))

    def _settle_with_other_nodes(self, failures: list[RankFailure]) -> Optional[RankFailure]:
        """This node's ranks are done. On success, the exit barrier (it returns
        another node's failure if one came). On failure, when this node only
        saw a consequence (a peer vanished), give the node where it started a
        moment to say so, then publish ours."""
        if self._placement is None:
            return None
        if not failures:
            return self._group.finish(succeeded=True)
        if self._placement.num_nodes > 1 and self._remote is None:
            deadline = time.monotonic() + REMOTE_GRACE_S
            while self._remote is None and time.monotonic() < deadline:
                self._remote = self._group.poll(force=True)
                if self._remote is None:
                    time.sleep(_TICK_S)
            if self._remote is None:
                self._group.publish(root_cause(failures))
        self._group.finish(succeeded=False)
        return self._remote

    # -- stopping ----------------------------------------------------------------

    def _begin_stop(self) -> None:
        """A rank failed: ask every other live rank to stop, kill after a grace."""
        if self._stop_deadline is None:
            self._signal_live(signal.SIGTERM)
            self._stop_deadline = time.monotonic() + STOP_GRACE_S

    def _signal_live(self, sig: int) -> None:
        # Healthy ranks first: a failed rank waits to be stopped so that its
        # peers do not see its sockets close, and must not go before them.
        for r in sorted(self._ranks, key=lambda r: r.failure is not None):
            # exitcode reaps a rank that died on its own: its death is its own failure.
            if r.exited or r.proc.pid is None or r.proc.exitcode is not None:
                continue
            if r.result is _NO_RESULT and r.failure is None:
                r.stopped = True
            r.signals_sent.add(sig)
            _signal_tree(r.proc.pid, sig, r.tree)

    def _stop(self, grace: float) -> None:
        """Stop every rank now (interrupt, timeout, internal error)."""
        if self._starter is not None:
            self._signal_live(signal.SIGTERM)
            deadline = time.monotonic() + grace
            for r in self._ranks:
                if r.proc.pid is not None:
                    r.proc.join(max(0.0, deadline - time.monotonic()))
            self._signal_live(signal.SIGKILL)

    def _kill_orphans(self) -> None:
        for r in self._ranks:
            for proc in r.tree.values():
                try:
                    proc.kill()  # psutil checks the pid still names the same process
                except psutil.Error:
                    pass

    def _cleanup(self) -> None:
        try:
            if self._starter is not None:
                self._release.set()  # no more starts ...
                if not self._started.wait(TEARDOWN_WAIT_S):  # ... and none in flight
                    self._starter.wedged()
            for r in self._ranks:
                if r.proc.pid is not None and r.proc.exitcode is None:
                    _signal_tree(r.proc.pid, signal.SIGKILL, r.tree)
                    r.proc.join(TEARDOWN_WAIT_S)
            self._kill_orphans()
            for r in self._ranks:  # what a stopped rank printed last: to its log and the view
                if r.output_open:
                    self._read_output(r, max_reads=64)
                    self._end_output(r)
        finally:
            self._release.set()
            for r in self._ranks:
                if r.proc.pid is not None and r.proc.exitcode is not None:
                    r.proc.close()  # its sentinel pipe; a traceback kept by IPython would hold it
                r.go.close()
                r.events.close()
                r.output.close()
                if r.log is not None:
                    r.log.close()
            for end in self._child_ends:
                end.close()

    # -- outcome -----------------------------------------------------------------

    def _blamed(self) -> list[RankFailure]:
        """This node's failures, a rank that left its peers waiting among them
        (shown as failed in the view too)."""
        failures = [r.failure for r in self._ranks if r.failure is not None]
        departures = [r.departure for r in self._ranks if r.departure is not None and r.failure is None]
        blamed = blame_departures(failures, departures)
        for failure in blamed:
            if failure.kind == "left":
                for r in self._ranks:
                    if r.global_rank == failure.rank:
                        self._display.state.set_rank(r.rank, "failed")
        return blamed

    def _outcome(self) -> list:
        failures = self._blamed()
        results = [] if failures else [r.result for r in self._ranks]
        remote = self._settle_with_other_nodes(failures)
        if remote is not None:
            failures.append(remote)
        if not failures:
            return results
        error = WorkerError(failures, log_dir=str(self._log_dir))
        raise error from error.root.exception


class _InterruptsDeferred:
    """Within the block, SIGINT (the kernel's interrupt) is noted instead of
    raised, and raised as ``KeyboardInterrupt`` (through the handler that was
    there) when the block ends. Only the main thread receives signals, so
    elsewhere this does nothing."""

    def __enter__(self):
        self._previous, self._pending = None, False
        if threading.current_thread() is threading.main_thread():
            previous = signal.getsignal(signal.SIGINT)
            if callable(previous):
                self._previous = previous
                signal.signal(signal.SIGINT, self._note)
        return self

    def _note(self, signum, frame) -> None:
        self._pending = True

    def __exit__(self, *exc) -> None:
        if self._previous is None:
            return
        signal.signal(signal.SIGINT, self._previous)
        if self._pending:
            self._previous(signal.SIGINT, None)


class _Starter:
    """The one thread of this kernel that starts ranks, for every launch.

    A thread, not the cell's: a forked child is a copy of the thread that
    forked it, and this one never runs OpenMP (see the module doc). One for
    the kernel's lifetime, not one per launch: the ranks' parent-death
    signal follows the thread that forked them, so it must outlive them,
    and ipykernel keeps a socket for every thread that ever flushed its
    streams (multiprocessing flushes them on each start): a thread per
    launch leaked one per launch.
    """

    _current: Optional["_Starter"] = None
    _lock = threading.Lock()

    def __init__(self):
        import queue

        self._jobs: "queue.SimpleQueue" = queue.SimpleQueue()
        threading.Thread(target=self._run, name="nblaunch-starter", daemon=True).start()

    @classmethod
    def get(cls) -> "_Starter":
        with cls._lock:
            if cls._current is None:
                cls._current = cls()
            return cls._current

    def submit(self, fn: Callable[[], None]) -> threading.Event:
        done = threading.Event()
        self._jobs.put((fn, done))
        return done

    def wedged(self) -> None:
        """A start did not finish in time: Python's spawn writes the job
        into a pipe while it holds the read end itself, so a rank killed
        before reading a job larger than the pipe leaves that write blocked
        for good (jobs are kept small for this). The next launch gets a new
        thread rather than queueing behind this one."""
        with self._lock:
            if _Starter._current is self:
                _Starter._current = None

    def _run(self) -> None:
        while True:
            fn, done = self._jobs.get()
            try:
                fn()
            finally:
                done.set()


def _failure_from_event(r: _Rank, event: Failure) -> RankFailure:
    exception = None
    if event.exception is not None:
        try:
            exception = pickle.loads(event.exception)
        except Exception:
            exception = None
    return r.failure_at("exception", event.time, exc_type=event.exc_type,
                        message=event.message, remote_traceback=event.traceback,
                        exception=exception, exitcode=1)  # the worker's exit code after a report


def _signal_tree(pid: int, sig: int, seen: Optional[dict] = None) -> None:
    """Signal a rank and every process it started (DataLoader workers...),
    noting each in ``seen`` (pid -> psutil.Process)."""
    try:
        procs = [psutil.Process(pid)]
        procs += procs[0].children(recursive=True)
    except psutil.Error:
        procs = []
    for proc in reversed(procs):
        if seen is not None:
            seen.setdefault(proc.pid, proc)
        try:
            proc.send_signal(sig)
        except psutil.Error:
            pass
