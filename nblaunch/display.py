"""Rendering a launch for the person watching it.

The supervisor calls a display from the cell's own thread (the one running
``notebook_launcher``), so ipykernel routes everything it prints to that cell
on every ipykernel version, with no parent-header juggling in other threads.

``TextDisplay`` prints each rank's output as whole lines tagged by rank.
Lines are batched and written at most ``max_rate`` times a second so a rank
that floods cannot flood the notebook's message channel.
"""
from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["TextDisplay"]


class TextDisplay:
    """Plain text: ``[rank N] line`` for every line a rank prints."""

    def __init__(self, stream: TextIO | None = None, max_rate: float = 10.0):
        self._stream = stream
        self._pending: list[str] = []
        self._interval = 1.0 / max_rate
        self._last_write = 0.0

    @property
    def stream(self) -> TextIO:
        return self._stream or sys.stdout  # looked up late: the cell's stream

    def rank_lines(self, rank: int, lines: list[str]) -> None:
        prefix = f"[rank {rank}] "
        self._pending.extend(prefix + line + "\n" for line in lines)

    def notice(self, text: str) -> None:
        self._pending.append(f"[nblaunch] {text}\n")
        self.flush()

    def tick(self, force: bool = False) -> None:
        """Write what is pending if the rate limit allows (or ``force``)."""
        if self._pending and (force or time.monotonic() - self._last_write >= self._interval):
            self.flush()

    def flush(self) -> None:
        if not self._pending:
            return
        text, self._pending = "".join(self._pending), []
        self.stream.write(text)
        self.stream.flush()
        self._last_write = time.monotonic()

    def close(self) -> None:
        self.flush()

