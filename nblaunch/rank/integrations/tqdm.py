"""tqdm in a rank: console bars become the rank's rows; notebook bars,
picked in the kernel by ``tqdm.auto``, behave as console bars."""
from __future__ import annotations

import sys
import time
import weakref
from typing import Optional

from .. import progress  # the module: its reporter() is asked at each call

__all__ = ["mirror", "detach_notebook"]


class _TqdmRow:
    """A tqdm bar as the reporter sees it (a ``progress.Row``). Weak: a bar
    the code drops without closing still ends (tqdm closes it when collected)."""

    def __init__(self, bar):
        self._bar = weakref.ref(bar)
        self.final: Optional[tuple] = None  # taken at close: the bar may be gone before the next send

    def state(self) -> Optional[tuple]:
        bar = self._bar()
        if self.final is not None or bar is None:
            return self.final
        return self.read(bar)

    @staticmethod
    def read(bar, when: Optional[float] = None) -> tuple:
        # tqdm syncs n from its iterator only when it would redraw, and
        # notes when: last_print_t, on the same clock as time.time().
        return (str(bar.desc or ""), bar.n, bar.total, bool(bar.disable), str(bar.postfix or ""),
                when or getattr(bar, "last_print_t", None))


def mirror(tqdm_cls) -> None:
    """Make every console bar of ``tqdm_cls`` (``tqdm.std.tqdm``, so every
    subclass too) a row of this rank. Only bars that draw on the rank's
    stdout/stderr are mirrored; a bar written to a file of the user's is
    left alone. tqdm's per-item path is not touched: it sets ``n`` when it
    would redraw (at most every ``mininterval``), and the reporter reads it."""
    if tqdm_cls.__dict__.get("_nblaunch_mirrored"):
        return
    init, display, clear, close = tqdm_cls.__init__, tqdm_cls.display, tqdm_cls.clear, tqdm_cls.close
    iterate = tqdm_cls.__iter__

    def __iter__(self):
        if not self.__dict__.get("_nblaunch_row"):
            yield from iterate(self)
            return
        for obj in iterate(self):
            yield obj
            progress.count_step()  # a step boundary: where a live call's interrupt may land

    def __init__(self, *args, **kwargs):
        file = kwargs.get("file", args[4] if len(args) > 4 else None)
        # Decided before tqdm's own __init__, which draws the empty bar.
        reporter = progress.reporter()
        self._nblaunch_row = reporter is not None and file in (None, sys.stdout, sys.stderr)
        self._nblaunch_closing = False
        init(self, *args, **kwargs)
        if self._nblaunch_row and not self.disable:
            self._nblaunch_mirror = _TqdmRow(self)
            reporter.add(self._nblaunch_mirror)

    def display_(self, msg=None, pos=None):
        # Silent while the row shows it; its final line when it closes with
        # leave=True (tqdm then calls display(pos=0) with no message).
        if self.__dict__.get("_nblaunch_row") and not (self._nblaunch_closing and msg is None and pos == 0):
            return True
        return display(self, msg, pos)

    def clear_(self, *args, **kwargs):
        if not self.__dict__.get("_nblaunch_row"):
            return clear(self, *args, **kwargs)

    def close_(self):
        self.__dict__["_nblaunch_closing"] = True
        try:
            return close(self)
        finally:
            row = self.__dict__.get("_nblaunch_mirror")
            reporter = progress.reporter()
            if row is not None and reporter is not None:
                row.final = _TqdmRow.read(self, when=time.time())
                reporter.wake()

    tqdm_cls.__init__, tqdm_cls.display, tqdm_cls.clear, tqdm_cls.close = __init__, display_, clear_, close_
    tqdm_cls.__iter__ = __iter__
    tqdm_cls._nblaunch_mirrored = True


def detach_notebook(module) -> None:
    """tqdm's notebook front end draws ipywidgets through the kernel's comm
    channel, which a rank cannot reach (a forked rank's messages are dropped
    with "attempted to send message from fork"). ``tqdm.auto`` picked it at
    import in the kernel, and classes that subclass it (Lightning's ``Tqdm``)
    are bound for good, so rebinding names cannot reach them all: instead its
    overrides are removed from the class, and every notebook bar in this rank
    behaves as the core ``tqdm`` (whose bars then become the rank's rows)."""
    cls = getattr(module, "tqdm_notebook", None)
    if cls is None or cls.__dict__.get("_nblaunch_detached"):
        return
    for attr, value in list(cls.__dict__.items()):
        if callable(value) or isinstance(value, (property, staticmethod, classmethod)):
            if not attr.startswith("__") or attr in ("__init__", "__iter__", "__repr__"):
                delattr(cls, attr)
    cls._nblaunch_detached = True
