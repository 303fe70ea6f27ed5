"""What ``%debug`` needs of a failed rank, taken as it fails.

A launch's ranks are gone by the time the user types ``%debug``, so the
failing rank sends a snapshot with its ``Failure``: for each frame of the
traceback from the user's function inwards, where it was (file, line,
function, module), the source around it, and its locals' values. A value
travels pickled (cloudpickle: classes and functions from the notebook too)
when it fits :data:`VALUE_BYTES`, the whole within :data:`TOTAL_BYTES`;
else as its ``repr``, cut short (:class:`Unshown`). Tensors travel as CPU
copies. The kernel rebuilds real frames from it (:mod:`nblaunch.watch.postmortem`).
"""
from __future__ import annotations

import io
import linecache
import sys
import time
from dataclasses import dataclass
from typing import Any, Optional

from .frames import is_machinery

__all__ = ["FrameRecord", "Unshown", "snapshot", "VALUE_BYTES", "TOTAL_BYTES"]

VALUE_BYTES = 1 << 20
TOTAL_BYTES = 16 << 20
MAX_FRAMES = 40
REPR_CHARS = 2000
TIME_S = 1.0  # the failure is reported after this at most; locals not pickled by then show as repr


@dataclass(frozen=True)
class Unshown:
    """A local too large or not picklable: its type and ``repr``."""

    type_name: str
    text: str
    why: str

    def __repr__(self) -> str:
        return self.text


@dataclass
class FrameRecord:
    filename: str
    lineno: int
    name: str
    module: str  # its globals' ``__name__``
    lines: Optional[list]  # the file's source, for a file the kernel may not have
    values: dict  # local name -> pickled value (bytes) or an Unshown


class _Full(Exception):
    pass


class _Bounded(io.RawIOBase):
    def __init__(self, limit: int):
        self.buf, self.limit = bytearray(), limit

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        if len(self.buf) + len(data) > self.limit:
            raise _Full
        self.buf += data
        return len(data)


def snapshot(exc: BaseException) -> Optional[bytes]:
    """The frames of ``exc``'s traceback from the first of the user's own,
    pickled; None if there is nothing to show."""
    import cloudpickle

    tb = exc.__traceback__
    frames = []
    while tb is not None:
        frames.append((tb.tb_frame, tb.tb_lineno))
        tb = tb.tb_next
    first = next((i for i, (f, _) in enumerate(frames) if not is_machinery(f.f_code.co_filename)), None)
    if first is None:
        return None
    budget = [TOTAL_BYTES, time.monotonic() + TIME_S]  # bytes left, and until when
    shipped: set = set()  # each file's source once
    records = [_record(f, line, budget, shipped) for f, line in frames[first:][-MAX_FRAMES:]]
    try:
        return cloudpickle.dumps(records)
    except Exception:
        return None


def _record(frame, lineno: int, budget: list, shipped: set) -> FrameRecord:
    code = frame.f_code
    values = {}
    for name, value in list(frame.f_locals.items()):
        values[name] = _value(value, budget)
    lines = None
    if code.co_filename not in shipped:
        shipped.add(code.co_filename)
        lines = linecache.getlines(code.co_filename, frame.f_globals) or None
        size = sum(map(len, lines or ()))
        if size > budget[0]:
            lines = None
        budget[0] -= size if lines else 0
    return FrameRecord(code.co_filename, lineno, code.co_name, str(frame.f_globals.get("__name__", "")),
                       lines, values)


def _pickler(out: _Bounded):
    """cloudpickle, refusing a tensor over the limit before torch copies
    its storage out (an optimizer's state can be gigabytes), and copying a
    GPU tensor to the CPU (the kernel may have no GPU)."""
    import cloudpickle

    class Pickler(cloudpickle.CloudPickler):
        def reducer_override(self, obj):
            size = _tensor_bytes(obj, modules=False)
            if size is not None:
                if size > out.limit - len(out.buf):
                    raise _Full
                if obj.device.type != "cpu":
                    return obj.detach().cpu().__reduce_ex__(5)
            return super().reducer_override(obj)

    return Pickler(out, protocol=5)


def _value(value: Any, budget: list):
    limit = min(VALUE_BYTES, budget[0])
    if time.monotonic() > budget[1]:
        return _unshown(value, "the snapshot's time was spent")
    size = _tensor_bytes(value)
    if size is not None and size > limit:
        return _unshown(value, f"{size:,} bytes of tensor data")
    out = _Bounded(limit)
    try:
        _pickler(out).dump(value)
    except _Full:
        return _unshown(value, f"over {limit:,} bytes pickled")
    except Exception as exc:  # noqa: BLE001 - a local that cannot travel is shown as its repr
        return _unshown(value, f"not picklable: {type(exc).__name__}")
    budget[0] -= len(out.buf)
    return bytes(out.buf)


def _tensor_bytes(value: Any, modules: bool = True) -> Optional[int]:
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if modules and isinstance(value, torch.nn.Module):
        return sum(p.numel() * p.element_size() for p in value.parameters())
    return None


def _unshown(value: Any, why: str) -> Unshown:
    try:
        text = repr(value)
    except Exception as exc:  # noqa: BLE001
        text = f"<{type(value).__qualname__}: repr() failed: {exc}>"
    if len(text) > REPR_CHARS:
        text = text[:REPR_CHARS] + f"... ({len(text):,} chars)"
    return Unshown(type(value).__qualname__, text, why)
