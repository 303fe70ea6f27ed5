"""Nodes coming back (``min_nodes``, ``max_nodes``): which of the nodes a run
left out (lost, or never used) are usable again, and for long enough to be
taken back.

:class:`Steady` is the rule, on times alone (tested without a process): a
node is back once every probe since its first good one answered, for
``after`` seconds; one bad probe starts it over, so a node that flaps is
never taken. :class:`Comebacks` runs the probes, in a thread of its own (a
probe may take seconds: an ``srun`` to a node whose daemon is down), and
says which nodes are back; the engine decides what a probe is (SLURM: a
step of ``true`` on the node, inside the allocation) and which nodes are
candidates (those of the allocation the run does not use now).

The engine then ends the generation as torch elastic's agent does when
``num_nodes_waiting() > 0``: the ranks get the preemption notice, and the
next generation runs on the larger set of nodes (``watch/resize.py``).
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Optional

__all__ = ["Steady", "Comebacks", "PROBE_EVERY_S"]

PROBE_EVERY_S = 2.0  # how often a candidate is probed (less often while it keeps failing)
FAILING_EVERY_S = 5.0  # a node down for an hour is probed every few seconds, not every two


class Steady:
    """Each node's probes, and since when it has answered every one."""

    def __init__(self, after: float):
        self.after = after
        self._since: dict[str, float] = {}  # node -> its first good probe of the current good run
        self._bad: dict[str, float] = {}  # node -> its last bad probe

    def seen(self, node: str, usable: bool, now: float) -> None:
        if usable:
            self._since.setdefault(node, now)
            self._bad.pop(node, None)
        else:
            self._since.pop(node, None)
            self._bad[node] = now

    def forget(self, nodes) -> None:
        for node in nodes:
            self._since.pop(node, None)
            self._bad.pop(node, None)

    def keep(self, candidates) -> None:
        """Forget every node but ``candidates``: a node taken back and lost again starts over
        (its old good run, or a probe that answered as it was taken, would take it at once)."""
        self.forget([n for n in list(self._since) + list(self._bad) if n not in candidates])

    def back(self, now: float) -> list[str]:
        """Nodes usable at every probe for ``after`` seconds, longest first."""
        ready = [(t, n) for n, t in self._since.items() if now - t >= self.after]
        return [n for _, n in sorted(ready)]

    def due(self, node: str, last: Optional[float], now: float) -> bool:
        """Whether ``node`` (last probed at ``last``) is to be probed now."""
        every = FAILING_EVERY_S if node in self._bad else min(PROBE_EVERY_S, max(0.2, self.after / 4))
        return last is None or now - last >= every


class Comebacks:
    """Probes ``candidates()`` with ``usable(node)`` in a thread until
    :meth:`close`; :meth:`back` says which are back (:class:`Steady`)."""

    def __init__(self, candidates: Callable[[], list], usable: Callable[[str], bool], after: float):
        self._candidates, self._usable = candidates, usable
        self._steady = Steady(after)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="nblaunch-comebacks", daemon=True)
        self._thread.start()

    def back(self) -> list[str]:
        with self._lock:
            candidates = set(self._candidates())
            return [n for n in self._steady.back(time.monotonic()) if n in candidates]

    def taken(self, nodes) -> None:
        """``nodes`` are in the run again: should they leave it, they are watched from scratch."""
        with self._lock:
            self._steady.forget(nodes)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=30)

    def _run(self) -> None:
        last: dict[str, float] = {}
        while not self._stop.wait(0.2):
            with self._lock:
                candidates = list(self._candidates())
                self._steady.keep(candidates)
            for node in candidates:
                now = time.monotonic()
                with self._lock:
                    due = self._steady.due(node, last.get(node), now)
                if not due or self._stop.is_set():
                    continue
                try:
                    ok = bool(self._usable(node))
                except Exception:  # noqa: BLE001 - a probe that cannot run says the node is not usable
                    ok = False
                last[node] = time.monotonic()
                with self._lock:
                    if node in self._candidates():  # not taken back while it was probed
                        self._steady.seen(node, ok, now)
