"""What runs in this kernel, in one place.

- **Launches in flight** (:func:`enter`, :func:`leave`, :func:`in_flight`):
  for the one rule that needs to know of the others, a launch forks its
  ranks only when it is alone (:func:`nblaunch.engines.plan.choose_start_method`).
  Each is counted by its owner (an engine, a background run), and ``leave``
  takes that owner out whether or not it is still in: a caller wraps both
  ``enter`` and what follows in one ``try`` and always leaves in its
  cleanup, so an interrupt just after ``enter`` returned leaks nothing.
- **The foreground slot** (:data:`foreground`): one launch or call on live
  ranks at a time from the cells; a second is refused at once
  (:func:`nblaunch.session.one_at_a_time`).
- **Background runs** (:func:`runs`, :func:`add_run`, :func:`drop_run`), by
  id in the order submitted, and the slot a submit holds while it checks
  that the GPUs it asks for are free (:data:`submitting`).
- **The live ranks** (:func:`live_ranks`, :func:`set_live_ranks`): the
  kernel's one set, held weakly (ranks nobody holds close themselves).

Imports nothing of nblaunch's: every room may ask it.
"""
from __future__ import annotations

import threading
import weakref
from typing import Any, Callable, Optional

__all__ = ["enter", "leave", "in_flight", "foreground", "submitting", "runs", "add_run", "drop_run",
           "live_ranks", "set_live_ranks"]

_lock = threading.RLock()
_owners: set = set()
_runs: dict = {}
_live: Optional[weakref.ref] = None
#: Held by a launch or a call on live ranks from its start to its end.
foreground = threading.Lock()
#: Held by ``submit`` while it checks a run's GPUs against the others' and starts it.
submitting = threading.Lock()


def enter(owner: Any, decide: Callable[[int], Any]) -> Any:
    """Count ``owner`` in flight and call ``decide(others)`` (how many were
    in flight before it) under the same lock: two launches starting at once
    cannot both find themselves alone. Returns what ``decide`` returns;
    counts nothing if it raises."""
    with _lock:
        made = decide(len(_owners - {owner}))
        _owners.add(owner)
        return made


def leave(owner: Any) -> None:
    """``owner`` is no longer in flight (nothing if it was not)."""
    with _lock:
        _owners.discard(owner)


def in_flight() -> int:
    with _lock:
        return len(_owners)


def runs() -> list:
    """This kernel's background runs, oldest first."""
    with _lock:
        return list(_runs.values())


def add_run(run: Any) -> None:
    with _lock:
        _runs[run.id] = run


def drop_run(run_id: str) -> None:
    with _lock:
        _runs.pop(run_id, None)


def live_ranks() -> Optional[Any]:
    """This kernel's live ranks, if any are held."""
    with _lock:
        return _live() if _live is not None else None


def set_live_ranks(ranks: Optional[Any]) -> None:
    global _live
    with _lock:
        _live = weakref.ref(ranks) if ranks is not None else None
