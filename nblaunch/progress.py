"""Worker-side ``progress()`` and ``log()``: what a rank tells the live view.

Inside a launch, calls only update this rank's state in memory; a daemon
thread sends the latest state (and the metrics logged since) at most
``SEND_HZ`` times a second, so a training step never waits on the kernel and
a busy kernel never blocks a rank. Progress ticks are coalesced (the latest
state always gets through); metric points are kept in a bounded buffer.

Outside a launch both still work: ``progress`` draws a plain text bar on
stderr and ``log`` does nothing, so the same function runs in one process.
"""
from __future__ import annotations

import collections
import sys
import threading
import time
from typing import Iterable, Optional

from .channel import Metrics, Progress

__all__ = ["progress", "log"]

SEND_HZ = 10
MAX_PENDING_METRICS = 100_000


class _Reporter:
    """One per rank process: holds the latest state, sent by a daemon thread."""

    def __init__(self, sender, rank: int):
        self._sender = sender
        self._rank = rank
        self.bars: dict[int, "progress"] = {}
        self.metrics: collections.deque = collections.deque(maxlen=MAX_PENDING_METRICS)
        self.step = 0
        self._sent: dict[int, tuple] = {}
        self._wake = threading.Event()
        threading.Thread(target=self._loop, name="nblaunch-progress", daemon=True).start()

    def _loop(self) -> None:
        while True:
            self._wake.wait(1.0 / SEND_HZ)
            self._wake.clear()
            try:
                self.flush()
            except Exception:  # the kernel went away: the rank is about to die anyway
                return

    def flush(self) -> None:
        for key, bar in list(self.bars.items()):
            state = (bar.n, bar.total, bar.desc, bar.closed)
            if self._sent.get(key) != state:
                self._sender.send(Progress(self._rank, key, bar.desc, bar.n, bar.total, bar.closed, time.time()))
                self._sent[key] = state
        if self.metrics:
            points = []
            while self.metrics:
                points.append(self.metrics.popleft())
            self._sender.send(Metrics(self._rank, tuple(points)))


_reporter: Optional[_Reporter] = None


def _start(sender, rank: int) -> None:
    """Called by the worker once the event channel is up."""
    global _reporter
    _reporter = _Reporter(sender, rank)


def _finish() -> None:
    """Called by the worker before it reports its result: send what is left."""
    if _reporter is not None:
        _reporter.flush()


class progress:
    """Wrap an iterable like ``tqdm``, or use as ``with progress(total=N) as bar: bar.update()``.

    ``total`` defaults to ``len(iterable)`` where it has one.
    """

    def __init__(self, iterable: Optional[Iterable] = None, total: Optional[int] = None,
                 desc: Optional[str] = None):
        self.iterable = iterable
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            total = len(iterable)
        self.total = total
        self.desc = desc or ""
        self.n = 0
        self.closed = False
        self._last_draw = 0.0
        if _reporter is not None:
            _reporter.bars[id(self)] = self

    def __iter__(self):
        if self.iterable is None:
            raise TypeError("progress(total=...) without an iterable is used with update()")
        if _reporter is not None:
            # The hot path: one integer add per item; the reporter thread reads n.
            for item in self.iterable:
                yield item
                self.n += 1
        else:
            for item in self.iterable:
                yield item
                self.update()
        self.close()

    def update(self, k: int = 1) -> None:
        self.n += k
        if _reporter is None:
            now = time.monotonic()
            if now - self._last_draw >= 0.1:
                self._last_draw = now
                self._draw()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if _reporter is not None:
            _reporter._wake.set()
        else:
            self._draw(final=True)

    def __enter__(self) -> "progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __len__(self) -> int:
        return self.total or 0

    def _draw(self, final: bool = False) -> None:
        total = f"/{self.total}" if self.total else ""
        frac = min(1.0, self.n / self.total) if self.total else 0.0
        bar = ("#" * int(frac * 20)).ljust(20, ".") if self.total else ""
        label = f"{self.desc}: " if self.desc else ""
        sys.stderr.write(f"\r{label}[{bar}] {self.n}{total}" + ("\n" if final else ""))
        sys.stderr.flush()


def log(step: Optional[int] = None, **scalars: float) -> None:
    """Report metrics (``loss=..., lr=...``) at ``step`` (default: one more
    than the last). A no-op outside a launch."""
    if _reporter is None:
        return
    if step is None:
        step = _reporter.step + 1
    _reporter.step = step
    values = {}
    for name, value in scalars.items():
        try:
            values[name] = float(value)  # tensors, numpy scalars
        except (TypeError, ValueError):
            raise TypeError(f"log({name}=...) takes numbers, got {type(value).__name__}") from None
    _reporter.metrics.append((step, time.time(), values))
