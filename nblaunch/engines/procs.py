"""The kernel's hands on local rank processes: the one thread that starts
them (:class:`Starter`), signalling a rank with everything it started, and
reading a rank's pipe without a half-read message on an interrupt.

Ranks are *started* from a helper thread, one per kernel. A forked child's
main thread is a copy of the thread that forked it, and GNU OpenMP keeps its
worker pool per thread: forking from a thread that never ran a parallel
region gives the child a clean pool, so a kernel that already ran
``torch.randn(n).sum()`` cannot hang the ranks. The helper thread lives as
long as the kernel because Linux sends the ranks' parent-death signal when
the *thread* that forked them ends. On Linux, forked ranks come from one
:class:`~nblaunch.engines.zygote.Zygote` per generation, which that thread
forks (see :mod:`nblaunch.engines.zygote` for why).
"""
from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Any, Callable, Optional

import psutil

from ..system.resources import tree_of
from ..system import pidfds

__all__ = ["Starter", "InterruptsDeferred", "in_helper_thread", "signal_tree", "signal_trees", "is_running"]


class InterruptsDeferred:
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


class Starter:
    """The one thread of this kernel that starts ranks, for every launch.

    A thread, not the cell's: a forked child is a copy of the thread that
    forked it, and this one never runs OpenMP (see the module doc). One for
    the kernel's lifetime, not one per launch: the ranks' parent-death
    signal follows the thread that forked them, so it must outlive them,
    and ipykernel keeps a socket for every thread that ever flushed its
    streams (multiprocessing flushes them on each start): a thread per
    launch leaked one per launch.
    """

    _current: Optional["Starter"] = None
    _lock = threading.Lock()

    def __init__(self):
        import queue

        self._jobs: "queue.SimpleQueue" = queue.SimpleQueue()
        threading.Thread(target=self._run, name="nblaunch-starter", daemon=True).start()

    @classmethod
    def get(cls) -> "Starter":
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
            if Starter._current is self:
                Starter._current = None

    def _run(self) -> None:
        # What this thread forks is in the kernel's process group until it
        # takes one of its own, and Jupyter's interrupt goes to that whole
        # group: SIGINT in the zygote's start-up raised KeyboardInterrupt,
        # and writing its traceback could wait for good on a stream lock
        # another kernel thread held at the fork (the zygote outlived the
        # launch; 3 in 200 group interrupts right after its fork). Held here,
        # SIGINT reaches the kernel's main thread, and is born held in every
        # child; the rank lets it in once it leads its own group.
        if hasattr(signal, "pthread_sigmask"):
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        while True:
            fn, done = self._jobs.get()
            try:
                fn()
            except Exception as exc:  # noqa: BLE001 - this thread must outlive any one job
                print(f"[nblaunch] a job of the thread that starts ranks failed: {exc!r}", file=sys.stderr)
            finally:
                done.set()


def signal_tree(pid: int, sig: int, seen: Optional[dict] = None) -> None:
    """Signal a rank and every process it started (DataLoader workers...),
    noting each in ``seen`` (pid -> psutil.Process)."""
    signal_trees([(pid, seen)], sig)


def signal_trees(ranks: list[tuple], sig: int) -> None:
    """Signal ranks (``(pid, seen)`` or ``(pid, seen, pidfd)`` each, as
    ``signal_tree``) and every process they started: every tree is read
    first, then every process signalled, children before their rank, the
    ranks in the order given. A rank with a pidfd (:mod:`.pidfds`) is
    signalled through it (and left out of ``seen``), and not at all once it
    has ended; a SIGKILL does not read again the tree of one already exiting.
    Once the first rank is signalled, the dying compete with the kernel for
    the CPUs: nothing is read between signals. They are not reniced (they
    were, to keep the kernel's CPU): at ``nice 19`` the teardown of hundreds
    of ranks crawled on a machine busy with anything else."""
    fds = [entry[2] for entry in ranks if len(entry) > 2 and entry[2] is not None]
    over = pidfds.ended(fds)
    doomed: list = []  # psutil.Process, or a pidfd
    for entry in ranks:
        pid, seen, fd = entry if len(entry) > 2 else (*entry, None)
        if fd is not None and fd in over:
            continue
        if fd is not None and sig == signal.SIGKILL and pidfds.exiting(pid):
            # Dying already (of the SIGTERM, most often): it starts nothing
            # more, and what it started was seen when it was signalled.
            doomed.append(fd)
            continue
        # Not psutil's children(): it reads every process on the machine, for each rank.
        for member in reversed(tree_of(pid)):
            if member == pid and fd is not None:
                doomed.append(fd)
                continue
            try:
                proc = psutil.Process(member)
            except psutil.Error:
                continue
            if seen is not None:
                proc = seen.setdefault(member, proc)
            doomed.append(proc)
    for target in doomed:
        if isinstance(target, int):
            pidfds.send(target, sig)
            continue
        try:
            os.kill(target.pid, sig)  # named a moment ago by psutil: the same process
        except OSError:
            pass


def is_running(pid: int) -> bool:
    # A killed rank shows as a zombie a moment before waitpid can reap it
    # (its other threads are still exiting).
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def in_helper_thread(fn: Callable[[], Any], tick: Callable[[], None], name: str) -> Any:
    """``fn()`` in a daemon thread while this thread ticks every 0.1 s: a
    ``KeyboardInterrupt`` reaches this thread at once, whatever ``fn``
    blocks in. ``fn``'s exception is raised here."""
    box: dict = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.1)
        tick()
    if "error" in box:
        raise box["error"]
    return box["value"]
