"""Nodes joined by the c10d rendezvous growing back (``min_nodes``): a launcher
started again with the same ``rdzv_endpoint`` and ``rdzv_id`` joins a run that
went on without a lost node, and the run grows into it, as torchrun's agents
restart into a larger world when ``num_nodes_waiting() > 0``.

After a loss the nodes still up meet in fresh rounds (run id
``<rdzv_id>.<attempt>``, :mod:`.lost_nodes`), which a launcher started later
cannot guess. :class:`Gate` keeps, on the endpoint's store, the attempt the run
is at (``current``) and, for each attempt's round, who knocked to be in it:

* a late launcher reads ``current`` (none: the run never shrank, it is one
  of the first), knocks at the next attempt's gate and waits in that round;
* the nodes running watch the next gate: once someone has knocked for
  ``node_back_after``, one of them publishes the resize (the first publication
  wins: every node reads the same names) and each tells its ranks (the
  preemption notice, reason ``resize``); their next round is the larger one;
* a node going into a round seals its gate first, and counts those who
  knocked before the seal in the round's size. A launcher that finds the
  gate sealed knocks at the next one: no one waits in a round already formed.

Each gate's value is a compare-and-set string (``"a,b"``, then ``"sealed:a,b"``),
so two launchers knocking at once, or a knock and a seal, never lose one.
"""
from __future__ import annotations

from typing import Optional

__all__ = ["Gate"]

SEALED = "sealed:"


class Gate:
    """The gates of the run ``run_id`` on ``store`` (a client of the endpoint's store)."""

    def __init__(self, store, run_id: str):
        self._store, self._prefix = store, f"nblaunch/{run_id}/grow"

    def current(self) -> Optional[int]:
        """The attempt the nodes still up are at; None before any loss."""
        value = self._get("current")
        return int(value) if value else None

    def set_current(self, attempt: int) -> None:
        self._store.set(f"{self._prefix}/current", str(attempt))

    def knock(self, attempt: int, me: str) -> bool:
        """``me`` waits to be in ``attempt``'s round; False: that gate is sealed (too late for it)."""
        key = f"{self._prefix}/gate/{attempt}"
        while True:
            now = self._get(f"gate/{attempt}")
            if now.startswith(SEALED):
                return False
            wanted = f"{now},{me}" if now else me
            if self._cas(key, now, wanted) == wanted:
                return True

    def seal(self, attempt: int) -> list[str]:
        """Close ``attempt``'s gate (every node going into its round does; the first one seals):
        who knocked before, in the order they came."""
        key = f"{self._prefix}/gate/{attempt}"
        while True:
            now = self._get(f"gate/{attempt}")
            if now.startswith(SEALED) or self._cas(key, now, SEALED + now) == SEALED + now:
                return _names(self._get(f"gate/{attempt}")[len(SEALED):])

    def knocking(self, attempt: int) -> list[str]:
        """Who waits at ``attempt``'s gate, still open."""
        now = self._get(f"gate/{attempt}")
        return [] if now.startswith(SEALED) else _names(now)

    def resize(self, attempt: int, names: Optional[list] = None) -> list[str]:
        """The resize of ``attempt`` (the nodes it grows onto), published with ``names``
        when given and none was; [] while none was."""
        if names:
            return _names(self._cas(f"{self._prefix}/resize/{attempt}", "", ",".join(names)))
        return _names(self._get(f"resize/{attempt}"))

    def _get(self, what: str) -> str:
        key = f"{self._prefix}/{what}"
        return self._store.get(key).decode() if self._store.check([key]) else ""

    def _cas(self, key: str, expected: str, desired: str) -> str:
        value = self._store.compare_set(key, expected, desired)
        return value.decode() if isinstance(value, bytes) else str(value)


def _names(value: str) -> list[str]:
    return [n for n in value.split(",") if n]
