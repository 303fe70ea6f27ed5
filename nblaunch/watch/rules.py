"""Rules on times that the call watch asks each tick, apart from it so that
no process is needed to test them: ranks whose progress stands still while
others move (:class:`Stalls`), and ranks that returned while their peers
wait for them in a collective (:class:`LeftEarly`)."""
from __future__ import annotations

import time
from typing import Callable, Optional

from ..errors import RankFailure, left_early

__all__ = ["Stalls", "LeftEarly"]

# Some ranks returned while others run on: after this long (then at growing
# intervals) the others' stacks are read, and if every one of them waits in
# a collective, the first rank that left is the failure (it never joins).
LEFT_GRACE_S = 3.0
LEFT_RECHECK_MAX_S = 30.0


class Stalls:
    """Which ranks' progress stands still while others move: a rule on
    times, fed by progress reports; no process needed to test it."""

    def __init__(self, after_s: Optional[float]):
        self.after_s = after_s
        self._last: dict[int, tuple[float, str]] = {}  # rank -> (when it last moved, where)
        self._bars: dict[tuple[int, str], tuple] = {}
        self._warned: set[int] = set()
        self._states: dict[int, tuple[str, float]] = {}  # rank -> (its process's state in words, seen since)

    def sampled(self, usage: dict, now: float) -> None:
        """What each rank's process was sampled doing at ``now`` (rank -> ``resources.Usage``;
        its ``state``: "" when running or waiting as processes do, else ``resources.STATES``)."""
        for rank, use in usage.items():
            if not use.state:
                self._states.pop(rank, None)
            elif self._states.get(rank, ("",))[0] != use.state:
                self._states[rank] = (use.state, now)

    def moved(self, rank: int, key: str, n: float, total: Optional[float], desc: str, now: float) -> None:
        if self._bars.get((rank, key)) != (n, total):
            self._bars[(rank, key)] = (n, total)
            step = f"{n:g}/{total:g}" if total else f"{n:g}"
            self._last[rank] = (now, f"{desc + ' ' if desc else ''}{step}")

    def check(self, now: float, running: set[int], label: Callable[[int], int] = lambda r: r) -> list[str]:
        """Notices for ranks that just stalled (once each, until they move again)."""
        if not self.after_s:
            return []
        moving = [r for r, (t, _) in sorted(self._last.items()) if now - t < self.after_s]
        notices = []
        for rank, (t, where) in sorted(self._last.items()):
            if now - t >= self.after_s and rank in running:
                if moving and rank not in self._warned:
                    self._warned.add(rank)
                    state, since = self._states.get(rank, ("", t))
                    what = f"is {state} for {now - since:.0f} s" if state else f"has made no progress for {now - t:.0f} s"
                    notices.append(f"rank {label(rank)} {what} (last at {where}) "
                                   f"while ranks {', '.join(str(label(r)) for r in moving)} moved on")
            else:
                self._warned.discard(rank)
        return notices


class LeftEarly:
    """Ranks that returned while their peers still wait for them in a
    collective: with gloo a peer's exit ends the wait in an error (see
    ``errors.blame_departures``), but a rank that stays up (a live rank
    between calls, one waiting for its result to be fetched) or NCCL
    leaves them waiting until the timeout. Their stacks tell."""

    def __init__(self):
        self._next: Optional[tuple[float, float]] = None  # (next stack read, interval)

    def check(self, now: float, pool, gone: list, waiting: list[int]) -> Optional[tuple[int, RankFailure]]:
        """``gone``: ``(rank, departure)`` of ranks that returned; ``waiting``:
        ranks still in the call. Returns ``(rank, failure)`` of the first that
        left, once every waiting rank sits in a collective."""
        if not gone or not waiting:
            self._next = None
            return None
        if self._next is None:
            self._next = (now + LEFT_GRACE_S, LEFT_GRACE_S)
        due, interval = self._next
        if now < due or not all(pool.started(r) for r in waiting):
            return None
        where = pool.collectives(waiting)
        self._next = (time.monotonic() + interval, min(2 * interval, LEFT_RECHECK_MAX_S))
        labels = {r: pool.global_rank(r) for r in waiting}
        if not all(where.get(labels[r]) for r in waiting):
            return None
        first, departure = min(gone, key=lambda g: g[1].time)
        return first, left_early(departure, {f"rank {labels[r]}": where[labels[r]] for r in waiting})
