"""A rank pool: one generation of this node's rank processes.

The pool starts the ranks, reads what they send (events on one pipe, output
on another, their exit), signals them and closes them. It knows nothing of
calls, results or the view: :class:`~nblaunch.watch.CallWatch` reads
:meth:`RankPool.poll` and decides. As in torch elastic's ``PContext``, the
public verbs (``start``, ``poll``, ``send``, ``signal``, ``stop``,
``close``) sit on private steps a kind fills in; :class:`LocalPool` (ranks
started here, by fork, forkserver or spawn, on one machine or as one node of
an elastic rendezvous) is the first kind.

Ranks are *started* from a helper thread (:class:`_Starter`, one per
kernel). A forked child's main thread is a copy of the thread that forked
it, and GNU OpenMP keeps its worker pool per thread: forking from a thread
that never ran a parallel region gives the child a clean pool, so a kernel
that already ran ``torch.randn(n).sum()`` cannot hang the ranks. The helper
thread lives as long as the kernel because Linux sends the ranks'
parent-death signal when the *thread* that forked them ends. On Linux,
forked ranks come from one :class:`~nblaunch.engines.zygote.Zygote` per generation,
which that thread forks (see :mod:`nblaunch.engines.zygote` for why).
"""
from __future__ import annotations

import abc
import collections
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, BinaryIO, Callable, Optional, Union

import psutil

from ..wire.channel import Event, Started, decode
from ..errors import LaunchError
from ..logs import new_launch_dir, release_launch_dir
from .nodes import Nodes, Placement
from ..resources import gpu_devices
from ..rank.stacks import collect, collectives, format_stacks
from ..rank.worker import WorkerSpec, run_worker
from .zygote import Zygote, usable as zygote_usable

__all__ = ["RankPool", "LocalPool", "Lines", "Rewriting", "Message", "Exited", "Lost"]

TEARDOWN_WAIT_S = 2.0  # the most any wait in teardown takes
TAIL_LINES = 40
READS_PER_PASS = 8  # 64 KiB chunks of one rank's output per poll
MAX_PARTIAL_BYTES = 1 << 20  # a "line" this long without a newline is shown as it is
MAX_LIVE_BYTES = 8192  # of an unfinished line, what the live view looks at


# -- what a poll returns ------------------------------------------------------------

@dataclass(frozen=True)
class Lines:
    """Whole lines a rank wrote (as a terminal shows a line rewritten with ``\\r``)."""
    rank: int
    lines: list


@dataclass(frozen=True)
class Rewriting:
    """The line a rank is still writing or rewriting with ``\\r`` (None: it ended)."""
    rank: int
    text: Optional[str]


@dataclass(frozen=True)
class Message:
    """An event the rank sent (:mod:`nblaunch.wire.channel`)."""
    rank: int
    event: Event


@dataclass(frozen=True)
class Exited:
    """The rank's process ended; everything it sent or wrote came before this."""
    rank: int
    exitcode: int


@dataclass(frozen=True)
class Lost:
    """The rank's machine left the launch (its agent's connection closed, or
    the engine ended it): ``why`` says what is known. An ``Exited`` follows."""
    rank: int
    why: str


PoolEvent = Union[Lines, Rewriting, Message, Exited, Lost]


class RankPool(abc.ABC):
    """One generation of ``size`` ranks on this node (local ranks ``0..size-1``).

    ``start()`` starts them and places them in the job; ``poll(timeout)``
    returns what happened since (at least one item, or none after
    ``timeout``); ``send`` writes to a rank's control pipe; ``signal``
    signals ranks with everything they started; ``stacks`` reads where ranks
    are; ``stop(grace)`` ends them all; ``close()`` releases everything
    (safe twice). A rank's global number and node are known once started."""

    size: int
    placement: Optional[Placement] = None
    log_dir: Path

    @abc.abstractmethod
    def start(self, tick: Callable[[], None] = lambda: None) -> Placement:
        """Start every rank and place it; ``tick`` is called while waiting."""

    @abc.abstractmethod
    def poll(self, timeout: float) -> list[PoolEvent]:
        ...

    def host(self, rank: int) -> Optional[str]:
        """The machine a rank runs on, where the pool spans several."""
        return None

    def gpu_devices(self) -> dict:
        """Local rank -> the GPU the kernel samples for it (none for ranks on other machines)."""
        return gpu_devices(list(range(self.size)))

    def usage(self, sampler) -> Optional[dict]:
        """Each running rank's resources, at most every sampler interval (None between)."""
        return sampler.sample(self.running_pids())

    @property
    def pids(self) -> list:
        """Each rank's pid, where its process is on this machine."""
        return []

    # -- the rest of the job: other nodes with kernels of their own. None,
    # unless the engine joins some (engines/elastic.py).

    def publish(self, failure) -> None:
        """Tell the rest of the job that this generation failed here."""

    def news(self):
        """A failure published elsewhere in the job (a ``RankFailure``), or None."""
        return None

    def settle(self, failures: list, seen=None):
        """A launch's ranks are done here (``failures``: theirs; ``seen``:
        another node's already heard of): agree on the outcome with the rest
        of the job; returns a failure from elsewhere, or None."""
        return None

    @abc.abstractmethod
    def send(self, rank: int, message: Any) -> bool:
        """False if the rank can no longer be told (it died: its exit says why)."""

    @abc.abstractmethod
    def signal(self, sig: int, ranks: list[int]) -> None:
        ...

    @abc.abstractmethod
    def kill_orphans(self) -> None:
        """SIGKILL what stopped ranks left behind (children that outlived SIGTERM)."""

    @abc.abstractmethod
    def interrupt(self, rank: int, how: str) -> None:
        """A live rank's SIGINT, for the call it is on (``how``: see ``worker._CallInterrupt``)."""

    @abc.abstractmethod
    def stacks(self, ranks: Optional[list[int]] = None) -> str:
        """Each rank's main-thread stack, innermost frames first."""

    @abc.abstractmethod
    def collectives(self, ranks: list[int]) -> dict[int, Optional[str]]:
        """Global rank -> the collective it waits in (None: not in one)."""

    @abc.abstractmethod
    def stop(self, grace: float, order: Optional[list[int]] = None) -> None:
        """SIGTERM every live rank (in ``order``), SIGKILL what is left after ``grace``."""

    @abc.abstractmethod
    def wait(self, timeout: float) -> bool:
        """Until every rank's process has ended (True) or ``timeout`` passed."""

    @abc.abstractmethod
    def drain(self) -> list[PoolEvent]:
        """Kill what is left; return what the ranks wrote last."""

    @abc.abstractmethod
    def close(self) -> None:
        ...

    # what every kind knows of its ranks
    @abc.abstractmethod
    def global_rank(self, rank: int) -> int: ...

    @abc.abstractmethod
    def node(self, rank: int) -> Optional[int]: ...

    @abc.abstractmethod
    def exited(self, rank: int) -> bool: ...

    @abc.abstractmethod
    def ended(self, rank: int) -> bool:
        """Its process has ended, whether or not a poll has said so yet."""

    @abc.abstractmethod
    def alive(self, rank: int) -> bool:
        """Not exited, and not a zombie (checked now, even between calls)."""

    @abc.abstractmethod
    def started(self, rank: int) -> bool:
        """It reported ``Started``: its stack handler is armed."""

    @abc.abstractmethod
    def running_pids(self) -> dict[int, int]:
        """Local rank -> pid, of ranks started and not ended."""

    @abc.abstractmethod
    def tail(self, rank: int) -> tuple:
        """The rank's last lines of output."""

    @property
    def log_files(self) -> list[str]:
        """Each rank's full output, in local-rank order (once placed)."""
        return [str(self.log_dir / f"rank{self.global_rank(r)}.log") for r in range(self.size)]


@dataclass
class _Proc:
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
    exited: bool = False
    started: bool = False
    # Every process of its tree nblaunch has seen: a child that outlives
    # SIGTERM is orphaned when the rank dies, and must still get the SIGKILL.
    tree: dict = field(default_factory=dict)
    events_open: bool = True
    output_open: bool = True


class LocalPool(RankPool):
    """Ranks started on this machine by ``plan.ctx`` (fork, forkserver, spawn).

    ``job`` is the launch's one call, given at start (the ranks of a live
    session get theirs over the control pipe instead: None). ``nodes`` places
    this node's ranks in the job (:mod:`nblaunch.engines.nodes`); ``attempt`` counts
    restarts."""

    def __init__(self, plan, nodes: Nodes, job: Any = None, attempt: int = 0):
        self._nodes = nodes
        self._attempt = attempt
        self.log_dir, self.notice = new_launch_dir()
        base = plan.specs_base
        self.size = base["local_world_size"]
        self._release = threading.Event()  # set: start no more ranks
        self._started = threading.Event()  # set: the starter has started every rank
        self._starter: Optional[_Starter] = None
        self._closed = False
        self._procs: list[_Proc] = []
        self._child_ends: list[Connection] = []
        self._rank_ends: list[tuple] = []  # each rank's (go, events, output) ends
        self._ends: list[Connection] = []  # every pipe end made, kernel's and ranks'
        self._zygote: Optional[Zygote] = None
        forks_by_zygote = zygote_usable(plan.method)
        try:
            for local in range(self.size):
                self._make_rank(plan, local, job, attempt, own_process=not forks_by_zygote)
            if forks_by_zygote:
                kernel_ends = [end for end in self._ends if end not in self._child_ends]
                self._zygote = Zygote(plan.ctx, [(p.spec, job, *ends) for p, ends in
                                                 zip(self._procs, self._rank_ends)], kernel_ends)
                for p, forked in zip(self._procs, self._zygote.ranks):
                    p.proc = forked
        except BaseException:  # an interrupt while the pipes are made: none is left open
            self._close_pipes()
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
            # Every end made is closed by close(), whatever happens next: an
            # interrupt before this rank is recorded leaked its 3 kernel ends.
            self._ends += ends
        go_r, go_w, ev_r, ev_w, out_r, out_w = ends
        self._child_ends += [go_r, ev_w, out_w]
        self._rank_ends.append((go_r, ev_w, out_w))
        os.set_blocking(out_r.fileno(), False)
        proc = None if not own_process else ctx.Process(
            target=run_worker, args=(spec, job, go_r, ev_w, out_w), name=f"nblaunch-rank{local}", daemon=False)
        self._procs.append(_Proc(spec, proc, go_w, ev_r, out_r))

    # -- starting ----------------------------------------------------------------

    def start(self, tick: Callable[[], None] = lambda: None) -> Placement:
        errors: list[BaseException] = []

        def start_all() -> None:
            try:
                if self._zygote is not None:
                    if not self._release.is_set():
                        self._zygote.start()
                    return
                for p in self._procs:
                    if self._release.is_set():  # interrupted: start no more
                        break
                    p.proc.start()
            except BaseException as exc:  # noqa: BLE001 - re-raised in the cell's thread
                errors.append(exc)

        self._starter = _Starter.get()
        self._started = self._starter.submit(start_all)
        while not self._started.wait(0.1):
            pass
        for end in self._child_ends:
            end.close()
        if errors:
            raise LaunchError(f"could not start the ranks: {errors[0]!r}") from errors[0]
        # Only now, with every fork done, may the kernel run a store's
        # server thread: a fork while that thread holds a libc lock (its
        # getnameinfo on accept) hands the child a lock no one will release.
        pl = self.placement = self._join(tick)
        multi = pl.num_nodes > 1
        for p in self._procs:
            p.global_rank = pl.first_rank + p.spec.local_rank
            p.node = pl.node_rank if multi else None
            # On disk as it arrives: a killed kernel keeps every line.
            p.log = open(self.log_dir / f"rank{p.global_rank}.log", "wb", buffering=0)
            self.send(p.spec.local_rank, {
                "rank": p.global_rank, "world_size": pl.world_size, "group_rank": pl.node_rank,
                "num_nodes": pl.num_nodes, "master_addr": pl.master_addr, "master_port": pl.master_port,
                "restart_count": self._attempt})
        return pl

    def _join(self, tick: Callable[[], None]) -> Placement:
        """``nodes.join`` in a helper thread, so that the cell's thread stays
        interruptible (and the view alive) while the nodes gather."""
        if self._nodes.num_nodes == 1:
            return self._nodes.join(self._attempt)  # hosts a store: nothing to wait for
        box: dict = {}

        def join() -> None:
            try:
                box["placement"] = self._nodes.join(self._attempt)
            except BaseException as exc:  # noqa: BLE001 - re-raised in the cell's thread
                box["error"] = exc

        thread = threading.Thread(target=join, name="nblaunch-join", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.1)
            tick()
        if "error" in box:
            raise box["error"]
        return box["placement"]

    # -- reading -----------------------------------------------------------------

    def poll(self, timeout: float, also: tuple = ()) -> list[PoolEvent]:
        """What happened within ``timeout``; ``also``: more handles whose
        readiness ends the wait (a node agent's connection to the kernel)."""
        handles: dict[Any, tuple[_Proc, Callable]] = {}
        for p in self._procs:
            if p.exited or p.proc.pid is None:
                continue
            if p.events_open:
                handles[p.events] = (p, self._read_events)
            if p.output_open:
                handles[p.output] = (p, self._read_output)
            handles[p.proc.sentinel] = (p, self._read_exit)
        out: list[PoolEvent] = []
        if not handles and not also:
            time.sleep(timeout)
            return out
        for ready in wait(list(handles) + list(also), timeout=timeout):
            if ready not in handles:
                continue
            p, read = handles[ready]
            if not p.exited:
                read(p, out)
        return out

    def _read_events(self, p: _Proc, out: list) -> None:
        while p.events_open and p.events.poll(0):
            # The stop button's KeyboardInterrupt waits until the message is
            # read whole: one landing between a message's length and its
            # body would leave the rest of the rank's stream unreadable
            # (seen on live ranks: a rank's report lost after an interrupt).
            with _InterruptsDeferred():
                try:
                    event = decode(p.events.recv_bytes())
                except (EOFError, OSError):
                    p.events_open = False
                    return
            if isinstance(event, Started):
                p.started = True
            out.append(Message(p.spec.local_rank, event))

    def _read_output(self, p: _Proc, out: list, max_reads: Optional[int] = READS_PER_PASS) -> None:
        """Take what the rank wrote: at most ``max_reads`` chunks a poll, so a
        flooding rank cannot keep the watch from its timers (None: until the
        pipe is empty)."""
        rank, reads = p.spec.local_rank, 0
        while p.output_open and (max_reads is None or reads < max_reads):
            reads += 1
            try:
                data = os.read(p.output.fileno(), 1 << 16)
            except BlockingIOError:
                break
            except OSError:
                data = b""
            if not data:
                p.output_open = False
                self._end_output(p, out)
                return
            if p.log is not None:
                p.log.write(data)
            p.partial += data
            if b"\n" in data:
                *whole, rest = p.partial.split(b"\n")
                p.partial = bytearray(rest)
                self._emit(p, out, [w.decode("utf-8", "replace") for w in whole])
            if len(p.partial) > MAX_PARTIAL_BYTES:  # no newline in sight: show it as it is
                self._emit(p, out, [p.partial.decode("utf-8", "replace")])
                p.partial = bytearray()
        if p.partial:
            # The line the rank is still writing, or rewriting with \r
            # (a progress bar that is not tqdm): shown live, as a terminal would.
            current = p.partial[-MAX_LIVE_BYTES:].decode("utf-8", "replace").rstrip("\r").rsplit("\r", 1)[-1]
            out.append(Rewriting(rank, current))

    def _end_output(self, p: _Proc, out: list) -> None:
        if p.partial:
            self._emit(p, out, [p.partial.decode("utf-8", "replace")])
            p.partial = bytearray()
        out.append(Rewriting(p.spec.local_rank, None))

    @staticmethod
    def _emit(p: _Proc, out: list, lines: list[str]) -> None:
        # What a terminal would show of a line rewritten with carriage returns.
        lines = [line.rstrip("\r").rsplit("\r", 1)[-1] for line in lines]
        p.tail.extend(lines)
        out.append(Lines(p.spec.local_rank, lines))

    def _read_exit(self, p: _Proc, out: list) -> None:
        p.proc.join()
        self._read_events(p, out)
        self._read_output(p, out, max_reads=None)
        if p.output_open:
            self._end_output(p, out)
        p.exited = True
        out.append(Exited(p.spec.local_rank, p.proc.exitcode))

    # -- telling -----------------------------------------------------------------

    def send(self, rank: int, message: Any) -> bool:
        try:
            self._procs[rank].go.send(message)
            return True
        except (OSError, ValueError):
            return False

    def signal(self, sig: int, ranks: list[int]) -> None:
        for rank in ranks:
            p = self._procs[rank]
            # exitcode reaps a rank that died on its own: its death is its own failure.
            if p.exited or p.proc.pid is None or p.proc.exitcode is not None:
                continue
            _signal_tree(p.proc.pid, sig, p.tree)

    def kill_orphans(self) -> None:
        """What a killed rank left behind (children that outlived SIGTERM)."""
        for p in self._procs:
            for proc in p.tree.values():
                try:
                    proc.kill()  # psutil checks the pid still names the same process
                except psutil.Error:
                    pass

    def interrupt(self, rank: int, how: str) -> None:
        p = self._procs[rank]
        try:
            _write_atomically(p.spec.interrupt_file, how)
            os.kill(p.proc.pid, signal.SIGINT)  # the rank alone: DataLoader workers follow their rank
        except (OSError, TypeError):
            pass

    # -- looking -----------------------------------------------------------------

    def stacks(self, ranks: Optional[list[int]] = None) -> str:
        """Only ranks that reported ``Started`` are asked (their handler is
        armed): one still starting would not answer, and waiting for it
        would delay an early interrupt by the whole answer time."""
        chosen = [self._procs[r] for r in (range(self.size) if ranks is None else ranks)]

        def label(p: _Proc) -> int:
            return p.global_rank if p.global_rank >= 0 else p.spec.local_rank

        live = {label(p): (p.proc.pid, p.spec.stack_file) for p in chosen
                if p.started and not p.exited and p.proc.pid is not None and p.spec.stack_file}
        starting = [label(p) for p in chosen if not p.started and not p.exited]
        text = format_stacks(collect(live), live) if live else ""
        if starting:
            text += ("\n" if text else "") + "".join(
                f"  rank {rank}: still starting (fn not called yet)\n" for rank in starting).rstrip("\n")
        return text or "  (no rank was running)"

    def collectives(self, ranks: list[int]) -> dict[int, Optional[str]]:
        live = {self._procs[r].global_rank: (self._procs[r].proc.pid, self._procs[r].spec.stack_file)
                for r in ranks}
        return collectives(collect(live), live)

    def global_rank(self, rank: int) -> int:
        return self._procs[rank].global_rank

    def node(self, rank: int) -> Optional[int]:
        return self._procs[rank].node

    def exited(self, rank: int) -> bool:
        return self._procs[rank].exited

    def ended(self, rank: int) -> bool:
        p = self._procs[rank]
        if p.exited or p.proc.pid is None:
            return p.exited
        # exitcode reaps a child of this process; a rank the zygote forked may
        # be dead and not yet reaped (and so heard of) by it.
        return p.proc.exitcode is not None or not _alive(p.proc.pid)

    def alive(self, rank: int) -> bool:
        p = self._procs[rank]
        return p.proc.pid is not None and p.proc.exitcode is None and _alive(p.proc.pid)

    def started(self, rank: int) -> bool:
        return self._procs[rank].started

    def running_pids(self) -> dict[int, int]:
        return {p.spec.local_rank: p.proc.pid for p in self._procs
                if p.started and not p.exited and p.proc.pid is not None}

    def tail(self, rank: int) -> tuple:
        return tuple(self._procs[rank].tail)

    @property
    def pids(self) -> list[Optional[int]]:
        return [p.proc.pid for p in self._procs]

    # -- ending ------------------------------------------------------------------

    def stop(self, grace: float, order: Optional[list[int]] = None) -> None:
        if self._starter is None:
            return
        everyone = list(range(self.size)) if order is None else order
        self.signal(signal.SIGTERM, everyone)
        self.wait(grace)
        self.signal(signal.SIGKILL, everyone)

    def wait(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        for p in self._procs:
            if p.proc.pid is not None:
                p.proc.join(max(0.0, deadline - time.monotonic()))
        return all(p.proc.pid is None or p.proc.exitcode is not None for p in self._procs)

    def drain(self) -> list[PoolEvent]:
        """Once every rank is stopped: what they printed last (to their logs,
        and returned for the view)."""
        out: list[PoolEvent] = []
        if self._starter is not None:
            self._release.set()  # no more starts ...
            if not self._started.wait(TEARDOWN_WAIT_S):  # ... and none in flight
                self._starter.wedged()
        for p in self._procs:
            if p.proc.pid is not None and p.proc.exitcode is None:
                _signal_tree(p.proc.pid, signal.SIGKILL, p.tree)
                p.proc.join(TEARDOWN_WAIT_S)
        self.kill_orphans()
        for p in self._procs:
            if p.output_open:
                self._read_output(p, out, max_reads=64)
                self._end_output(p, out)
                p.output_open = False
        return out

    def _close_pipes(self) -> None:
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
            p.go.close()
            p.events.close()
            p.output.close()
            if p.log is not None:
                p.log.close()
        for end in self._ends:
            end.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.drain()
        finally:
            self._release.set()
            self._close_pipes()
            release_launch_dir(self.log_dir)


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
            except Exception as exc:  # noqa: BLE001 - this thread must outlive any one job
                print(f"[nblaunch] a job of the thread that starts ranks failed: {exc!r}", file=sys.stderr)
            finally:
                done.set()


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


def _write_atomically(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _alive(pid: int) -> bool:
    # A killed rank shows as a zombie a moment before waitpid can reap it
    # (its other threads are still exiting).
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
