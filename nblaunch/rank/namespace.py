"""The names a live rank keeps between calls, and how a call's function reaches them.

In a live session (:mod:`nblaunch.live`) each rank has one namespace for
its whole life, the rank's own ``__main__`` as ``%%px`` gives an ipyparallel
engine: ``global model`` in one call's function is ``model`` in the next.

A function defined in the notebook travels by value (cloudpickle), and
cloudpickle gives it a fresh globals dict holding the notebook values it
uses. :func:`pack_call` marks that dict, and the rank's unpickler puts the
rank's namespace in its place, so the function, and every notebook function
and class it brings along, reads and writes the rank's names.

The notebook's values come along on every call, except for a name the rank
has bound itself: **the rank's binding wins**. Otherwise a ``model`` left in
the kernel from an earlier experiment would silently replace the rank's
trained ``model`` with a copy. ``Ranks.push`` replaces a rank's name on purpose.
"""
from __future__ import annotations

import builtins
import io
import pickle
import sys
from typing import Any, Optional

from ..wire.payload import NotebookPickler

__all__ = ["RankNamespace", "pack_call", "current"]

_TOKEN = "nblaunch-rank-namespace"


class _CallPickler(NotebookPickler):
    """Pickles a job with every notebook function's globals marked. Tensors
    are copied into the bytes: every rank unpickles the same bytes, and
    torch's shared-memory handles can each be taken by one process only."""

    def __init__(self, file, main: dict):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._main_id = id(main)

    def persistent_id(self, obj):
        # cloudpickle keeps one new globals dict per original globals dict
        # (``globals_ref``) and pickles it as the functions' future globals.
        if type(obj) is dict and obj is self.globals_ref.get(self._main_id):
            return _TOKEN
        return None


def pack_call(fn, args: tuple, kwargs: dict, main: Optional[dict] = None) -> bytes:
    """The job ``(fn, args, kwargs)`` for a live rank, as bytes. ``main``: the
    notebook's namespace (default: ``__main__``'s)."""
    if main is None:
        main = sys.modules["__main__"].__dict__
    buf = io.BytesIO()
    _CallPickler(buf, main).dump((fn, tuple(args), dict(kwargs)))
    return buf.getvalue()


class RankNamespace:
    """One live rank's globals, and which of them the rank bound itself."""

    def __init__(self):
        self.names: dict = {"__name__": "__main__", "__builtins__": builtins}
        # name -> the object the notebook last brought: a name whose value
        # is still that object has not been rebound by the rank.
        self._brought: dict = {}

    def _owned(self) -> dict:
        """The rank's own bindings: not brought, or rebound since."""
        return {k: v for k, v in self.names.items()
                if not k.startswith("__") and (k not in self._brought or self._brought[k] is not v)}

    def load(self, data: bytes) -> tuple:
        """Unpickle a :func:`pack_call` job into this namespace."""
        before, owned = dict(self.names), self._owned()
        names = self.names

        class Unpickler(pickle.Unpickler):
            def persistent_load(self, pid):
                if pid != _TOKEN:
                    raise pickle.UnpicklingError(f"unknown persistent id {pid!r}")
                return names

        job = Unpickler(io.BytesIO(data)).load()
        self.settle_brought(before, owned)
        return job

    def bring(self, values: dict) -> None:
        """Notebook values (a ``%%nblaunch`` cell's names): same rule as a function's."""
        before, owned = dict(self.names), self._owned()
        self.names.update(values)
        self.settle_brought(before, owned)

    def settle_brought(self, before: dict, owned: dict) -> None:
        for name, value in list(self.names.items()):
            if name.startswith("__") or (name in before and before[name] is value):
                continue
            if name in owned:
                self.names[name] = owned[name]  # the rank's binding wins
            else:
                self._brought[name] = value
        self.names["__builtins__"] = builtins  # cloudpickle sets its own

    def push(self, values: dict) -> None:
        """Bind names in the rank as if the rank had set them."""
        self.names.update(values)
        for name in values:
            self._brought.pop(name, None)

    def forget(self) -> None:
        """Drop brought entries for names no longer bound (``del`` in a rank)."""
        for name in [k for k in self._brought if k not in self.names]:
            del self._brought[name]


_current: Optional[RankNamespace] = None


def current() -> RankNamespace:
    """This live rank's namespace (made on first use)."""
    global _current
    if _current is None:
        _current = RankNamespace()
    return _current


def pull(name: str) -> Any:
    """In a live rank: the value bound to ``name``."""
    names = current().names
    if name not in names or name.startswith("__"):
        raise NameError(f"name {name!r} is not defined in this rank "
                        f"(defined: {', '.join(sorted(k for k in names if not k.startswith('__'))) or 'nothing yet'})")
    return names[name]


def push(values: dict) -> None:
    """In a live rank: bind ``values``."""
    current().push(values)
