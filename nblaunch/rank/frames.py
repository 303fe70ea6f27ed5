"""Which stack frames are the machinery around a rank's function.

A crash report or a stack of a rank is read for the user's own frames; the
frames of nblaunch itself and of the standard library's process and thread
start-up say nothing about where the user's code was. They are recognised by
the modules' real locations on this machine, never by a folder name: a user's
project (or the clone of this repository) may well sit in a folder called
``nblaunch`` or ``multiprocessing``.
"""
from __future__ import annotations

import multiprocessing
import os
import re
import runpy
import sys
import threading
from typing import Optional

__all__ = ["is_machinery", "parse_frame", "cell_of", "in_notebook_terms", "register_cell"]


def _forms(path: str) -> set[str]:
    """A path as written and as resolved: a rank reports the path its module
    was loaded from, which may go through a symlink (a venv's lib64, say)."""
    return {os.path.abspath(path), os.path.realpath(path)}


_PACKAGE_DIRS = tuple(p + os.sep for p in _forms(os.path.dirname(os.path.dirname(__file__))))  # nblaunch/, not rank/
_STDLIB_PACKAGES = tuple(p + os.sep for p in _forms(os.path.dirname(multiprocessing.__file__)))
_STDLIB_FILES = frozenset(_forms(threading.__file__) | _forms(runpy.__file__))

# One frame of a faulthandler dump: `  File "/x/y.py", line 7 in train`.
_FAULTHANDLER_FRAME = re.compile(r'^\s*File "(?P<file>.*)", line (?P<line>\d+) in (?P<func>.*)$')


def is_machinery(file: str) -> bool:
    """True for a frame in nblaunch's own package, in ``multiprocessing``,
    ``threading`` or ``runpy``, wherever they are installed."""
    if not file or file.startswith("<"):
        return False
    if file.startswith(_PACKAGE_DIRS + _STDLIB_PACKAGES) or file in _STDLIB_FILES:
        return True
    real = os.path.realpath(file)
    return real.startswith(_PACKAGE_DIRS + _STDLIB_PACKAGES) or real in _STDLIB_FILES


def parse_frame(line: str) -> Optional[tuple[str, int, str]]:
    """``(file, line, function)`` of one faulthandler frame line, else None."""
    m = _FAULTHANDLER_FRAME.match(line)
    return (m.group("file"), int(m.group("line")), m.group("func")) if m else None


# Cell bodies the %%nblaunch magic runs under a name of its own:
# filename -> (the cell's label, lines before the body).
_MAGIC_CELLS: dict[str, tuple[str, int]] = {}


def register_cell(filename: str, label: str, offset: int) -> None:
    """A ``%%nblaunch`` body runs as ``filename``; in tracebacks it is the
    cell ``label`` (``Cell In[8]``), its lines ``offset`` further down."""
    _MAGIC_CELLS[filename] = (label, offset)


def cell_of(file: str) -> Optional[tuple[str, int]]:
    """``("Cell In[8]", line offset)`` for a file that is a notebook cell of
    this kernel, as IPython names it in its own tracebacks; else None."""
    if file in _MAGIC_CELLS:
        return _MAGIC_CELLS[file]
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    name = getattr(getattr(shell, "compile", None), "format_code_name", None)
    try:
        parts = name(file) if name is not None else None
    except Exception:
        return None
    return (f"{parts[0]} {parts[1]}", 0) if parts else None


# `File "/tmp/ipykernel_7/123.py", line 3` in a traceback or faulthandler dump.
_FILE_LINE = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+)')


def in_notebook_terms(text: str) -> str:
    """``text`` with every frame in a notebook cell named as IPython names
    it (``Cell In[8], line 3``), not by the kernel's hidden cell file."""
    if not text or 'File "' not in text:
        return text

    def name(m: re.Match) -> str:
        cell = cell_of(m.group("file"))
        if cell is None:
            return m.group(0)
        label, offset = cell
        return f"{label}, line {int(m.group('line')) + offset}"

    return _FILE_LINE.sub(name, text)
