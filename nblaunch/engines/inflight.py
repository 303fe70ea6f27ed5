"""The launches in flight in this process, for the one rule that needs to
know of the others: a launch forks its ranks only when it is alone
(:func:`nblaunch.engines.plan.choose_start_method`).

Each is counted by its owner (an engine, a background run), and ``leave``
takes that owner out whether or not it is still in: a caller wraps both
``enter`` and what follows in one ``try`` and always leaves in its cleanup.
An interrupt just after ``enter`` returned then leaks nothing (a plain count,
left uncounted there, made every later launch of the kernel a "shared" one,
never forked)."""
from __future__ import annotations

import threading

__all__ = ["enter", "leave", "count"]

_lock = threading.Lock()
_owners: set = set()


def enter(owner, decide):
    """Count ``owner`` in and call ``decide(others)`` (how many were in
    flight before it) under the same lock: two launches starting at once
    cannot both find themselves alone. Returns what ``decide`` returns;
    counts nothing if it raises."""
    with _lock:
        made = decide(len(_owners - {owner}))
        _owners.add(owner)
        return made


def leave(owner) -> None:
    """``owner`` is no longer in flight (nothing if it was not)."""
    with _lock:
        _owners.discard(owner)


def count() -> int:
    with _lock:
        return len(_owners)
