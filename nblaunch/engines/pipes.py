"""A local pool's pipes, read as they become ready: every rank's event pipe,
output pipe and exit sentinel, kept in one selector for the pool's life.

A selector made per poll (``multiprocessing.connection.wait``) cost the
kernel work in proportion to the ranks on every wake, and a wake came with
nearly every event: with many ranks reporting, the kernel's cost grew with
the square of the world. Here a wake costs what is ready, and routine
traffic (bars, metrics, output) is gathered for ``BATCH_S`` after the last
poll that returned some, so the call watch wakes for it at most
``1 / BATCH_S`` times a second, whatever the number of ranks. Anything else
(a result, a failure, an exit, a debugger prompt) is returned at once.
"""
from __future__ import annotations

import selectors
import time
from typing import Callable

from ..wire.channel import ROUTINE, Metrics, Progress
from .pool import Lines, Message, PoolEvent, Rewriting
from .procs import InterruptsDeferred

__all__ = ["PoolPipes", "BATCH_S", "routine", "coalesce"]

BATCH_S = 0.05


def routine(item: PoolEvent) -> bool:
    """What a rank reports as it goes: the view wants the latest, nothing waits on it."""
    return isinstance(item, (Lines, Rewriting)) or (isinstance(item, Message) and isinstance(item.event, ROUTINE))


def coalesce(items: list[PoolEvent]) -> list[PoolEvent]:
    """``items`` with what a later item makes moot left out: of a rank's
    bar, only its newest state (a bar's state is whole in each report); of
    a rank's metrics, one message with all their points. The order of
    everything else is kept, and no bar's state moves past another event
    of its rank (a result is never overtaken by a bar it ended)."""
    out: list = []
    bars: dict = {}  # (rank, key, call) -> index in out
    metrics: dict = {}  # (rank, call) -> index in out
    for item in items:
        event = item.event if isinstance(item, Message) else None
        if isinstance(event, Progress):
            at = bars.get((item.rank, event.key, event.call))
            if at is not None:
                out[at] = item
                continue
            bars[(item.rank, event.key, event.call)] = len(out)
        elif isinstance(event, Metrics):
            at = metrics.get((item.rank, event.call))
            if at is not None:
                merged = out[at].event
                out[at] = Message(item.rank, Metrics(item.rank, merged.points + event.points, event.call))
                continue
            metrics[(item.rank, event.call)] = len(out)
        elif not routine(item):  # a rank's other event: its earlier bars and metrics stay before it
            for table in (bars, metrics):
                for k in [k for k in table if k[0] == item.rank]:
                    del table[k]
        out.append(item)
    return out


class PoolPipes:
    """Two selectors over ranks' pipes (``procs``: a pool's per-rank records,
    with ``events`` (an ``EventReader``), ``output`` (a ``RankOutput``),
    ``proc.sentinel`` and ``exited``): ``all`` (events, output, exits and
    the poll's ``also``) and ``urgent`` (exits and ``also``: what ends a
    hold). ``read_events(p, out)`` and ``read_exit(p, out)`` read a rank's;
    a pipe leaves both selectors once it ended (it would be ready forever).
    ``open_only``: leave out pipes already ended (a start that did not finish)."""

    def __init__(self, procs: list, read_events: Callable, read_exit: Callable, open_only: bool = False):
        self.all, self.urgent = selectors.DefaultSelector(), selectors.DefaultSelector()
        self._also: set = set()
        self._returned_at = 0.0  # when a poll last returned something
        for p in procs:
            if not open_only or p.events.open:
                self.all.register(p.events.fileno, selectors.EVENT_READ, (p, read_events))
            if not open_only or p.output.open:
                self.all.register(p.output.conn.fileno(), selectors.EVENT_READ, (p, _read_output))
            self.all.register(p.proc.sentinel, selectors.EVENT_READ, (p, read_exit))
            self.urgent.register(p.proc.sentinel, selectors.EVENT_READ)

    def poll(self, timeout: float, also: tuple = ()) -> list[PoolEvent]:
        """What happened within ``timeout`` (``also``: more handles whose readiness ends the wait)."""
        self._watch_also(also)
        out: list[PoolEvent] = []
        self._read(self.all.select(timeout), out)
        if out and all(routine(item) for item in out):
            hold = self._returned_at + BATCH_S - time.monotonic()
            if hold > 0:  # a routine batch came a moment ago: wait for an exit or ``also``, then take the rest
                self.urgent.select(hold)
                self._read(self.all.select(0), out)
        if out:
            self._returned_at = time.monotonic()
        return out

    def _read(self, ready: list, out: list) -> None:
        # The stop button's KeyboardInterrupt waits until what was read is
        # kept: one landing between a read and its use would lose part of a
        # rank's stream (seen on live ranks: a rank's report lost).
        with InterruptsDeferred():
            for key, _ in ready:
                if key.data is None:  # one of ``also``
                    continue
                p, read = key.data
                if not p.exited:
                    read(p, out)
                if p.exited or not p.events.open or not p.output.open or getattr(p, "ending_since", None) is not None:
                    self._forget(p)

    def _watch_also(self, also: tuple) -> None:
        if set(also) == self._also:
            return
        for handle in set(also) - self._also:
            self.all.register(handle, selectors.EVENT_READ, None)
            self.urgent.register(handle, selectors.EVENT_READ)
        for handle in self._also - set(also):
            self.all.unregister(handle)
            self.urgent.unregister(handle)
        self._also = set(also)

    def _forget(self, p) -> None:
        ending = p.exited or getattr(p, "ending_since", None) is not None  # its process ended
        for fd, gone in ((p.events.fileno, not p.events.open or p.exited),
                         (p.output.conn.fileno(), not p.output.open or p.exited), (p.proc.sentinel, ending)):
            for selector in (self.all, self.urgent):
                if gone and fd in selector.get_map():
                    selector.unregister(fd)

    def close(self) -> None:
        self.all.close()
        self.urgent.close()


def _read_output(p, out: list) -> None:
    p.output.read(out)
