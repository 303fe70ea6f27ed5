"""What a rank sends back: a call's result (tensor data through shared
memory, CUDA tensors as CPU copies, within :func:`max_result_bytes`), or its
failure, with the traceback as the user would see it.
"""
from __future__ import annotations

import io
import os
import pickle
import sys
import time
import traceback
from typing import Any, Optional

from ..wire.channel import EventSender, Failure
from . import postmortem
from .frames import is_machinery

__all__ = ["dump_result", "max_result_bytes", "check_size", "report"]


def dump_result(rank: int, value: Any) -> tuple[bytes, int]:
    """``(payload, bytes of tensor data put in shared memory)``. Tensors go
    through torch's own multiprocessing reductions (as ``args`` do under
    spawn), so a 512 MB state_dict is never pickled into bytes, here or in
    the kernel."""
    if _plain(value):
        try:
            return pickle.dumps(value, pickle.HIGHEST_PROTOCOL), 0
        except Exception:  # nested deeper than pickle recurses: the general path says so
            pass
    from multiprocessing.reduction import ForkingPickler

    shared = _count_shared(ForkingPickler._extra_reducers)
    try:
        buf = io.BytesIO()
        pickler = ForkingPickler(buf, pickle.HIGHEST_PROTOCOL)
        pickler.dispatch_table = shared.table(pickler.dispatch_table)
        pickler.dump(value)
        return buf.getvalue(), shared.nbytes
    except Exception:
        pass
    from ..wire.payload import sharing_pickler  # classes defined in the cell, closures...

    shared = _count_shared(ForkingPickler._extra_reducers)
    try:
        buf = io.BytesIO()
        pickler = sharing_pickler(buf)
        pickler.dispatch_table = shared.table(pickler.dispatch_table)
        pickler.dump(value)
        return buf.getvalue(), shared.nbytes
    except Exception as exc:
        raise TypeError(
            f"the result of rank {rank} (a {type(value).__module__}.{type(value).__qualname__}) "
            f"cannot be pickled: {exc}"
        ) from None


_PLAIN_ATOMS = (type(None), bool, int, float, complex, str, bytes)
_PLAIN_ITEMS = 10_000


def _plain(value: Any) -> bool:
    """Whether ``value`` is built of Python's own atoms in lists, tuples and
    dicts (what most ranks return: None, a loss, a dict of metrics). Those
    need neither torch's reducers nor cloudpickle, and building the sharing
    pickler costs a forked rank ~90 page copies (its dispatch table copies
    every reducer torch registered). Bounded: a large structure takes the
    general path."""
    todo, seen = [value], 0
    while todo:
        v = todo.pop()
        seen += 1
        if seen > _PLAIN_ITEMS:
            return False
        t = type(v)
        if t in _PLAIN_ATOMS:
            continue
        if t is list or t is tuple:
            todo.extend(v)
        elif t is dict:
            todo.extend(v.keys())
            todo.extend(v.values())
        else:
            return False
    return True


class _count_shared:
    """Wraps torch's storage reducers to add up what they put in shared
    memory, each storage once (a typed storage is reduced through its
    untyped one; views share a storage). CUDA tensors are sent as a CPU copy
    in shared memory and rebuilt on the same device in the kernel: torch's
    CUDA IPC would hand the kernel memory that dies with the rank."""

    def __init__(self, reducers: dict):
        import torch

        self.nbytes = 0
        self._seen: set = set()
        self._wrapped = {cls: self._wrap(reduce) for cls, reduce in reducers.items()
                         if "Storage" in getattr(cls, "__name__", "")}
        self._wrapped.update({cls: self._cuda_as_cpu(reduce) for cls, reduce in reducers.items()
                              if isinstance(cls, type) and issubclass(cls, torch.Tensor)})

    @staticmethod
    def _cuda_as_cpu(reduce):
        def reduce_tensor(tensor):
            if tensor.is_cuda:
                return (_cuda_from_cpu, (tensor.detach().cpu(), tensor.device.index, tensor.requires_grad))
            return reduce(tensor)
        return reduce_tensor

    def _wrap(self, reduce):
        def counted(storage):
            untyped = getattr(storage, "_untyped_storage", storage)
            if untyped.data_ptr() not in self._seen:
                self._seen.add(untyped.data_ptr())
                self.nbytes += untyped.nbytes()
            return reduce(storage)
        return counted

    def table(self, base) -> dict:
        table = dict(base)
        table.update(self._wrapped)
        return table


def _cuda_from_cpu(tensor, device: int, requires_grad: bool):
    """In the kernel: a rank's CUDA tensor, back on its device."""
    return tensor.to(f"cuda:{device}").requires_grad_(requires_grad)


def max_result_bytes() -> int:
    """Largest pickled result a rank may send (``$NBLAUNCH_MAX_RESULT_BYTES``,
    default 2 GiB): the kernel holds every rank's result in memory at once, so
    a bigger one fails that rank with a clear error instead of the kernel."""
    return int(os.environ.get("NBLAUNCH_MAX_RESULT_BYTES", 2 << 30))


def check_size(rank: int, value: Any, size: int) -> None:
    """Raise a ``ValueError`` that says so when a result of ``size`` bytes is over :func:`max_result_bytes`."""
    limit = max_result_bytes()
    if size > limit:
        raise ValueError(
            f"the result of rank {rank} (a {type(value).__qualname__}) is {size:,} bytes, "
            f"over the {limit:,}-byte limit (NBLAUNCH_MAX_RESULT_BYTES). Return something smaller, "
            "or save large outputs to disk and return their paths.")


def report(sender: EventSender, rank: int, phase: str, exc: BaseException, call: int = 0,
           seq: int = -1) -> None:
    """Send ``exc`` to the kernel as a ``Failure`` of ``phase``, with its traceback as the user
    would see it; on stderr when the events pipe is gone."""
    try:
        pickled: Optional[bytes] = pickle.dumps(exc, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:
        pickled = None
    frames = None
    if phase == "fn" and not isinstance(exc, KeyboardInterrupt):
        try:
            frames = postmortem.snapshot(exc)
        except Exception:  # noqa: BLE001 - the report matters more than its snapshot
            frames = None
    failure = Failure(
        rank=rank,
        time=time.time(),
        exc_type=type(exc).__qualname__,
        message=_safe_str(exc),
        traceback=_format_user_traceback(exc),
        exception=pickled,
        phase=phase,
        call=call,
        seq=seq,
        frames=frames,
    )
    try:
        sender.send(failure)
    except Exception:
        # The kernel is gone or the pipe broke: the traceback still goes to
        # the output pipe, which the kernel reads to the end.
        sys.stderr.write(failure.traceback)


def _safe_str(exc: BaseException) -> str:
    """``str(exc)``, even for an exception whose ``__str__`` raises."""
    try:
        return str(exc)
    except Exception as inner:
        return f"<str() of the exception failed: {type(inner).__name__}: {inner}>"


def _format_user_traceback(exc: BaseException) -> str:
    """The traceback as the user would see it running fn in the cell:
    nblaunch's own frames (the serve loop above fn, the magic's cell runner)
    are left out, unless the error was raised in nblaunch itself."""
    try:
        te = traceback.TracebackException(type(exc), exc, exc.__traceback__)
        _drop_machinery(te, set())
        return "".join(te.format())
    except Exception:  # a __str__ that raises: the frames still tell where
        summary = _user_frames(traceback.extract_tb(exc.__traceback__))
        frames = "".join(traceback.format_list(summary))
        return f"Traceback (most recent call last):\n{frames}{type(exc).__qualname__}: {_safe_str(exc)}\n"


def _user_frames(stack: traceback.StackSummary) -> traceback.StackSummary:
    kept = [f for i, f in enumerate(stack) if not is_machinery(f.filename) or i == len(stack) - 1]
    return traceback.StackSummary.from_list(kept)


def _drop_machinery(te: traceback.TracebackException, seen: set) -> None:
    if id(te) in seen:
        return
    seen.add(id(te))
    te.stack = _user_frames(te.stack)
    for chained in (te.__cause__, te.__context__):
        if chained is not None:
            _drop_machinery(chained, seen)
