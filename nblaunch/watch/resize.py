"""Growing back (``min_nodes``): a generation ended because nodes came back.

As torch elastic's agent restarts its workers into a larger world when
``num_nodes_waiting() > 0``, a launch whose engine says nodes are back
(``engine.nodes_back()``, asked each tick) ends its generation: the ranks
get the preemption notice they already honour (``nblaunch.preempted()``
turns true, ``nblaunch.preempt_reason()`` starts with ``resize``), have the
launch's ``preempt_grace`` to save and return, and are stopped if they have
not by then. What they returned is dropped: the session grows the engine
onto the nodes back and calls ``fn`` again on the next generation
(:class:`Resized`), which never counts against ``max_restarts``.
"""
from __future__ import annotations

from typing import Callable, Optional

__all__ = ["Resize", "Resized", "reason"]


class Resized(Exception):
    """A generation ended by a resize: ``nodes`` are back (raised by the watch, caught by the session)."""

    def __init__(self, nodes: list):
        super().__init__(f"resized: {', '.join(nodes)} back")
        self.nodes = list(nodes)


def reason(nodes: list) -> str:
    """The notice's reason, as the ranks read it."""
    return f"resize: {_names(nodes)} {'is' if len(nodes) == 1 else 'are'} back"


class Resize:
    """The call watch's side of a resize: asks ``back()`` each tick until
    nodes are back, then tells the ranks once and gives them ``grace``
    seconds. :meth:`check` says, once, when the grace is over with ranks
    still in the call (the watch then stops them)."""

    def __init__(self, back: Optional[Callable[[], list]], grace: float,
                 label: Optional[Callable[[str], str]] = None):
        self._back = back  # None: this launch cannot grow
        self._label = label or str  # a node as notices name it ("n4 (in place of n3)")
        self.grace = grace
        self.nodes: list = []
        self.until: Optional[float] = None
        self.expired = False

    @property
    def started(self) -> bool:
        return self.until is not None

    def check(self, now: float, pool, view, in_call: list, busy: bool) -> bool:
        """``busy``: another notice (a preemption) is out: no resize then."""
        if self._back is None or self.expired or (not self.started and (busy or not in_call)):
            return False
        if not self.started:
            self.nodes = list(self._back())
            if not self.nodes:
                return False
            self.until = now + self.grace
            named = [self._label(n) for n in self.nodes]
            pool.preempt(reason(named))
            view.notice(f"{_names(named)} {'is' if len(self.nodes) == 1 else 'are'} back: resizing; the ranks "
                        f"have {self.grace:g} s to save and return (nblaunch.preempted() is true on every rank), "
                        "then fn is called again on the larger set of nodes")
            for r in in_call:
                view.rank_status(r, "resizing: saving")
            return False
        if now >= self.until and in_call:
            self.expired = True
            view.notice(f"the {self.grace:g} s grace of the resize is over; stopping the ranks (the run goes on)")
            return True
        return False


def _names(nodes: list) -> str:
    return ", ".join(nodes[:-1]) + (" and " if len(nodes) > 1 else "") + nodes[-1]
