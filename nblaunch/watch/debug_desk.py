"""The kernel's side of the ranks' debuggers, for one call.

A rank's ``breakpoint()`` reaches the call watch as ``Prompt`` events
(:mod:`nblaunch.rank.debugger`); the :class:`DebugDesk` asks the user with
``input()`` (Jupyter's stdin channel in a kernel, the terminal in a script)
and sends the line back. One rank is served at a time, every prompt saying
which; a rank that was answered and prompts again soon (``n``, ``s``, ``p``)
keeps the desk, and another rank waiting is served once the first runs on
(``c``) or has not prompted again within :data:`SWITCH_S` (it stepped into a
collective that needs the waiting rank: the desk must not wait for it).

While any rank is paused the call's timers stand still (:meth:`held`):
the watch subtracts that time from its timeout and its stall clock.
"""
from __future__ import annotations

import sys
import threading
import time
from typing import Callable, Optional

from ..view.base import in_kernel
from ..wire.channel import Answer, Paused, Prompt

__all__ = ["DebugDesk", "SWITCH_S", "can_answer"]

SWITCH_S = 0.5


def can_answer() -> Optional[Callable[[str], str]]:
    """How the user answers a prompt here: ``input`` in a kernel (whose
    stdin channel may still say no, per request) or at a terminal; None for
    a script whose stdin is not a terminal, where ``input()`` could wait
    forever on a pipe no one writes to; None off the main thread too (a
    background run's watch: no cell waits on it to type in)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    if in_kernel():
        kernel = getattr(sys.modules["IPython"].get_ipython(), "kernel", None)
        # ipykernel's record of the running request's allow_stdin (nbclient,
        # papermill and nbval send False); input() would raise anyway, but
        # only after the prompt's text was printed for no one.
        return None if getattr(kernel, "_allow_stdin", True) is False else input
    stdin = sys.stdin
    try:
        return input if stdin is not None and stdin.isatty() else None
    except (AttributeError, ValueError):
        return None


class DebugDesk:
    """Prompts from the ranks of one call on ``pool``, answered one rank at
    a time; the rows of ``view`` say which ranks are paused and which wait
    (``in_call``: the ranks still in the call)."""

    def __init__(self, pool, view, in_call: Callable[[], list]):
        self._pool, self._view, self._in_call = pool, view, in_call
        self._prompts: dict[int, Prompt] = {}  # in the order they came
        self.paused: dict[int, str] = {}  # rank -> where it stopped
        self._current: Optional[int] = None
        self._answered_at = 0.0
        self._held = 0.0  # seconds with a rank paused, of pauses that ended
        self._since: Optional[float] = None  # a pause under way began then
        self._ask = can_answer()
        self._said_no_front_end = False

    # -- what the ranks sent ------------------------------------------------------------

    def on_event(self, rank: int, event) -> None:
        if isinstance(event, Prompt):
            self._prompts[rank] = event
        elif isinstance(event, Paused):
            if event.paused:
                self._pause(rank, event.where)
            else:
                if event.text.strip():
                    print(f"{self._label(rank)}: {event.text.strip()}", flush=True)
                self._resume(rank)

    def gone(self, rank: int) -> None:
        """The rank ended or failed: it will not prompt again."""
        self._prompts.pop(rank, None)
        self._resume(rank)

    def _pause(self, rank: int, where: str) -> None:
        if not self.paused:
            self._since = time.monotonic()
        self.paused[rank] = where
        self._rows()

    def _resume(self, rank: int) -> None:
        if self.paused.pop(rank, None) is None:
            return
        if not self.paused and self._since is not None:
            self._held += time.monotonic() - self._since
            self._since = None
        if self._current == rank:
            self._current = None
        self._rows()

    def held(self) -> float:
        """Seconds so far with at least one rank paused in its debugger."""
        ongoing = time.monotonic() - self._since if self._since is not None else 0.0
        return self._held + ongoing

    def _label(self, rank: int) -> str:
        host = self._pool.host(rank)
        return f"rank {self._pool.global_rank(rank)}" + (f" on {host}" if host else "")

    def _rows(self) -> None:
        first = next(iter(self.paused), None)
        for r in self._in_call():
            if r in self.paused:
                self._view.rank_status(r, "paused: in the debugger")
            elif first is not None:
                self._view.rank_status(r, f"waiting: {self._label(first)} is in the debugger")
            else:
                self._view.rank_status(r, "running")

    # -- answering ------------------------------------------------------------------------

    def serve(self) -> None:
        """Answer the next prompt, if one is due (blocks while the user types)."""
        rank = self._next()
        if rank is None:
            return
        prompt = self._prompts.pop(rank)
        line = self._answer(rank, prompt)
        self._pool.send(rank, Answer(line))
        self._current, self._answered_at = rank, time.monotonic()

    def _next(self) -> Optional[int]:
        if not self._prompts:
            return None
        if self._current in self._prompts:
            return self._current
        if self._current is not None and time.monotonic() - self._answered_at < SWITCH_S:
            return None  # it may prompt again at once (n, s): keep its session whole
        return next(iter(self._prompts))

    def _answer(self, rank: int, prompt: Prompt) -> Optional[str]:
        if self._ask is None:
            why = ("a background run has no cell to ask in (nblaunch.debug() opens a failed rank's frames)"
                   if threading.current_thread() is not threading.main_thread()
                   else "this front end sends no input" if in_kernel() else "this process has no terminal to ask at")
            return self._no_front_end(rank, why)
        label = self._label(rank)
        self._view.tick(force=True)  # what the ranks printed before this stop comes first
        if rank != self._current:
            waiting = [self._label(r) for r in self._prompts if r != rank]
            also = f"; {', '.join(waiting)} will be next" if waiting else ""
            print(f"--- {label} is in the debugger (the other ranks wait){also} ---", flush=True)
        if prompt.text:
            print(prompt.text, end="" if prompt.text.endswith("\n") else "\n", flush=True)
        try:
            return self._ask(f"{label} {prompt.prompt}")
        except EOFError:
            return "c"  # Ctrl-D at a terminal: as in pdb, carry on
        except (NotImplementedError, OSError, RuntimeError) as exc:  # StdinNotImplementedError: no stdin here
            return self._no_front_end(rank, f"{type(exc).__name__}: {exc}".rstrip(": "))

    def _no_front_end(self, rank: int, why: str) -> None:
        if not self._said_no_front_end:
            self._said_no_front_end = True
            self._view.notice(f"{self._label(rank)} reached a breakpoint, but no one can answer a debugger here ({why}); "
                         "it went on, and breakpoints stay off for the rest of this call. Run the cell from "
                         "JupyterLab, Notebook or a terminal to debug a rank.")
        return None
