"""Stalls: which ranks' progress stands still while others move. A rule on
times, fed by progress reports, that the call watch asks each tick; no
process is needed to test it."""
from __future__ import annotations

from typing import Callable, Optional

__all__ = ["Stalls"]


class Stalls:
    """Which ranks' progress stands still while others move: a rule on
    times, fed by progress reports; no process needed to test it."""

    def __init__(self, after_s: Optional[float]):
        self.after_s = after_s
        self._last: dict[int, tuple[float, str]] = {}  # rank -> (when it last moved, where)
        self._bars: dict[tuple[int, str], tuple] = {}
        self._warned: set[int] = set()

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
                    notices.append(f"rank {label(rank)} has made no progress for {now - t:.0f} s (last at {where}) "
                                   f"while ranks {', '.join(str(label(r)) for r in moving)} moved on")
            else:
                self._warned.discard(rank)
        return notices
