"""The text view: ``[rank N] line`` per line, a status line now and then,
and a final summary (a terminal, ``display="text"``, or no widgets)."""
from __future__ import annotations

import os
import sys
import time
from typing import Optional, TextIO

from . import ansi
from .base import View, in_kernel
from .state import MAX_RATE, STATUS_EVERY_S, clip

__all__ = ["TextDisplay"]


class TextDisplay(View):
    """Plain text: ``[rank N] line`` per line, a status line now and then,
    and a final summary. ``show_status=False`` prints rank output only."""

    def __init__(self, stream: Optional[TextIO] = None, show_status: bool = True):
        super().__init__()
        self._stream = stream
        self._show_status = show_status
        self._pending: list[str] = []
        self._last_write = 0.0
        self._last_status = time.monotonic()
        self._strip: Optional[bool] = None  # strip ANSI escapes (decided on first output)

    @property
    def stream(self) -> TextIO:
        return self._stream or sys.stdout  # looked up late: the cell's stream

    def begin(self, world_size: int, method: str, backend: str, log_dir: str, call: int = 0) -> None:
        super().begin(world_size, method, backend, log_dir, call)
        if self._show_status:  # at once: a quiet first minute should not look like a hang
            what = f"call {call} on {world_size} live ranks" if call else f"starting {world_size} ranks"
            self._pending.append(f"[nblaunch] {what} ({method}, "
                                 f"{backend or 'no process group'}); full output: {log_dir}\n")
            self.flush()

    def rank_lines(self, rank: int, lines: list[str]) -> None:
        rank = self.state.label(rank)
        if self._strip is None:
            self._strip = not _renders_colour(self.stream)
        self._pending.extend(self._tagged(rank, self._admit(rank, lines)))

    def _tagged(self, rank: int, lines: list[str]) -> list[str]:
        shown = [clip(line) for line in lines]
        if self._strip:
            shown = [ansi.strip(line) for line in shown]
        return [f"[rank {rank}] {line}\n" for line in shown]

    def notice(self, text: str) -> None:
        self.state.notices.append(text)
        self._pending.append(f"[nblaunch] {text}\n")
        self.flush()

    def tick(self, force: bool = False) -> None:
        now = time.monotonic()
        if self._show_status and self.state.has_progress and now - self._last_status >= STATUS_EVERY_S:
            self._last_status = now
            self._pending.append(f"[nblaunch] {self.state.elapsed():.0f} s | {self.state.summary()}\n")
        if (self._pending or self._hidden) and (force or now - self._last_write >= 1.0 / MAX_RATE):
            self.flush()

    def flush(self) -> None:
        self._pending.extend(f"{notice}\n" for notice in self._hidden_notices())
        if self._pending:
            text, self._pending = "".join(self._pending), []
            self.stream.write(text)
            self.stream.flush()
        self._last_write = time.monotonic()

    def close(self, state: str) -> None:
        self.state.end(state)
        last = self._last_unshown()  # after the count of the lines left out, each rank's last ones
        self._pending.extend(f"{notice}\n" for notice in self._hidden_notices())
        for rank, line in last:
            self._pending.extend(self._tagged(rank, [line]))
        if self._show_status:
            summary = f" | {self.state.summary()}" if self.state.has_progress else ""
            self._pending.append(f"[nblaunch] {state} in {self.state.elapsed():.1f} s{summary}\n"
                                 f"[nblaunch] full output: {self.state.log_dir}\n")
        self.flush()


def _renders_colour(stream) -> bool:
    """Terminals and Jupyter front ends (which render ANSI colours in stream
    output) keep colours; files and pipes get plain text."""
    if in_kernel() and type(stream).__module__.startswith("ipykernel"):
        return True
    try:
        return stream.isatty() and os.environ.get("TERM") != "dumb"
    except (AttributeError, ValueError):
        return False
