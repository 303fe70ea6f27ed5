"""How a live rank's call is interrupted: the kernel's SIGINT, for the call
it names (:class:`CallInterrupt`), now or at a loop step every rank agrees on
(:class:`StepAgreement`); and :func:`group_seq`, which tells whether the ranks
are still in step after a call.
"""
from __future__ import annotations

import functools
import sys
from typing import Optional

from .progress import stop_at_a_step
from . import setup as rank_setup

__all__ = ["CallInterrupt", "StepAgreement", "group_seq"]


class CallInterrupt:
    """A live rank's SIGINT handler. A signal carries no data, so which call
    it is for is in a file the kernel writes first: only the call this rank
    is on can be interrupted; a late signal for an ended call is ignored.
    ``restart_count``: the rank's generation, which keys its step agreements."""

    def __init__(self, path: str, restart_count: int):
        self._path = path
        self._restart_count = restart_count
        self._call: Optional[int] = None
        self.running = False  # the call's function is running: raise there
        self.pending = False  # asked while the call was loading

    def begin(self, call: int) -> None:
        """The rank starts call ``call``: only a SIGINT for it counts from now on."""
        self._call, self.pending, self.running = call, False, False

    def end(self) -> None:
        """The call has ended: a SIGINT is ignored until the next :meth:`begin`."""
        self._call, self.pending, self.running = None, False, False

    def asked(self) -> Optional[str]:
        """How the kernel asked this call to stop: ``"now"``, ``"at a step"``
        (the stop button: see :func:`nblaunch.rank.progress.stop_at_a_step`), or
        None when it asked for another call (or not at all)."""
        if self._call is None or not self._path:
            return None
        try:
            with open(self._path) as f:
                call, _, how = f.read().strip().partition(" ")
        except OSError:
            return None
        return (how or "now") if call == str(self._call) else None

    def handler(self, signum, frame) -> None:
        """The SIGINT handler: ``KeyboardInterrupt`` in a running call (now or at an agreed
        step), :attr:`pending` while it loads, nothing for another call."""
        how = self.asked()
        if how is None:
            return
        if self.running:
            if how == "at a step" and StepAgreement.possible() and stop_at_a_step(
                    functools.partial(StepAgreement.for_call, self._call, self._restart_count)):
                return  # the KeyboardInterrupt comes at the agreed step
            raise KeyboardInterrupt
        self.pending = True


class StepAgreement:
    """How the ranks of one live call agree on the loop step at which they
    all stop, through the ranks' store (the kernel's; no collective, which
    could pair with the user's own). Each rank, from the moment its SIGINT
    is handled, offers its step count at every step. Once every rank has
    offered, the first rank to see it fixes the stop step at one past the
    highest count offered (first writer wins, ``compare_set``). A rank
    offers before it reads, and its count only grows at a step, so no rank
    is past the step when it learns it; ranks in lockstep (DDP) reach it
    together. No anchor does this: torchrun, accelerate and ipyparallel
    interrupt wherever each rank happens to be."""

    _made: dict = {}  # call -> its agreement, made at this rank's first step after the signal

    def __init__(self, store, key: str, rank: int, world_size: int):
        self._store, self._key, self._rank, self._world = store, key, rank, world_size

    @staticmethod
    def possible() -> bool:
        """Only with a process group: without one there are no peers to stay in step with."""
        torch = sys.modules.get("torch")
        return torch is not None and torch.distributed.is_initialized()

    @classmethod
    def for_call(cls, call: int, restart_count: int) -> "StepAgreement":
        """This rank's agreement for live call ``call`` of generation ``restart_count`` (made on first use)."""
        if call not in cls._made:
            import torch.distributed as dist

            cls._made = {call: cls(rank_setup.ranks_store(), f"nblaunch/stop/{restart_count}/{call}",
                                   dist.get_rank(), dist.get_world_size())}
        return cls._made[call]

    def offer(self, steps: int) -> Optional[int]:
        """Record this rank's count; the agreed stop step once there is one."""
        store, key = self._store, self._key
        store.set(f"{key}/{self._rank}", str(steps))
        if store.check([f"{key}/at"]):
            return int(store.get(f"{key}/at"))
        offered = [f"{key}/{rank}" for rank in range(self._world)]
        if not store.check(offered):
            return None
        highest = max(int(store.get(k)) for k in offered)
        return int(store.compare_set(f"{key}/at", "", str(highest + 1)))


def group_seq() -> int:
    """How many collectives this rank has issued on the default process group
    (-1: no group, or torch cannot say). After a call that did not end well
    everywhere, ranks that disagree are out of step: their next collective
    would pair with the wrong peer operation."""
    try:
        import torch.distributed as dist

        if not dist.is_initialized():
            return -1
        return int(dist.distributed_c10d._get_default_group()._get_sequence_number_for_group())
    except Exception:
        return -1
