"""A local rank's output pipe, read as a terminal would show it: whole lines
(a line rewritten with ``\\r`` as its last form), the line still being
written, the rank's last lines for its failure report, and everything
written to the rank's log file as it arrives (a killed kernel keeps every
line)."""
from __future__ import annotations

import collections
import os
import time
from multiprocessing.connection import Connection
from typing import BinaryIO, Optional

from .pool import Lines, Rewriting

__all__ = ["RankOutput"]

READS_PER_PASS = 8  # 64 KiB chunks of one rank's output per poll
MAX_PARTIAL_BYTES = 1 << 20  # a "line" this long without a newline is shown as it is
MAX_LIVE_BYTES = 8192  # of an unfinished line, what the live view looks at
# A rank's end (its result, failure or exit) is acted on once its output pipe
# is read to its end; a pipe a child of the rank keeps open (or fills on) is
# read for at most this long after the rank's own end, and its log says so.
END_DRAIN_S = 2.0


class RankOutput:
    """Local rank ``rank``'s output pipe ``conn`` (made non-blocking); its
    last lines go to ``tail``."""

    def __init__(self, rank: int, conn: Connection, tail: collections.deque):
        self.rank, self.conn = rank, conn
        os.set_blocking(conn.fileno(), False)
        self.log: Optional[BinaryIO] = None  # opened once the rank's global rank is known
        self.open = True
        self.partial = bytearray()
        self.mid_line = False  # the log's last byte is not a newline
        self.tail = tail  # the rank's last lines (the pool's RankFacts.tail)

    def read(self, out: list, max_reads: Optional[int] = READS_PER_PASS, until: Optional[float] = None) -> None:
        """Take what the rank wrote: at most ``max_reads`` chunks a poll, so a
        flooding rank cannot keep the watch from its timers (None: until the
        pipe is empty, or ``until``, a ``time.monotonic()`` deadline)."""
        reads = 0
        while self.open and (max_reads is None or reads < max_reads):
            if until is not None and reads and time.monotonic() >= until:
                break
            reads += 1
            try:
                data = os.read(self.conn.fileno(), 1 << 16)
            except BlockingIOError:
                break
            except OSError:
                data = b""
            if not data:
                self.open = False
                self.end(out)
                return
            if self.log is not None:
                self.log.write(data)
                self.mid_line = not data.endswith(b"\n")
            self.partial += data
            if b"\n" in data:
                *whole, rest = self.partial.split(b"\n")
                self.partial = bytearray(rest)
                self._emit(out, [w.decode("utf-8", "replace") for w in whole])
            if len(self.partial) > MAX_PARTIAL_BYTES:  # no newline in sight: show it as it is
                self._emit(out, [self.partial.decode("utf-8", "replace")])
                self.partial = bytearray()
        if self.partial:
            # The line the rank is still writing, or rewriting with \r
            # (a progress bar that is not tqdm): shown live, as a terminal would.
            current = self.partial[-MAX_LIVE_BYTES:].decode("utf-8", "replace").rstrip("\r").rsplit("\r", 1)[-1]
            out.append(Rewriting(self.rank, current))

    def drain(self, out: list, limit_s: float = END_DRAIN_S) -> None:
        """Everything the pipe holds now, however much (what a rank printed
        before it reported its result is all there), for at most ``limit_s``."""
        self.read(out, max_reads=None, until=time.monotonic() + limit_s)

    def note(self, out: list, text: str) -> None:
        """A line of nblaunch's own in the rank's log and the view."""
        if self.log is not None:
            self.log.write(f"{chr(10) if self.mid_line else ''}[nblaunch] {text}\n".encode())
            self.mid_line = False
        out.append(Lines(self.rank, [f"[nblaunch] {text}"]))

    def end(self, out: list) -> None:
        """The pipe is done: what was left of a line, then the end of the live line."""
        if self.partial:
            self._emit(out, [self.partial.decode("utf-8", "replace")])
            self.partial = bytearray()
        out.append(Rewriting(self.rank, None))

    def _emit(self, out: list, lines: list[str]) -> None:
        # What a terminal would show of a line rewritten with carriage returns.
        lines = [line.rstrip("\r").rsplit("\r", 1)[-1] for line in lines]
        self.tail.extend(lines)
        out.append(Lines(self.rank, lines))

    def close(self) -> None:
        self.conn.close()
        if self.log is not None:
            self.log.close()


def drain_due(ended: bool, waited: float, deadline: float) -> bool:
    """Whether a rank's end (its result, failure or exit) may be acted on:
    once its output pipe ended (``ended``), or after ``deadline`` seconds
    (``waited``) of a pipe its children keep open."""
    return ended or waited >= deadline
