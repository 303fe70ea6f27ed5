"""The launches in flight in this process, for the one rule that needs to
know of the others: a launch forks its ranks only when it is alone
(:func:`nblaunch.engines.plan.choose_start_method`)."""
from __future__ import annotations

import threading

__all__ = ["enter", "leave", "count"]

_lock = threading.Lock()
_count = 0


def enter(decide):
    """Count a launch in and call ``decide(others)`` (how many were in flight
    before it) under the same lock: two launches starting at once cannot
    both find themselves alone. Returns what ``decide`` returns; counts
    nothing if it raises."""
    global _count
    with _lock:
        made = decide(_count)
        _count += 1
        return made


def leave() -> None:
    global _count
    with _lock:
        _count = max(0, _count - 1)


def count() -> int:
    with _lock:
        return _count
