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
import threading
from typing import Optional

__all__ = ["is_machinery", "parse_frame"]


def _forms(path: str) -> set[str]:
    """A path as written and as resolved: a rank reports the path its module
    was loaded from, which may go through a symlink (a venv's lib64, say)."""
    return {os.path.abspath(path), os.path.realpath(path)}


_PACKAGE_DIRS = tuple(p + os.sep for p in _forms(os.path.dirname(__file__)))
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
