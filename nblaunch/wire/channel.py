"""The worker -> kernel event stream.

Each rank gets two inherited, one-way pipes from the kernel (no listening
address exists, so no other process can write to them):

* an *output* pipe that becomes the rank's file descriptors 1 and 2, so every
  byte the rank or its C libraries print reaches the kernel even if the rank is
  killed the next instant;
* an *event* pipe carrying the small pickled records below.

Events are plain frozen dataclasses of this module, so the kernel unpickles
only types it knows plus what the rank's own result/exception contains.
"""
from __future__ import annotations

import os
import pickle
import select
import struct
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Optional, Union

__all__ = ["RELEASE", "CLOSE", "Interrupt", "Call", "Answer", "Started", "Result", "Failure", "Progress", "Metrics",
           "GpuMemory", "Stopping", "Phase", "Prompt", "Paused", "Preempting", "Event", "EventSender", "EventReader", "decode",
           "ROUTINE"]


@dataclass(frozen=True)
class Started:
    rank: int
    pid: int
    time: float


@dataclass(frozen=True)
class Result:
    """``payload`` is fn's return value pickled with torch's sharing
    reductions: tensor storages travel as shared memory, fetched from the
    rank when the kernel unpickles it (the rank waits for ``RELEASE`` on its
    go pipe before leaving). ``shared``: bytes of tensor data in shared memory."""

    rank: int
    payload: bytes
    shared: int = 0
    call: int = 0  # which call this ends (0: a launch's only call, or live ranks' set-up)
    seq: int = -1  # collectives this rank has issued on the default group (-1: unknown)
    time: float = 0.0  # when fn ended, on the rank's clock
    exited: bool = False  # fn ended with sys.exit(0) rather than a return


RELEASE = "release"  # kernel -> rank, on the go pipe: the result was taken
CLOSE = "close"  # kernel -> a live rank, on the go pipe: leave


@dataclass(frozen=True)
class Interrupt:
    """Kernel -> a live rank: stop the call you are on (``how``: see
    ``rank.interrupts.CallInterrupt``). Not written on the pipe: the rank's
    pool delivers it as a file and SIGINT, which reach a rank that is not
    reading its pipe."""
    how: str


@dataclass(frozen=True)
class Call:
    """Kernel -> a rank: run ``job`` as call number ``id``. A live rank
    gets each on its go pipe (``job``: a :func:`nblaunch.rank.namespace.pack_call`
    payload); a launch's rank has its one call, number 0, from the start
    (``job``: ``(fn, args, kwargs)`` when forked, else a ``PackedJob``).
    ``timeout``: the call's, which its collectives' timeout follows."""

    id: int
    job: object
    timeout: Optional[float] = None


@dataclass(frozen=True)
class Failure:
    rank: int
    time: float
    exc_type: str
    message: str
    traceback: str
    exception: Optional[bytes]  # pickled exception object, when it pickles
    phase: str  # "setup", "load", "fn" or "result"
    call: int = 0
    seq: int = -1
    frames: Optional[bytes] = None  # rank.postmortem.snapshot: what %debug needs of the failing frames


@dataclass(frozen=True)
class Phase:
    """What a rank is doing before its first step: ``importing torch``,
    ``joining the process group``, ``in fn``."""

    rank: int
    what: str
    call: int = 0


@dataclass(frozen=True)
class Progress:
    """The latest state of one progress bar of a rank (``key`` tells bars apart)."""

    rank: int
    key: int
    desc: str
    n: int
    total: Optional[int]
    closed: bool
    time: float
    postfix: str = ""  # a tqdm bar's postfix ("loss=0.12, lr=1e-3")
    call: int = 0


@dataclass(frozen=True)
class Metrics:
    """Metric points logged since the last send: ``(step, time, {name: value})``."""

    rank: int
    points: tuple
    call: int = 0


@dataclass(frozen=True)
class GpuMemory:
    """A rank's own reading of its GPU memory (``torch.cuda``), sent only
    where the kernel cannot read it through NVML."""

    rank: int
    device: int
    used: int  # bytes the rank's caching allocator holds
    total: int
    call: int = 0


@dataclass(frozen=True)
class Stopping:
    """A live rank was interrupted inside a progress loop and stops, with
    its peers, once the loop has made ``at`` steps in this call (a step
    boundary, where no collective is pending); ``at`` is 0 while the ranks
    are still agreeing on it."""

    rank: int
    at: int
    call: int = 0


@dataclass(frozen=True)
class Preempting:
    """SIGTERM reached the rank from outside nblaunch (``by``: the sender's
    pid): SLURM's preemption, ``scancel``, the time limit. The kernel tells
    every rank (:mod:`nblaunch.rank.term`)."""

    rank: int
    signal: str
    by: int = 0


@dataclass(frozen=True)
class Prompt:
    """A rank's debugger waits for a command: ``text`` is what it printed
    since its last prompt, ``prompt`` the prompt itself. The rank then waits
    for an :class:`Answer` on its go pipe."""

    rank: int
    text: str
    prompt: str
    call: int = 0


@dataclass(frozen=True)
class Paused:
    """A rank's debugger session began (``paused``) or ended (it continued
    or quit): while one is paused, its peers wait and no timer of the call runs."""

    rank: int
    paused: bool
    where: str = ""  # ``file:line in function`` where it stopped
    call: int = 0
    text: str = ""  # ending: what the debugger printed after its last prompt


@dataclass(frozen=True)
class Answer:
    """Kernel -> a rank at a debugger prompt, on its go pipe: the line typed,
    or None when no one can answer here (no stdin in the front end)."""

    line: Optional[str]


Event = Union[Started, Result, Failure, Progress, Metrics, GpuMemory, Stopping, Phase, Prompt, Paused, Preempting]


class EventSender:
    """Worker-side end of the event pipe. Thread-safe (the rank's main thread
    and its progress reporter both send); ``send`` never drops."""

    def __init__(self, conn: Connection):
        self._conn = conn
        self._lock = threading.Lock()

    def send(self, event: Event) -> None:
        data = pickle.dumps(event, protocol=pickle.HIGHEST_PROTOCOL)
        with self._lock:
            self._conn.send_bytes(data)


_EVENTS = (Started, Result, Failure, Progress, Metrics, GpuMemory, Stopping, Phase, Prompt, Paused, Preempting)
#: What a rank reports as it goes (its bars, metrics, GPU memory): the view
#: wants the latest, and nothing waits on it. Every other event decides
#: something (a result, a failure, a debugger prompt) and is read at once.
ROUTINE = (Progress, Metrics, GpuMemory)


def decode(data: bytes) -> Event:
    event = pickle.loads(data)
    if not isinstance(event, _EVENTS):
        raise TypeError(f"unexpected event type {type(event).__name__}")
    return event


_SIZE = struct.Struct("!i")
_LARGE = struct.Struct("!Q")
READ_BYTES = 1 << 20


class EventReader:
    """The kernel's end of a rank's event pipe, read without blocking:
    ``read()`` returns every event whole in the pipe now, in one or a few
    system calls however many there are (a ``Connection.recv_bytes`` per
    event, with a poll before each, cost the kernel a selector per event).

    The frames are ``multiprocessing.connection.Connection``'s
    (``send_bytes``: a signed 4-byte big-endian length, or -1 and an
    8-byte one), so the rank's side stays a plain ``Connection``. A frame
    still being written stays in the buffer until it is whole."""

    def __init__(self, conn: Connection):
        self.conn = conn
        self.fileno = self._fd = conn.fileno()
        os.set_blocking(self._fd, False)
        self._buffer = bytearray()
        self.open = True

    def read(self) -> list[Event]:
        """The events now in the pipe; ``open`` is False once the rank's end
        closed. A frame begun is read to its end (a large result), as
        ``recv_bytes`` would: the rank is writing the rest."""
        events: list[Event] = []
        while self.open:
            try:
                data = os.read(self._fd, READ_BYTES)
            except BlockingIOError:
                if not self._buffer:
                    break
                _readable(self._fd, 1.0)
                continue
            except OSError:
                data = b""
            if not data:
                self.open = False
                break
            self._buffer += data
            self._frames(events)
            if len(data) < READ_BYTES and not self._buffer:
                break
        return events

    def _frames(self, events: list) -> None:
        """Decode the whole frames in the buffer; keep what follows them."""
        buf, at = self._buffer, 0
        with memoryview(buf) as view:
            while len(buf) - at >= _SIZE.size:
                size, head = _SIZE.unpack_from(buf, at)[0], at + _SIZE.size
                if size == -1:
                    if len(buf) - head < _LARGE.size:
                        break
                    size, head = _LARGE.unpack_from(buf, head)[0], head + _LARGE.size
                if len(buf) < head + size:
                    break
                with view[head:head + size] as body:
                    events.append(decode(body))
                at = head + size
        if at:
            del buf[:at]


def _readable(fd: int, timeout: float) -> None:
    poller = select.poll()  # not select.select: a kernel with many ranks has descriptors past FD_SETSIZE
    poller.register(fd, select.POLLIN)
    poller.poll(timeout * 1000)
