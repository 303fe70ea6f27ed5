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

import pickle
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Optional, Union

__all__ = ["RELEASE", "CLOSE", "Interrupt", "Call", "Answer", "Started", "Result", "Failure", "Progress", "Metrics",
           "GpuMemory", "Stopping", "Phase", "Prompt", "Paused", "Event", "EventSender", "decode"]


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


Event = Union[Started, Result, Failure, Progress, Metrics, GpuMemory, Stopping, Phase, Prompt, Paused]


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


def decode(data: bytes) -> Event:
    event = pickle.loads(data)
    if not isinstance(event, (Started, Result, Failure, Progress, Metrics, GpuMemory, Stopping, Phase, Prompt, Paused)):
        raise TypeError(f"unexpected event type {type(event).__name__}")
    return event
