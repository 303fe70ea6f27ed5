"""Where is each rank? Python stacks of live ranks, on demand.

Each rank registers :mod:`faulthandler` on ``SIGUSR1`` with its own stack
file. faulthandler writes from the C signal handler, so a rank blocked in a
gloo/NCCL wait still answers with its Python stack. The kernel signals every
live rank, waits at most a second for the files to settle, and summarises the
main thread's innermost frames, with the source line, per rank.
"""
from __future__ import annotations

import faulthandler
import linecache
import os
import re
import signal
import threading
import time
from pathlib import Path
from typing import Optional

from ..system import linux
from .frames import cell_of, is_machinery

__all__ = ["register", "collect", "collectives", "format_stacks"]

SIGNAL = signal.SIGUSR1
ANSWER_S = 1.0
_SETTLE_S = 0.05
_keep_open = []  # the file faulthandler writes to must outlive this call

_FRAME = re.compile(r'^\s+File "(?P<file>.*)", line (?P<line>\d+) in (?P<func>.*)$')
_THREAD = re.compile(r"^(?:(?:Current thread|Thread) (?P<ident>0x[0-9a-f]+)|Stack \(most recent call first\))")


# The kernel signals a rank's main thread itself (linux.signal_main_thread),
# and the rank dumps that thread alone: faulthandler walks every other
# thread's frames without the GIL, and a thread starting or ending meanwhile
# (tqdm's monitor, a DataLoader's pin thread) crashed a rank now and then
# (seen: SIGSEGV in about 1 of 50 dumps of a busy rank).


def register(path: str) -> None:
    """In a rank: dump the main thread's stack (every thread's where a
    signal cannot be sent to one thread) to ``path`` on ``SIGUSR1``."""
    fh = open(path, "w")
    fh.write(f"main {threading.main_thread().ident:#018x}\n")
    fh.flush()
    _keep_open.append(fh)
    faulthandler.register(SIGNAL, file=fh, all_threads=linux.tgkill is None, chain=False)


def collect(ranks: dict[int, tuple[int, str]]) -> dict[int, Optional[str]]:
    """Signal each ``rank -> (pid, stack file)``; return each rank's new dump,
    or None for a rank that did not answer within :data:`ANSWER_S`."""
    sizes = {}
    for rank, (pid, path) in ranks.items():
        sizes[rank] = _size(path)
        try:
            linux.signal_main_thread(pid, SIGNAL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + ANSWER_S
    pending = set(ranks)
    dumps: dict[int, Optional[str]] = {rank: None for rank in ranks}
    last = dict(sizes)
    while pending and time.monotonic() < deadline:
        time.sleep(_SETTLE_S)
        for rank in list(pending):
            size = _size(ranks[rank][1])
            if size > sizes[rank] and size == last[rank]:  # grew, then stopped growing
                dumps[rank] = _read_from(ranks[rank][1], sizes[rank])
                pending.discard(rank)
            last[rank] = size
    return dumps


def format_stacks(dumps: dict[int, Optional[str]], ranks: dict[int, tuple[int, str]], depth: int = 3) -> str:
    """One line per rank of ``ranks`` (the ``rank -> (pid, stack file)`` given
    to :func:`collect`), e.g.
    ``rank 0: in all_reduce at distributed_c10d.py:2950 <- train at 1234.py:7   | dist.all_reduce(t)``"""
    lines = []
    for rank in sorted(dumps):
        dump = dumps[rank]
        if dump is None:
            lines.append(f"  rank {rank}: did not answer within {ANSWER_S:g} s (stuck outside Python "
                         "with signals blocked, or already exiting)")
            continue
        frames = [f for f in _main_thread_frames(dump, _main_ident(ranks[rank][1])) if not _plumbing(f[0], f[2])]
        if not frames:
            lines.append(f"  rank {rank}: no Python frames")
            continue
        shown = [f"{func} at {_place(file, line)}" for file, line, func in frames[:depth]]
        user = next((f for f in frames if not _library(f[0])), frames[0])
        source = linecache.getline(user[0], user[1]).strip()
        lines.append(f"  rank {rank}: in " + " <- ".join(shown) + (f"   | {source}" if source else ""))
    return "\n".join(lines)


def collectives(dumps: dict[int, Optional[str]], ranks: dict[int, tuple[int, str]]) -> dict[int, Optional[str]]:
    """For each rank of :func:`collect`'s ``dumps``: the torch.distributed
    collective its main thread is blocked in (its innermost Python frame is
    one, e.g. ``all_reduce``), else None."""
    found: dict[int, Optional[str]] = {}
    for rank, dump in dumps.items():
        frames = _main_thread_frames(dump, _main_ident(ranks[rank][1])) if dump else []
        inner = frames[0] if frames else None
        found[rank] = inner[2] if inner and inner[0].endswith("distributed_c10d.py") else None
    return found


def _main_thread_frames(dump: str, main_ident: Optional[str]) -> list[tuple[str, int, str]]:
    threads: dict[str, list] = {}
    current = None
    for raw in dump.splitlines():
        if m := _THREAD.match(raw):  # a thread, or the one thread of a main-thread dump
            current = threads.setdefault(m.group("ident") or main_ident or "main", [])
        elif (m := _FRAME.match(raw)) and current is not None:
            current.append((m.group("file"), int(m.group("line")), m.group("func")))
    if main_ident in threads:
        return threads[main_ident]
    return next(iter(threads.values()), [])


def _main_ident(path: str) -> Optional[str]:
    try:
        with open(path) as fh:
            head = fh.readline().split()
    except OSError:
        return None
    return head[1] if len(head) == 2 and head[0] == "main" else None


_STDLIB = os.path.dirname(os.__file__) + os.sep


def _plumbing(file: str, func: str) -> bool:
    """Frames every rank has that say nothing about where it is."""
    if is_machinery(file):  # threading's frames only where a thread starts: a wait() says where it waits
        return not file.endswith("threading.py") or func in ("run", "_bootstrap_inner", "_bootstrap")
    return file.endswith("c10d_logger.py") or (file == "<string>" and func == "<module>")


def _library(file: str) -> bool:
    return "site-packages" in file or file.startswith(_STDLIB)


def _place(file: str, line: int) -> str:
    """``Cell In[8], line 3`` for notebook code, ``distributed_c10d.py:2950`` otherwise."""
    cell = cell_of(file)
    if cell is not None:
        return f"{cell[0]}, line {line + cell[1]}"
    return f"{_short(file)}:{line}"


def _short(file: str) -> str:
    parts = Path(file).parts
    return "/".join(parts[-2:]) if len(parts) > 1 else file


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _read_from(path: str, offset: int) -> str:
    with open(path, "rb") as fh:
        fh.seek(offset)
        return fh.read().decode("utf-8", "replace")
