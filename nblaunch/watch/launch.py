"""A launch's call watch for a long run: the steps its ranks reached (for
the restart lines, :mod:`nblaunch.watch.restarts`), preemption
(:mod:`nblaunch.watch.preempt`): a notice of the job's end is passed to every
rank once, the ranks have the grace to save and return, and those still in
the call after it are stopped, the verdict then being ``Preempted``; and
resizes (:mod:`nblaunch.watch.resize`): the same notice when nodes are back,
the verdict then being ``Resized`` whatever the ranks returned."""
from __future__ import annotations

import signal
import time
from typing import Callable, Optional

from ..errors import WorkerError
from ..wire.channel import Preempting, Progress
from .preempt import Catcher, Grace
from .resize import Resize, Resized
from .call import CallWatch

__all__ = ["LaunchWatch"]


class LaunchWatch(CallWatch):
    """:class:`~nblaunch.watch.call.CallWatch` with ``steps`` (global rank -> the
    step its progress bar last showed) and ``preemption`` (a
    :class:`~nblaunch.watch.preempt.Catcher`, None: nothing is caught) and
    ``nodes_back`` (asked each tick: nodes to grow onto; None: the launch
    cannot grow), each named in notices by ``node_label``; ``resized_elsewhere``
    (asked once the ranks all returned) says whether another node of the job
    resized it meanwhile."""

    def __init__(self, pool, view, call: int, *, preemption: Optional[Catcher] = None,
                 nodes_back: Optional[Callable[[], list]] = None,
                 node_label: Optional[Callable[[str], str]] = None,
                 resized_elsewhere: Optional[Callable[[], list]] = None, **options):
        super().__init__(pool, view, call, **options)
        self._catcher = preemption
        self._grace = Grace(preemption)
        self._resize = Resize(nodes_back, preemption.grace if preemption is not None else 0.0, node_label)
        self._resized_elsewhere = resized_elsewhere
        self.steps: dict[int, int] = {}

    def run(self, begin) -> list:
        """The call; preemption signals are caught from before its ranks start."""
        def arm_then_begin() -> None:
            if self._catcher is not None:
                self._catcher.arm()
            begin()

        try:
            return super().run(arm_then_begin)
        finally:
            if self._catcher is not None:
                self._catcher.disarm()

    def _pass(self) -> None:
        super()._pass()
        now, in_call = time.monotonic(), self._in_call()
        if self._grace.check(now, self._pool, self._view, in_call):
            self._give_up("was preempted")
        elif self._resize.check(now, self._pool, self._view, in_call, busy=self._grace.until is not None):
            self._give_up("was resized")

    def _on_event(self, rank: int, event) -> None:
        super()._on_event(rank, event)
        if isinstance(event, Progress) and event.call == self.call:
            self.steps[self._pool.global_rank(rank)] = event.n
        elif isinstance(event, Preempting) and self._catcher is not None:  # SIGTERM to a rank, from outside
            self._catcher.note(event.signal, _rank_on(self._pool, rank))

    def _outcome(self) -> list:
        returned = [r for r, part in enumerate(self._parts) if part.done and part.failure is None]
        if self._grace.expired:
            raise self._grace.error(self._pool, returned, self.steps)
        failures = [part.failure for part in self._parts if part.failure is not None]
        if self._resize.started and self._grace.until is None and all(_stopped(f) for f in failures):
            raise Resized(self._resize.nodes)  # what the ranks returned is dropped: fn runs again, larger
        if not failures and not self._resize.started and self._resized_elsewhere is not None:
            elsewhere = self._resized_elsewhere()
            if elsewhere:
                raise Resized(elsewhere)
        try:
            return super()._outcome()
        except WorkerError as exc:
            # The job's end came before the grace's (SLURM's KillWait is
            # shorter): the ranks it killed were preempted, not failed.
            if self._grace.until is not None and all(_ended(f) for f in exc.failures):
                raise self._grace.error(self._pool, returned, self.steps, ended=True) from exc
            raise


def _ended(failure) -> bool:
    """What the job's end does to a rank that was saving (a crash, even then, is a crash)."""
    return failure.kind in ("node", "stopped", "left") or (
        failure.kind == "signal" and failure.signal in (signal.SIGKILL, signal.SIGTERM))


def _stopped(failure) -> bool:
    """A rank that did not return within a resize's grace and was stopped (a crash is still a crash)."""
    return failure.kind in ("stopped", "left") or (
        failure.kind == "signal" and failure.signal in (signal.SIGKILL, signal.SIGTERM))


def _rank_on(pool, rank: int) -> str:
    host = pool.host(rank)
    return f"rank {pool.global_rank(rank)}" + (f" on {host}" if host else "")
