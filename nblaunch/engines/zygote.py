"""Forked ranks come from one copy of the kernel, made ready to be a rank once.

A forked rank shares the kernel's memory until it writes to a page, and
becoming a rank writes to many: leaving IPython, pointing logging at the
rank's pipe, the library shims, and the first run of any inherited code
(which writes the reference counts and caches of each object it touches).
Measured per rank: about 1.7 MiB of the kernel's pages copied by that alone.
So a fork-started generation's ranks are forked from one process, the
*zygote* (as Android and Chromium name theirs): a copy of the kernel that
does that work once (:func:`nblaunch.rank.setup.prepare_for_ranks`) and then
forks each rank, which shares those pages with it. The pages the kernel
itself writes while its ranks run are likewise copied once, by the zygote,
rather than once per rank.

The zygote is started by the pool's starter thread (a thread that never ran
OpenMP, see :mod:`nblaunch.engines.pool`), and forks its ranks from its only
thread. The kernel cannot wait for processes that are not its children, so
the zygote tells it, on one pipe per rank, the rank's pid once forked and
its exit status once reaped (that pipe is the rank's sentinel: readable once
the rank has ended). It leaves when every rank has been reaped. It dies
with the kernel (a parent-death signal) and its ranks die with it (theirs).
"""
from __future__ import annotations

import gc
import multiprocessing
import os
import signal
import struct
import sys
import time
from multiprocessing import util
from multiprocessing.connection import wait
from typing import Callable, Optional

from ..system import linux
from ..rank import setup as rank_setup, worker

__all__ = ["Zygote", "ZygoteRank", "usable"]

_WORD = struct.Struct("q")
_DEAD = -signal.SIGKILL  # the zygote died first: its ranks died with it (parent-death signal)


def usable(method: str) -> bool:
    """A zygote needs fork, and Linux's parent-death signal to tie its ranks to it."""
    return method == "fork" and sys.platform.startswith("linux") and linux.prctl is not None


class ZygoteRank:
    """One rank forked by the zygote, with the part of
    ``multiprocessing.Process``'s interface the pool uses."""

    def __init__(self, status: int):
        self._status = status  # read end: the pid, then the exit status
        self.pid: Optional[int] = None
        self._code: Optional[int] = None
        self._closed = False

    @property
    def sentinel(self) -> int:
        return self._status

    def _read_pid(self, deadline: float, zygote: int) -> None:
        # Written right after the fork; the zygote's end (its sentinel) or
        # the deadline ends the wait for one that never comes.
        ready = wait([self._status, zygote], max(0.0, deadline - time.monotonic()))
        if self._status in ready:
            data = os.read(self._status, _WORD.size)
            if len(data) == _WORD.size:
                self.pid = _WORD.unpack(data)[0]
        os.set_blocking(self._status, False)

    @property
    def exitcode(self) -> Optional[int]:
        if self._code is None and self.pid is not None and not self._closed:
            try:
                data = os.read(self._status, _WORD.size)
            except BlockingIOError:
                return None
            self._code = _WORD.unpack(data)[0] if len(data) == _WORD.size else _DEAD
        return self._code

    def join(self, timeout: Optional[float] = None) -> None:
        if self.pid is not None and not self._closed and self._code is None:
            wait([self._status], timeout)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            os.close(self._status)


class Zygote:
    """The kernel's side: ``ranks`` are ``(spec, job, go, events, output)``
    for each rank, ``kernel_ends`` the pipe ends only the kernel uses (each
    rank closes them, and every other rank's ends, so that a pipe ends when
    its rank does)."""

    def __init__(self, ctx, ranks: list[tuple], kernel_ends: list):
        self.ranks: list[ZygoteRank] = []
        self._writes: list[int] = []
        try:
            for _ in ranks:
                r, w = os.pipe()
                self.ranks.append(ZygoteRank(r))
                self._writes.append(w)
            kernel_only = [*kernel_ends, *(rank.sentinel for rank in self.ranks)]
            self._proc = ctx.Process(target=_serve, args=(os.getpid(), ranks, self._writes, kernel_only),
                                     name="nblaunch-zygote", daemon=False)
        except BaseException:
            self.close()
            raise

    def start(self, timeout: float = 60.0, forked: Callable[[], None] = lambda: None) -> None:
        """Start the zygote and learn every rank's pid; OSError if a rank
        could not be started (its ``pid`` stays None). ``forked`` is called
        once the kernel's one fork is done, before the zygote forks its ranks."""
        try:
            self._proc.start()
        finally:
            for w in self._writes:
                os.close(w)
            self._writes = []
        forked()
        deadline = time.monotonic() + timeout
        for i, rank in enumerate(self.ranks):
            rank._read_pid(deadline, self._proc.sentinel)
            if rank.pid is None:
                self._proc.join(1.0)  # its pipes close a moment before it can be reaped
                code = self._proc.exitcode
                raise OSError(f"the process that forks the ranks could not start local rank {i} "
                              f"({'it did not answer' if code is None else f'it ended with code {code}'})")

    def close(self) -> None:
        """Once its ranks are gone (the zygote reaps them, then leaves)."""
        for w in self._writes:
            os.close(w)
        self._writes = []
        for rank in self.ranks:
            rank.close()

    def kill(self) -> None:
        """End the zygote now, if it runs (its ranks die with it: their
        parent-death signal). Its pid is ours until ``reap``: no other
        process can have it. Safe while the starter is starting it."""
        popen = self._proc._popen
        if popen is not None and popen.returncode is None:
            try:
                os.kill(popen.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def reap(self, timeout: float = 2.0) -> None:
        """Wait for the zygote to leave (killed after ``timeout``). Not on
        the launch's way back: its exit takes milliseconds, as it frees a
        copy of the kernel's address space, and its ranks have all been
        reaped and heard of before."""
        if self._proc.pid is None or self._proc._popen is None:
            return
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            self._proc.kill()
            self._proc.join(timeout)
        try:
            self._proc.close()
        except ValueError:  # reaped by someone else's waitpid: nothing of it is left
            pass


def _serve(parent: int, ranks: list[tuple], writes: list[int], kernel_only: list) -> None:
    """The zygote's whole life (see module doc). ``parent``: the kernel (or
    the node agent) that started it."""
    linux.prctl(linux.PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # it died before the signal was armed
        os._exit(1)
    # The kernel's objects are never collected here, nor in the ranks: a
    # collection writes to every object it visits, and would copy the whole
    # of the kernel's heap into this process (see rank.worker.run_worker).
    gc.freeze()
    for end in kernel_only:
        _close(end)
    # Jupyter interrupts the kernel's process group: that SIGINT is not for
    # the zygote, and its ranks take their own groups.
    os.setpgid(0, 0)
    rank_setup.prepare_for_ranks(ranks[0][0])
    # SLURM's SIGTERM reaches every process of the step; the zygote (never
    # stopped with SIGTERM by nblaunch) outlives it, and its ranks are born
    # with it blocked (rank.term tells a notice from nblaunch's stop).
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    me = os.getpid()
    inherited = fd_spans([*writes, *(_fd(end) for rank in ranks for end in rank[2:])])
    children: dict[int, int] = {}
    for i, (spec, job, go, events, output) in enumerate(ranks):
        try:
            pid = os.fork()
        except OSError:
            break  # the kernel reads no pid for this rank and the rest, and says so
        if pid == 0:
            _become_rank_process(spec, job, go, events, output, me, inherited, (go, events, output))
        children[pid] = i
        os.write(writes[i], _WORD.pack(pid))
    for i in set(range(len(writes))) - set(children.values()):
        os.close(writes[i])
    for rank in ranks:  # the ranks' ends are theirs alone: each pipe ends with its rank
        for end in rank[2:]:
            end.close()
    while children:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            break
        i = children.pop(pid, None)
        if i is not None:
            os.write(writes[i], _WORD.pack(os.waitstatus_to_exitcode(status)))
            os.close(writes[i])
    os._exit(0)


def _close(end) -> None:
    """A pipe end: an fd, or a ``Connection``."""
    if isinstance(end, int):
        os.close(end)
    else:
        end.close()


def _fd(end) -> int:
    return end if isinstance(end, int) else end.fileno()


def fd_spans(fds: list[int]) -> list[tuple[int, int]]:
    """``fds`` as runs of consecutive numbers, ``(first, last + 1)``: the
    pipes of a generation are made one after the other, so usually one run."""
    spans: list[list[int]] = []
    for fd in sorted(fds):
        if spans and spans[-1][1] == fd:
            spans[-1][1] = fd + 1
        else:
            spans.append([fd, fd + 1])
    return [(lo, hi) for lo, hi in spans]


def close_spans(spans: list[tuple[int, int]], keep: tuple) -> int:
    """Close every fd in ``spans`` but those in ``keep``, in one
    ``close_range`` call per run (not one call per fd: a rank of 256 would
    otherwise close 1,000 fds one by one, which grows with the square of the
    world across the ranks). Returns the number of calls made."""
    calls = 0
    kept = sorted(_fd(end) for end in keep)
    for lo, hi in spans:
        for fd in kept:
            if lo <= fd < hi:
                if lo < fd:
                    os.closerange(lo, fd)
                    calls += 1
                lo = fd + 1
        if lo < hi:
            os.closerange(lo, hi)
            calls += 1
    return calls


def _become_rank_process(spec, job, go, events, output, zygote: int, inherited: list, own: tuple) -> None:
    try:
        # The other ranks' pipe ends (and their status pipes) are closed by
        # number: their Connection objects stay referenced from the zygote's
        # frame below this one until os._exit, so none closes a reused number.
        close_spans(inherited, own)
        # What multiprocessing's start-up does for a forked Process.
        multiprocessing.current_process().name = f"nblaunch-rank{spec.local_rank}"
        util._run_after_forkers()
        worker.run_worker(spec, job, go, events, output, parent=zygote)
    except BaseException:  # noqa: BLE001 - as multiprocessing's start-up says it
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
    finally:
        os._exit(1)
