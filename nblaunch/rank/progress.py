"""Worker-side ``progress()`` and ``log()``: what a rank tells the live view.

Inside a launch, calls only update this rank's state in memory; a daemon
thread sends the latest state (and the metrics logged since) at most
``SEND_HZ`` times a second, so a training step never waits on the kernel and
a busy kernel never blocks a rank. The thread starts with the rank's first
row or metric, or once it uses its GPU: a rank with nothing to report runs
without it. Progress ticks are coalesced (the latest
state always gets through); metric points are kept in a bounded buffer.

Outside a launch both still work: ``progress`` draws a plain text bar on
stderr and ``log`` does nothing, so the same function runs in one process.

Bars the rank's code already has become rows too:
:func:`nblaunch.rank.integrations.tqdm.mirror` (applied when ``tqdm`` is imported
in a rank) makes every console ``tqdm`` bar report like a ``progress``, and keeps its
redraws out of the output: the row shows it live, and the bar's final line
is printed once when it closes (as a terminal would keep it).

The rank side (the worker and the integrations; not for user code):
:func:`begin_rank` once the rank's event channel is up, :func:`torch_imported`,
:func:`new_call` and :func:`finish_call` around each call; a bar of any kind
becomes a row by ``reporter().add(row)`` with a :class:`Row`, and marks each
step of its loop with :func:`count_step`.
"""
from __future__ import annotations

import collections
import itertools
import sys
import threading
import time
from typing import Iterable, Optional, Protocol

from .term import start_thread
from ..wire.channel import GpuMemory, Metrics, Progress, Stopping

__all__ = ["progress", "log"]  # what a user imports; the rank-side API is below, by name

SEND_HZ = 10
GPU_EVERY_S = 1.0
MAX_PENDING_METRICS = 100_000


class Row(Protocol):
    """What the reporter reads a row from: a ``progress`` bar, a mirrored
    tqdm bar, a rich task."""

    def state(self) -> Optional[tuple]:
        """``(desc, n, total, closed, postfix, when)``, or None once the row
        is gone (it ends where it was last sent); ``when`` is the time ``n``
        was true (None: now). Called from the reporter's thread, while the
        rank's code may be updating the row."""


class Reporter:
    """One per rank process: holds the latest state, sent by a daemon thread.

    ``bars`` maps a key to a :class:`Row`; a row that says it is closed is
    sent once more and dropped."""

    def __init__(self, sender, rank: int):
        self._sender = sender
        self._rank = rank
        self.bars: dict[int, object] = {}
        self.metrics: collections.deque = collections.deque(maxlen=MAX_PENDING_METRICS)
        self.step = 0
        self.call = 0  # the live-session call these bars belong to
        self._keys = itertools.count(1)
        self._sent: dict[int, tuple] = {}
        self._wake = threading.Event()
        self._start_lock = threading.Lock()
        self.running = False

    def start(self) -> None:
        """Start the sending thread, once. Not at the rank's birth: a thread
        costs every rank of a launch its start and its end, and most of the
        launch's time per added rank is such per-process work."""
        with self._start_lock:
            if not self.running:
                start_thread(self._loop, "nblaunch-progress")  # the rank's main thread takes the SIGINT
                self.running = True

    def add(self, bar: Row) -> None:
        """Make ``bar`` one of this rank's rows."""
        self.bars[next(self._keys)] = bar
        if not self.running:
            self.start()

    def wake(self) -> None:
        """Send now rather than at the next tick (a row has closed)."""
        self._wake.set()

    def _loop(self) -> None:
        next_gpu = time.monotonic() + GPU_EVERY_S
        complained = False
        told = None  # the stop step the kernel was told of
        while True:
            self._wake.wait(1.0 / SEND_HZ)
            self._wake.clear()
            try:
                # Sent from here, not from the signal handler that agreed on
                # it: the handler may run while the main thread holds the
                # sender's lock.
                stop = (self.call, _stop_at)
                if _agreement is not None and stop != told:
                    self._sender.send(Stopping(self._rank, _stop_at or 0, self.call))
                    told = stop
                self.flush()
                if time.monotonic() >= next_gpu:
                    next_gpu = time.monotonic() + GPU_EVERY_S
                    self.send_gpu_memory()
            except (OSError, EOFError):  # the kernel went away: the rank is about to die anyway
                return
            except Exception as exc:
                # Anything else is passing (a bar read mid-update, a module
                # half imported by the main thread): the rows must keep
                # moving, so the thread lives on and says so once.
                if not complained:
                    complained = True
                    print(f"[nblaunch] progress report failed once, going on: {exc!r}", file=sys.stderr)

    def send_gpu_memory(self) -> None:
        """Where NVML is missing, the kernel cannot see GPU memory without
        initialising CUDA itself (which would rule out forking ranks), so a
        rank that already uses CUDA reads its own, from torch, once a second."""
        reading = _torch_gpu_memory()
        if reading is not None:
            self._sender.send(GpuMemory(self._rank, *reading, self.call))

    def flush(self) -> None:
        """Send every row that changed since it was last sent, and the
        metrics logged since; forget the rows that closed."""
        for key, bar in list(self.bars.items()):
            state = bar.state()
            last = self._sent.get(key)
            if state is None:  # collected without close(): it ended where it was
                state = (*last[:3], True, *last[4:]) if last else None
            if state is not None and state[:5] != (last or ())[:5]:
                desc, n, total, closed, postfix, when = state
                self._sender.send(Progress(self._rank, key, desc, n, total, closed, when or time.time(), postfix,
                                           self.call))
                self._sent[key] = state
            if state is None or state[3]:  # closed: its last state is sent
                self.bars.pop(key, None)
                self._sent.pop(key, None)
        if self.metrics:
            points = []
            while self.metrics:
                points.append(self.metrics.popleft())
            self._sender.send(Metrics(self._rank, tuple(points), self.call))


_reporter: Optional[Reporter] = None
_nvml_present: Optional[bool] = None
# Set by the worker once the main thread has imported torch: before that,
# sys.modules may hold a half-initialised torch (a spawned rank imports it
# while this thread runs), whose attributes do not exist yet.
_torch_ready = False


def _torch_gpu_memory() -> Optional[tuple[int, int, int]]:
    """``(device, bytes reserved by torch, device total)`` when this rank has
    initialised CUDA and NVML is not installed; else None. Never initialises CUDA."""
    global _nvml_present
    if not _torch_ready:
        return None
    torch = sys.modules["torch"]
    if not torch.cuda.is_initialized():
        return None
    if _nvml_present is None:
        try:
            import pynvml  # noqa: F401 - the kernel reads GPUs itself then
            _nvml_present = True
        except ImportError:
            _nvml_present = False
    if _nvml_present:
        return None
    device = torch.cuda.current_device()
    _, total = torch.cuda.mem_get_info(device)
    return device, int(torch.cuda.memory_reserved(device)), int(total)


def begin_rank(sender, rank: int) -> None:
    """Called by the worker once the event channel is up: from now on this
    process is rank ``rank`` (its local rank), whose rows and metrics go to
    ``sender``."""
    global _reporter
    _reporter = Reporter(sender, rank)


def reporter() -> Optional[Reporter]:
    """This rank's reporter; None outside a launch (before :func:`begin_rank`)."""
    return _reporter


def torch_imported() -> None:
    """Called by the worker once torch is imported in the main thread (the
    reporter reads GPU memory from torch only from then on)."""
    global _torch_ready
    _torch_ready = True


def start_if_gpu() -> None:
    """Called by the rank's parent-watch thread at each of its polls: once
    the rank has initialised CUDA, its reporter runs (and reads the GPU's
    memory) whether or not the rank reports anything else."""
    if _reporter is not None and not _reporter.running and _torch_ready:
        if sys.modules["torch"].cuda.is_initialized():
            _reporter.start()


# Loop steps of the current call (every item of a bar's iteration, every
# update() of a progress bar); once the stop button was pressed, how the
# ranks agree on the step they stop at; once agreed, that step.
_steps = 0
_agreement = None
_stop_at: Optional[int] = None


def count_step() -> None:
    """One more step of a loop (called between two items, where the loop
    body has ended and no collective is pending): where a live call's
    interrupt lands once the ranks have agreed on this step."""
    global _steps, _stop_at
    _steps += 1
    if _agreement is not None and _stop_at is None:
        if _reporter is not None and not _reporter.running:  # it tells the kernel the step agreed on
            _reporter.start()
        try:
            _stop_at = _agreement().offer(_steps)
        except Exception:  # the store is gone: the kernel is ending the ranks anyway
            _stop_at = _steps
    if _stop_at is not None and _steps >= _stop_at:
        raise KeyboardInterrupt


def stop_at_a_step(agreement) -> bool:
    """Called in a live rank's SIGINT handler for the stop button. If this
    call's code loops over a bar, the rank goes on to a step that every
    rank agrees on, and returns True: ``KeyboardInterrupt`` then comes at
    that step, between two items. False (interrupt now): this call has no
    loop with a bar. Nothing is done here but note the request (a signal
    handler may run inside a Python callback of a C++ call, such as
    ``backward``); from the next step on, ``agreement()`` is asked for this
    rank's count and the agreed step (see ``rank.interrupts.StepAgreement``)."""
    global _agreement
    if _steps == 0:
        return False
    if _agreement is None:
        _agreement = agreement
    return True


def new_call(call: int) -> None:
    """A live rank starts call ``call``: bars and metrics of the last one
    (an interrupted call may leave bars open) are dropped, not carried over."""
    global _steps, _stop_at, _agreement
    _steps, _stop_at, _agreement = 0, None, None
    if _reporter is not None:
        _reporter.bars.clear()
        _reporter._sent.clear()
        _reporter.metrics.clear()
        _reporter.step = 0
        _reporter.call = call


def finish_call() -> None:
    """Called by the worker before it reports a call's result (or failure):
    send what is left."""
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
        self._closed_at: Optional[float] = None
        self._last_draw = 0.0
        if _reporter is not None:
            _reporter.add(self)

    def state(self) -> tuple:
        """This bar as a :class:`Row`."""
        return self.desc, self.n, self.total, self.closed, "", self._closed_at

    def __iter__(self):
        if self.iterable is None:
            raise TypeError("progress(total=...) without an iterable is used with update()")
        if _reporter is not None:
            # The hot path: an integer add and a step count per item; the reporter thread reads n.
            for item in self.iterable:
                yield item
                self.n += 1
                count_step()
        else:
            for item in self.iterable:
                yield item
                self.update()
        self.close()

    def update(self, k: int = 1) -> None:
        self.n += k
        if _reporter is not None:
            count_step()
        else:
            now = time.monotonic()
            if now - self._last_draw >= 0.1:
                self._last_draw = now
                self._draw()

    def close(self) -> None:
        if self.closed:
            return
        self._closed_at = time.time()
        self.closed = True
        if _reporter is not None:
            _reporter.wake()
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
    if not _reporter.running:
        _reporter.start()
