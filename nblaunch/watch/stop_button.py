"""The stop button during a call: a press Python lost is raised again.

Python runs a signal's handler between two bytecodes of the main thread,
also within a weakref callback or a ``__del__`` that the garbage collector
runs there; a ``KeyboardInterrupt`` raised in one of those cannot reach the
code it interrupted, so Python only reports it (``sys.unraisablehook``,
"Exception ignored in ...") and goes on. The stop button was lost and the
launch ran on: seen twice in about 780 stops pressed early in a launch on a
busy machine, in ``WeakSet._remove`` (a launch makes and drops threads and
pipes).

Within a :class:`StopButton`, the handler that raises the interrupt also
notes it; the call watch's loop calls :meth:`StopButton.check` on every
pass, which raises the press that never reached it. Python's report of the
lost one is not shown: the cell gets the interrupt itself.
"""
from __future__ import annotations

import signal
import sys
import threading
from typing import Callable, Optional

__all__ = ["StopButton"]


class StopButton:
    """A context manager for the cell's thread (elsewhere it does nothing:
    only the main thread runs signal handlers)."""

    def __init__(self):
        self._previous: Optional[Callable] = None
        self._pressed = False
        self._report: Optional[Callable] = None  # sys.unraisablehook as it was

    def __enter__(self) -> "StopButton":
        if threading.current_thread() is threading.main_thread():
            previous = signal.getsignal(signal.SIGINT)
            if callable(previous):  # ipykernel's default_int_handler while a cell runs
                self._previous = previous
                signal.signal(signal.SIGINT, self._press)
                self._report, sys.unraisablehook = sys.unraisablehook, self._unraisable
        return self

    def _press(self, signum, frame) -> None:
        try:
            self._previous(signum, frame)
        except KeyboardInterrupt:  # a handler that only notes the signal raises nothing, and is left so
            self._pressed = True
            raise

    def _unraisable(self, unraisable) -> None:
        if not (unraisable.exc_type is KeyboardInterrupt and self._pressed):
            self._report(unraisable)

    def check(self) -> None:
        """Raise ``KeyboardInterrupt`` for a press whose own was lost
        (called where one raised would be taken: the watch's loop)."""
        if self._pressed:
            self._pressed = False
            raise KeyboardInterrupt

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None
            if sys.unraisablehook == self._unraisable:  # else another set its own since: it stays
                sys.unraisablehook = self._report
