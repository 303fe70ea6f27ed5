"""Kernel -> ranks: the job (``fn``, ``args``, ``kwargs``) for ranks that are not forked.

Functions, lambdas, closures and classes defined in notebook cells travel by
value with cloudpickle. CPU tensors do not: torch's own multiprocessing
reductions move their storage to shared memory once and hand each rank a
file descriptor, so N ranks map one copy. Those reductions can pass a file
descriptor only while ``Process.start()`` is pickling the process, which is
why the job is pickled from ``__reduce__`` (once per rank, at start) and not
to bytes up front.
"""
from __future__ import annotations

import builtins
import io
import linecache
import os
import pickle
import types
from collections import ChainMap
from multiprocessing.reduction import ForkingPickler
from typing import Any, Optional

import cloudpickle

__all__ = ["CloudJob", "check_sendable"]


def _reduce_code(code: types.CodeType):
    """cloudpickle's code reducer, keeping the file name and the source lines.

    cloudpickle replaces ``co_filename`` with ``<dynamic-code>``: a rank's
    traceback would then show no file and no source, and a notebook cell's
    source exists only in the kernel's linecache. Both travel with the code.
    """
    # Only a notebook cell's source lives nowhere but this kernel's linecache;
    # a file on disk (a library's code pickled by value) the rank reads itself.
    lines = [] if os.path.isfile(code.co_filename) else linecache.getlines(code.co_filename)
    return (_rebuild_code, (cloudpickle_code_reduce(code), code.co_filename, lines))


def _rebuild_code(reduced, filename: str, lines: list) -> types.CodeType:
    rebuild, args = reduced
    if lines and filename not in linecache.cache:
        linecache.cache[filename] = (sum(map(len, lines)), None, lines, filename)
    return rebuild(*args).replace(co_filename=filename)


cloudpickle_code_reduce = cloudpickle.Pickler.dispatch_table[types.CodeType]


class NotebookPickler(cloudpickle.Pickler):
    """cloudpickle, keeping a cell's source for tracebacks (see ``_reduce_code``)."""

    dispatch_table = ChainMap({types.CodeType: _reduce_code}, cloudpickle.Pickler.dispatch_table)

    def reducer_override(self, obj):
        # IPython's `open` (what a cell's `open()` finds) wraps io.open under
        # its name, so cloudpickle cannot find it by reference and would send
        # it, and IPython's whole module, by value. A rank is no notebook:
        # it gets the plain builtin.
        if getattr(obj, "__wrapped__", None) is io.open and type(obj) is types.FunctionType:
            return (getattr, (builtins, "open"))
        return super().reducer_override(obj)


class _SharingPickler(NotebookPickler):
    # torch registers its tensor/storage reducers with ForkingPickler when
    # torch.multiprocessing is imported (torch imports it itself).
    dispatch_table = ChainMap({types.CodeType: _reduce_code}, ForkingPickler._extra_reducers,
                              cloudpickle.Pickler.dispatch_table)


def sharing_pickler(file) -> cloudpickle.Pickler:
    """A cloudpickle pickler that sends tensors through shared memory."""
    return _SharingPickler(file, protocol=pickle.HIGHEST_PROTOCOL)


class _DryRunPickler(cloudpickle.Pickler):
    """Pickles everything except tensor data, to find what cannot be sent
    without paying for serialising gigabytes."""

    def reducer_override(self, obj):
        torch = _torch()
        if torch is not None and isinstance(obj, (torch.Tensor, torch.UntypedStorage)):
            return (type(None), ())
        return super().reducer_override(obj)


def _torch():
    """torch if it is imported, else None (never imported here). Another
    thread may be importing it (a background run's plan): ``import`` then
    waits for it, where ``sys.modules`` would hand over a half-made module."""
    import sys

    if "torch" not in sys.modules:
        return None
    import torch

    return torch


class CloudJob:
    """The job, pickled with cloudpickle when a rank process is started."""

    def __init__(self, fn, args: tuple, kwargs: dict):
        self._job = (fn, tuple(args), dict(kwargs))
        self.size = 0  # bytes per rank, once packed

    def __reduce__(self):
        data = self.pack()
        return (PackedJob, (data,))

    def pack(self, sharing: bool = True) -> bytes:
        """The job as bytes; ``sharing``: tensors as handles to this machine's
        shared memory (for ranks started here), else copied into the bytes
        (for ranks on other machines)."""
        buf = io.BytesIO()
        pickler = _SharingPickler if sharing else NotebookPickler
        pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(self._job)
        self.size = buf.tell()
        return buf.getvalue()


class PackedJob:
    """What a rank receives: the bytes, unpickled only when the rank is ready
    to report a failure to load them."""

    def __init__(self, data: bytes):
        self._data = data
        self.size = len(data)  # bytes per rank

    def load(self) -> tuple:
        return pickle.loads(self._data)


def check_sendable(fn, args, kwargs) -> None:
    """Raise ``TypeError`` naming the first part of the job that cannot be pickled."""
    problem = _why_not((fn, tuple(args), dict(kwargs)))
    if problem is not None:
        where = _locate(fn, args, kwargs) or f"fn or its arguments: {problem}"
        raise TypeError(f"cannot send the job to the ranks: {where}")


def _why_not(obj) -> Optional[str]:
    try:
        _DryRunPickler(_Discard(), protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
        return None
    except Exception as exc:  # noqa: BLE001 - any failure is the answer
        return str(exc) or type(exc).__name__


class _Discard(io.RawIOBase):
    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        return len(b)


def _locate(fn, args, kwargs) -> Optional[str]:
    """Narrow a pickling failure down to a path such as ``args[0].lock``."""
    for i, arg in enumerate(args):
        if (where := _descend(f"args[{i}]", arg, depth=3)) is not None:
            return where
    for key, value in kwargs.items():
        if (where := _descend(f"kwargs[{key!r}]", value, depth=3)) is not None:
            return where
    for name, value in _captured(fn).items():
        if (where := _descend(name, value, depth=3)) is not None:
            return f"{where} (captured by fn as `{name}`)"
    return None


def _descend(path: str, obj: Any, depth: int) -> Optional[str]:
    why = _why_not(obj)
    if why is None:
        return None
    if depth > 0:
        if isinstance(obj, dict):
            children = [(f"{path}[{k!r}]", v) for k, v in obj.items()]
        elif isinstance(obj, (list, tuple, set, frozenset)):
            children = [(f"{path}[{i}]", v) for i, v in enumerate(obj)]
        else:
            children = [(f"{path}.{k}", v) for k, v in getattr(obj, "__dict__", {}).items()]
        for child_path, child in children:
            if (where := _descend(child_path, child, depth - 1)) is not None:
                return where
    return f"{path}: {why}"


def _captured(fn) -> dict:
    """Names a function uses from its closure and its globals."""
    code = getattr(fn, "__code__", None)
    if code is None:
        call = getattr(type(fn), "__call__", None)
        return {"self": fn} if call is not None and hasattr(fn, "__dict__") else {}
    names = dict(zip(code.co_freevars, (c.cell_contents for c in fn.__closure__ or ())))
    names.update({n: fn.__globals__[n] for n in code.co_names if n in fn.__globals__})
    return names

