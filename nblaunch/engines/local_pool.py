"""The local engine's rank pool: a generation of rank processes on this
machine, started by ``plan.ctx`` (fork through one zygote process per
generation, forkserver or spawn) from the kernel's starter thread
(:mod:`nblaunch.engines.procs`), placed in the job by its nodes
(:mod:`nblaunch.engines.nodes`), read through their pipes."""
from __future__ import annotations

import collections
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Optional

import psutil

from ..system import linux
from ..errors import LaunchError
from .logs import new_launch_dir, release_launch_dir
from ..rank.stacks import collect, collectives, format_stacks
from ..rank.spec import WorkerSpec
from ..rank.worker import run_worker
from ..wire.channel import EventReader, Failure, Interrupt, Result, Started
from .nodes import Nodes, Placement
from .output import END_DRAIN_S, RankOutput, drain_due
from .plan import starting_ranks
from .pipes import PoolPipes
from .pool import TAIL_LINES, TEARDOWN_WAIT_S, Exited, Message, PoolEvent, RankFacts, RankPool
from ..system.pidfds import open_pidfd, wait as wait_pidfds
from .procs import Starter, in_helper_thread, is_running, signal_trees
from ..system.files import write_atomically
from .zygote import Zygote, usable as zygote_usable

__all__ = ["LocalPool"]


@dataclass(kw_only=True)
class _Proc(RankFacts):
    """A local rank: its spec, process, pipes and the processes it started."""

    spec: WorkerSpec
    proc: Any
    go: Connection
    events: EventReader
    output: RankOutput
    # Every process of its tree nblaunch has seen: a child that outlives
    # SIGTERM is orphaned when the rank dies, and must still get the SIGKILL.
    tree: dict = field(default_factory=dict)
    pidfd: Optional[int] = None  # the rank's very process, once signalled (engines/pidfds.py)
    # When its process was seen to end, while its output pipe was still open
    # (a child of the rank holds it): its Exited waits for the pipe's end.
    ending_since: Optional[float] = None


class LocalPool(RankPool):
    """Ranks started on this machine by ``plan.ctx`` (fork, forkserver, spawn).

    ``job`` is the launch's one call, given at start (the ranks of a live
    session get theirs over the control pipe instead: None). ``nodes`` places
    this node's ranks in the job (:mod:`nblaunch.engines.nodes`); ``attempt`` counts
    restarts. ``zygote``: forked ranks come from one zygote (False: each is
    forked by the starter thread itself, see :mod:`nblaunch.engines.local`)."""

    def __init__(self, plan, nodes: Nodes, job: Any = None, attempt: int = 0, zygote: bool = True):
        self._nodes = nodes
        self._attempt = attempt
        base = plan.specs_base
        self.size = base["local_world_size"]
        self._no_more_starts = threading.Event()
        self._started = threading.Event()  # set: the starter has started every rank
        self._forked = threading.Event()  # set: the kernel has forked all it will (a zygote: once)
        self._starter: Optional[Starter] = None
        self._procs: list[_Proc] = []
        self.facts = self._procs
        self._child_ends: list[Connection] = []
        self._rank_ends: list[tuple] = []  # each rank's (go, events, output) ends
        self._ends: list[Connection] = []  # every pipe end made, kernel's and ranks'
        self._zygote: Optional[Zygote] = None
        self._method = plan.method
        self._pipes: Optional[PoolPipes] = None  # every rank's pipes, once all are started
        forks_by_zygote = zygote and zygote_usable(plan.method)
        try:  # a failure anywhere here leaves nothing open (a press waits: see Engine.new_pool)
            self.log_dir, self.notice = new_launch_dir()
            for local in range(self.size):
                self._make_rank(plan, local, job, attempt, own_process=not forks_by_zygote)
            if forks_by_zygote:
                ranks_ends = set(self._child_ends)  # a set: a list's `in` made this grow with the square of the world
                kernel_ends = [end for end in self._ends if end not in ranks_ends]
                self._zygote = Zygote(plan.ctx, [(p.spec, job, *ends) for p, ends in
                                                 zip(self._procs, self._rank_ends)], kernel_ends)
                for p, forked in zip(self._procs, self._zygote.ranks):
                    p.proc = forked
        except BaseException:
            self._close_pipes()
            if hasattr(self, "log_dir"):
                release_launch_dir(self.log_dir)
            raise

    def _make_rank(self, plan, local: int, job: Any, attempt: int, own_process: bool) -> None:
        """The rank's spec and pipes; its ``multiprocessing.Process`` when
        ``own_process`` (else the zygote's, set once every rank is made)."""
        base, ctx = plan.specs_base, plan.ctx
        spec = WorkerSpec(rank=local, local_rank=local, restart_count=attempt,
                          stack_file=str(self.log_dir / f"local{local}.stacks"),
                          interrupt_file=str(self.log_dir / f"local{local}.interrupt") if base["live"] else "",
                          **base)
        ends: list = []
        try:
            for _ in range(3):
                ends += ctx.Pipe(duplex=False)
        finally:
            # Every end made is closed by close(), whatever happens next: a
            # failure (out of fds) before this rank is recorded leaked its ends.
            self._ends += ends
        go_r, go_w, ev_r, ev_w, out_r, out_w = ends
        self._child_ends += [go_r, ev_w, out_w]
        self._rank_ends.append((go_r, ev_w, out_w))
        proc = None if not own_process else ctx.Process(
            target=run_worker, args=(spec, job, go_r, ev_w, out_w), name=f"nblaunch-rank{local}", daemon=False)
        tail: collections.deque = collections.deque(maxlen=TAIL_LINES)
        self._procs.append(_Proc(spec=spec, proc=proc, go=go_w, events=EventReader(ev_r),
                                 output=RankOutput(local, out_r, tail), tail=tail))

    # -- starting ----------------------------------------------------------------

    def start(self, tick: Callable[[], None] = lambda: None) -> Placement:
        errors: list[BaseException] = []

        def start_all() -> None:
            try:
                if self._zygote is not None:
                    if not self._no_more_starts.is_set():
                        self._zygote.start(forked=self._forked.set)
                    return
                with starting_ranks(self._method):
                    for p in self._procs:
                        if self._no_more_starts.is_set():  # interrupted: start no more
                            break
                        p.proc.start()
            except BaseException as exc:  # noqa: BLE001 - re-raised in the cell's thread
                errors.append(exc)
            finally:
                self._forked.set()

        self._starter = Starter.get()
        self._started = self._starter.submit(start_all)
        _wait_for(self._forked, errors)
        for end in self._child_ends:
            end.close()
        # Only now, with the kernel's forks done, may it run a store's server
        # thread: a fork while that thread holds a libc lock (its getnameinfo
        # on accept) hands the child a lock no one will release. A zygote's
        # ranks are told their place while it still forks the later ones:
        # the first run while the last are made (the launch's time per added
        # rank fell by a third at 64 ranks).
        pl = self.placement = self._join(tick)
        multi = pl.num_nodes > 1
        for p in self._procs:
            p.global_rank = pl.first_rank + p.spec.local_rank
            p.node = pl.node_rank if multi else None
            # On disk as it arrives: a killed kernel keeps every line.
            p.output.log = open(self.log_dir / f"rank{p.global_rank}.log", "wb", buffering=0)
            self.send(p.spec.local_rank, {
                "rank": p.global_rank, "world_size": pl.world_size, "group_rank": pl.node_rank,
                "num_nodes": pl.num_nodes, "master_addr": pl.master_addr, "master_port": pl.master_port,
                "restart_count": self._attempt})
        _wait_for(self._started, errors)
        return pl

    def _join(self, tick: Callable[[], None]) -> Placement:
        """``nodes.join``; across nodes, in a helper thread, so that the
        cell's thread stays interruptible (and the view alive) while they gather."""
        if self._nodes.num_nodes == 1:
            return self._nodes.join(self._attempt)  # hosts a store: nothing to wait for
        return in_helper_thread(lambda: self._nodes.join(self._attempt), tick, name="nblaunch-join")

    # -- reading -----------------------------------------------------------------

    def poll(self, timeout: float, also: tuple = ()) -> list[PoolEvent]:
        """What happened within ``timeout``; ``also``: more handles whose
        readiness ends the wait (a node agent's connection to the kernel).
        Routine traffic comes in batches (:class:`~nblaunch.engines.pipes.PoolPipes`)."""
        if self._pipes is None and self._procs and all(p.proc.pid is not None for p in self._procs):
            self._pipes = PoolPipes(self._procs, self._read_events, self._read_exit)
        ending, timeout = _ending(self._procs, timeout)
        out = self._pipes.poll(timeout, also) if self._pipes is not None else self._poll_started(timeout, also)
        for p in ending:
            _end_if_drained(p, out)
        return out

    def _poll_started(self, timeout: float, also: tuple) -> list[PoolEvent]:
        """A start that did not finish: the ranks that did start, this once."""
        live = [p for p in self._procs if p.proc.pid is not None and not p.exited]
        if not live and not also:
            time.sleep(timeout)
            return []
        pipes = PoolPipes(live, self._read_events, self._read_exit, open_only=True)
        try:
            return pipes.poll(timeout, also)
        finally:
            pipes.close()

    def _read_events(self, p: _Proc, out: list) -> None:
        events = p.events.read()
        if any(isinstance(event, (Result, Failure)) for event in events):  # what it printed before, first
            p.output.drain(out)  # (all in the pipe now: the rank flushed its streams before it reported)
        for event in events:
            if isinstance(event, Started):
                p.started = True
            out.append(Message(p.spec.local_rank, event))

    def _read_exit(self, p: _Proc, out: list) -> None:
        if p.ending_since is None:  # its events, its output; its Exited once the pipe ends (_end_if_drained)
            p.proc.join()
            self._read_events(p, out)
            p.output.drain(out)
            p.ending_since = time.monotonic()
        _end_if_drained(p, out)

    # -- telling -----------------------------------------------------------------

    def send(self, rank: int, message: Any) -> bool:
        if isinstance(message, Interrupt):
            return _interrupt(self._procs[rank], message.how)
        try:
            self._procs[rank].go.send(message)
            return True
        except (OSError, ValueError):
            return False

    def signal(self, sig: int, ranks: list[int]) -> None:
        # exitcode reaps a rank that died on its own: its death is its own failure.
        signal_trees([(p.proc.pid, p.tree, self._pidfd(p)) for p in (self._procs[r] for r in ranks)
                      if not (p.exited or p.proc.pid is None or p.proc.exitcode is not None)], sig)
        if sig == signal.SIGKILL:
            self._kill_orphans()

    def _pidfd(self, p: _Proc) -> Optional[int]:
        if p.pidfd is None:
            p.pidfd = open_pidfd(p.proc.pid, lambda: p.proc.exitcode is None)
        return p.pidfd

    def _kill_orphans(self) -> None:
        """What a killed rank left behind (children that outlived SIGTERM)."""
        for p in self._procs:
            for proc in p.tree.values():
                try:
                    proc.kill()  # psutil checks the pid still names the same process
                except psutil.Error:
                    pass

    # -- looking -----------------------------------------------------------------

    def _ask(self, what: str, ranks: list[int]) -> Any:
        return self._stacks(ranks) if what == "stacks" else self._collectives(ranks)

    def _stacks(self, ranks: list[int]) -> str:
        """Only ranks that reported ``Started`` are asked (their handler is
        armed): one still starting would not answer, and waiting for it
        would delay an early interrupt by the whole answer time."""
        chosen = [self._procs[r] for r in ranks]
        live = {_label(p): (p.proc.pid, p.spec.stack_file) for p in chosen
                if p.started and not p.exited and p.proc.pid is not None and p.spec.stack_file}
        starting = [_label(p) for p in chosen if not p.started and not p.exited]
        text = format_stacks(collect(live), live) if live else ""
        if starting:
            text += ("\n" if text else "") + "".join(
                f"  rank {rank}: still starting (fn not called yet)\n" for rank in starting).rstrip("\n")
        return text or "  (no rank was running)"

    def _collectives(self, ranks: list[int]) -> dict[int, Optional[str]]:
        live = {self._procs[r].global_rank: (self._procs[r].proc.pid, self._procs[r].spec.stack_file)
                for r in ranks}
        return collectives(collect(live), live)

    def ended_now(self, rank: int) -> bool:
        p = self._procs[rank]
        if p.exited or p.proc.pid is None:
            return p.exited
        # exitcode reaps a child of this process; a rank the zygote forked may
        # be dead and not yet reaped (and so heard of) by it.
        return p.proc.exitcode is not None or not is_running(p.proc.pid)

    def up_now(self, rank: int) -> bool:
        p = self._procs[rank]
        return p.proc.pid is not None and p.proc.exitcode is None and is_running(p.proc.pid)

    def running_pids(self) -> dict[int, int]:
        return {p.spec.local_rank: p.proc.pid for p in self._procs
                if p.started and not p.exited and p.proc.pid is not None}

    @property
    def pids(self) -> list[Optional[int]]:
        return [p.proc.pid for p in self._procs]

    # -- ending ------------------------------------------------------------------

    def wait(self, timeout: float) -> bool:
        """Ranks signalled (named by pidfds) in one poll; any other one by its sentinel."""
        deadline = time.monotonic() + timeout
        named = [p for p in self._procs if p.pidfd is not None]
        ended = wait_pidfds([p.pidfd for p in named], timeout)
        for p in self._procs:
            if p.proc.pid is not None and p.pidfd is None:
                p.proc.join(max(0.0, deadline - time.monotonic()))
        others = all(p.proc.pid is None or p.pidfd is not None or p.proc.exitcode is not None for p in self._procs)
        return ended and others

    def drain(self) -> list[PoolEvent]:
        """Once every rank is stopped: what they printed last (to their logs, and for the view)."""
        out: list[PoolEvent] = []
        if self._starter is not None:
            self._no_more_starts.set()  # no more starts ...
            if self._zygote is not None and not self._started.is_set():
                self._zygote.kill()  # still making its ranks (seconds, loaded): not waited for; they die with it
            if not self._started.wait(TEARDOWN_WAIT_S):  # ... and none in flight
                self._starter.wedged()
        for p in self._procs:
            if p.proc.pid is not None and p.proc.exitcode is None:
                signal_trees([(p.proc.pid, p.tree, self._pidfd(p))], signal.SIGKILL)
                p.proc.join(TEARDOWN_WAIT_S)
        self._kill_orphans()
        _read_to_end(self._procs, out, self._child_ends if self._started.is_set() else None)
        return out

    def _close_pipes(self) -> None:
        if self._pipes is not None:
            self._pipes.close()
            self._pipes = None
        if self._zygote is not None:
            self._zygote.close()  # closes its ranks' sentinels too
            # Reaped on the thread that forked it, which makes every other
            # child of this kernel's launches too (no two waits for one pid).
            if self._starter is not None:
                self._starter.submit(self._zygote.reap)
            else:
                self._zygote.reap()
        for p in self._procs:
            if p.proc is not None and p.proc.pid is not None and p.proc.exitcode is not None:
                p.proc.close()  # its sentinel pipe; a traceback kept by IPython would hold it
            if p.pidfd is not None:
                os.close(p.pidfd)
                p.pidfd = None
            p.go.close()
            p.events.conn.close()
            p.output.close()
        for end in self._ends:
            end.close()

    def _release(self) -> None:
        self._no_more_starts.set()
        self._close_pipes()
        release_launch_dir(self.log_dir)


def _label(p: _Proc) -> int:
    return p.global_rank if p.global_rank >= 0 else p.spec.local_rank


def _end_if_drained(p: _Proc, out: list) -> None:
    """A rank's exit is acted on once its output pipe ended; one a child of
    the rank keeps open, after ``END_DRAIN_S``, said in its log and view."""
    if p.exited or p.ending_since is None:
        return
    if p.output.open:
        p.output.read(out)
    if not drain_due(not p.output.open, time.monotonic() - p.ending_since, END_DRAIN_S):
        return
    if p.output.open:
        p.output.note(out, f"rank {_label(p)} ended, but a process it started still holds its output open; "
                           f"what that process writes after {END_DRAIN_S:g} s is not kept")
        p.output.end(out)
        p.output.open = False
    p.exited = True
    out.append(Exited(p.spec.local_rank, p.proc.exitcode))


def _ending(procs: list, timeout: float) -> tuple[list, float]:
    """The ranks whose process ended while their output pipe is still open,
    and the poll's timeout, cut to wake at the first one's drain deadline."""
    ending = [p for p in procs if p.ending_since is not None and not p.exited]
    if ending:
        timeout = max(0.0, min(timeout, min(p.ending_since for p in ending) + END_DRAIN_S - time.monotonic()))
    return ending, timeout


def _read_to_end(procs: list, out: list, child_ends: Optional[list]) -> None:
    """Every stopped rank's output pipe, to its end, for at most
    ``END_DRAIN_S`` in all. ``child_ends``: the copies of the ranks' ends
    this process still holds, closed first (None: the starter may still
    fork with them; the pipes are read as they are)."""
    to_end = child_ends is not None
    for end in child_ends or ():
        end.close()
    until = time.monotonic() + END_DRAIN_S
    for p in procs:
        while p.output.open and p.proc.pid is not None:
            p.output.read(out, max_reads=None, until=until)
            if not to_end or not p.output.open or time.monotonic() >= until:
                break
            wait([p.output.conn], max(0.0, until - time.monotonic()))
        if p.output.open:
            if to_end and p.proc.pid is not None:
                p.output.note(out, f"a process rank {_label(p)} started still holds its output open; "
                                   f"what it writes after the stop is not kept")
            p.output.end(out)
            p.output.open = False


def _wait_for(event: threading.Event, errors: list) -> None:
    """Until the starter sets ``event`` (the cell's thread stays interruptible); then its errors."""
    while not event.wait(0.1):
        pass
    if errors:
        raise LaunchError(f"could not start the ranks: {errors[0]!r}") from errors[0]


def _interrupt(p: _Proc, how: str) -> bool:
    """A live rank's interrupt: what it is for, in its file, then SIGINT to the
    rank's main thread alone, which it wakes from a blocking call (its
    DataLoader workers follow their rank)."""
    try:
        write_atomically(p.spec.interrupt_file, how)
        linux.signal_main_thread(p.proc.pid, signal.SIGINT)
        return True
    except (OSError, TypeError):
        return False
