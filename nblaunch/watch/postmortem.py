"""Post-mortem debugging of a failed rank, in the kernel: ``%debug`` and
:func:`debug`.

The failing rank sent a snapshot of its frames (:mod:`nblaunch.rank.postmortem`).
Here each becomes a real frame again: a line of code compiled under the
rank's file name and line number, run with the rank's locals as its locals
and the function's module (the notebook's namespace, for a function defined
in it) as its globals, raising at once; the tracebacks of those frames,
chained, are the rank's traceback. ``pdb`` needs nothing else: ``l`` reads
the rank's source (put in ``linecache`` where this machine lacks the file),
``up``/``down`` walk the rank's stack, ``p`` evaluates in its locals.
:class:`~nblaunch.errors.WorkerError` carries it as its own traceback's
innermost frames, which is where ``%debug`` opens.
"""
from __future__ import annotations

import linecache
import pickle
import sys
from types import TracebackType
from typing import Optional

from ..errors import RankFailure, WorkerError
from ..rank.postmortem import FrameRecord, Unshown

__all__ = ["rank_traceback", "debug", "with_rank_frames"]

_last: Optional[WorkerError] = None


def with_rank_frames(error: WorkerError) -> WorkerError:
    """``error``, its traceback ending in the failed rank's frames (where
    ``%debug`` opens), and kept for :func:`debug`."""
    global _last
    _last = error
    try:
        tb = rank_traceback(error.root)
    except Exception:  # noqa: BLE001 - the error matters more than its post-mortem
        tb = None
    return error.with_traceback(tb) if tb is not None else error


def rank_traceback(failure: RankFailure) -> Optional[TracebackType]:
    """The failed rank's traceback, from its function inwards, with its
    locals; None when the rank sent no frames (it was killed, say)."""
    if not failure.frames:
        return None
    try:
        records = pickle.loads(failure.frames)
    except Exception:  # noqa: BLE001 - a snapshot that does not load here: no post-mortem
        return None
    tbs = [_frame(record) for record in records]
    for outer, inner in zip(tbs, tbs[1:]):
        outer.tb_next = inner
    return tbs[0] if tbs else None


def _frame(record: FrameRecord) -> TracebackType:
    if record.lines and not linecache.getlines(record.filename):
        linecache.cache[record.filename] = (sum(map(len, record.lines)), None, record.lines, record.filename)
    # A fresh error: a bare ``raise`` re-raised the exception being handled
    # where this runs (an ``except`` block), whose traceback then took in
    # every frame made, and linking them made a loop (ValueError).
    code = compile("\n" * (record.lineno - 1) + "1 / 0", record.filename, "exec").replace(co_name=record.name)
    namespace = {name: _load(value) for name, value in record.values.items()}
    try:
        exec(code, _globals(record.module), namespace)
    except BaseException:  # noqa: BLE001 - the point: its traceback holds the frame
        tb = sys.exc_info()[2]
    return tb.tb_next


def _globals(module: str) -> dict:
    found = sys.modules.get(module)
    return found.__dict__ if found is not None else {"__name__": module}


def _load(value):
    if isinstance(value, Unshown):
        return value
    try:
        return pickle.loads(value)
    except Exception as exc:  # noqa: BLE001 - a class the kernel cannot import, say
        return Unshown("?", f"<could not be loaded in the kernel: {type(exc).__name__}: {exc}>", "unloadable")


def debug(error: Optional[BaseException] = None, rank: Optional[int] = None) -> None:
    """Open the debugger in a failed rank's frames: ``error`` (default: the
    last launch's ``WorkerError``), at ``rank`` (default: the rank that
    failed first). What pdb shows of a launch's rank is what it held when it
    failed: its locals' values, each up to 1 MB pickled (larger ones and
    those that do not pickle show as their ``repr``)."""
    error = error if error is not None else _latest()
    if not isinstance(error, WorkerError):
        raise ValueError("nblaunch.debug() opens a failed rank's frames; there is no WorkerError to debug"
                         + (f" (got {type(error).__name__})" if error is not None else ""))
    failure = error.root if rank is None else next((f for f in error.failures if f.rank == rank), None)
    if failure is None:
        raise ValueError(f"rank {rank} did not fail in this launch; the ranks that did: "
                         f"{', '.join(str(f.rank) for f in error.failures)}")
    tb = rank_traceback(failure)
    if tb is None:
        raise ValueError(f"{failure.summary()}: it left no Python frames to debug (only a rank that raised "
                         "an exception in fn does); its last lines are in the error")
    debugger = _debugger()
    debugger.reset()
    debugger.interaction(None, tb)


def _latest() -> Optional[BaseException]:
    last = getattr(sys, "last_value", None)
    return last if isinstance(last, WorkerError) else _last


def _debugger():
    shell = _shell()
    if shell is not None:
        return shell.debugger_cls()
    import pdb

    return pdb.Pdb()


def _shell():
    ip = sys.modules.get("IPython")
    return ip.get_ipython() if ip is not None else None
