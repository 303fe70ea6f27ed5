"""Exception types raised in the kernel when a launch fails.

A launch that fails raises one :class:`WorkerError`. It names the rank that
failed *first* (the root cause) and carries that rank's own traceback; the
other ranks' failures are kept in ``.failures`` and listed briefly after it.
"""
from __future__ import annotations

import re
import time
import signal as _signal
import dataclasses
import json
import pickle
from dataclasses import dataclass, field
from typing import Any, Optional

from .rank.spec import current_spec
from .rank.frames import in_notebook_terms, is_machinery, parse_frame

__all__ = ["LaunchError", "LaunchTimeout", "WorkerError", "Preempted", "RunStopped", "RankFailure", "Departure"]


class LaunchError(RuntimeError):
    """Base class of every error nblaunch raises about a launch itself."""

    def _render_traceback_(self) -> list[str]:
        # IPython calls this instead of formatting the traceback: the frames
        # are the launcher's own, and the message already says what happened.
        return [f"{type(self).__name__}: {line}" if i == 0 else line for i, line in enumerate(str(self).splitlines())]


class LaunchTimeout(LaunchError):
    """The launch (or a call on live ranks) ran past its ``timeout``; the
    ranks were stopped. ``log_dir``: where each rank's full output is kept."""

    def __init__(self, message: str, log_dir: Optional[str] = None):
        super().__init__(message)
        self.log_dir = log_dir

    def __reduce__(self):
        return (type(self), (str(self), self.log_dir))


class Preempted(LaunchError):
    """The launch was preempted (SIGTERM or SIGUSR1 reached the kernel, a
    node's agent or, from outside nblaunch, a rank: what SLURM sends on
    preemption, ``scancel``, the time limit, ``--signal=USR1@60``) and its
    ranks did not all return within the grace period; they were then
    stopped (or ended by whoever sent the notice, SLURM's SIGKILL). ``signal`` names what came, ``step`` the
    furthest step a rank's progress bar reached (None: no bar), ``returned``
    the global ranks that did return, ``log_dir`` where each rank's output is."""

    def __init__(self, message: str, signal: str = "", step: Optional[int] = None,
                 returned: tuple = (), log_dir: Optional[str] = None):
        super().__init__(message)
        self.signal, self.step, self.returned, self.log_dir = signal, step, tuple(returned), log_dir

    def __reduce__(self):
        return (type(self), (str(self), self.signal, self.step, self.returned, self.log_dir))


class RunStopped(LaunchError):
    """What ``result()`` raises for a background run ended by ``run.stop()``:
    every rank was stopped. ``run_id`` names the run, ``where`` is each
    rank's stack as it was stopped ("" where not known), ``log_dir`` where
    each rank's output is. Raised by the call watch when its owner asks it
    to stop (``CallWatch(stop_requested=...)``)."""

    def __init__(self, run_id: str = "", where: str = "", log_dir: Optional[str] = None):
        run = f"run {run_id} was stopped (run.stop()); " if run_id else "run.stop(): "
        at = f"; where each rank was (innermost frame first):\n{where}\n" if where else ". "
        super().__init__(f"{run}every rank was stopped{at}Full output: {log_dir}")
        self.run_id, self.where, self.log_dir = run_id, where, log_dir

    def named(self, run_id: str) -> "RunStopped":
        """The same stop, said of run ``run_id``."""
        return RunStopped(run_id, self.where, self.log_dir)

    def __reduce__(self):
        return (type(self), (self.run_id, self.where, self.log_dir))


def timed_out(what: str, timeout: float, where: str, then: str, log_dir) -> LaunchTimeout:
    """``what`` (the launch, a call) did not finish within ``timeout``: where
    each rank was, and ``then``, what became of the ranks."""
    return LaunchTimeout(f"{what} did not finish within {timeout:g} s; where each rank was (innermost frame "
                         f"first):\n{where}\n{then} Full output: {log_dir}", log_dir=str(log_dir))


def refuse_inside_a_rank(what: str) -> None:
    """The one rule for every door (a launch, a submit, live ranks): it is
    called from the notebook; from a rank's code it is refused at once."""
    spec = current_spec()
    if spec is not None:
        raise LaunchError(f"{what} was called inside rank {spec.rank} of a running launch; nested launches are "
                          "not supported. Call it from the notebook instead.")


def render_interrupt(exc: KeyboardInterrupt, lines: list[str]) -> None:
    """Have IPython show ``lines`` for an interrupt instead of the launcher's
    frames; it stays a plain ``KeyboardInterrupt`` to code that catches it."""
    exc._render_traceback_ = lambda: list(lines)


NBLAUNCH_ENDED = ("stopped", "interrupted")  # kinds nblaunch caused: never a root cause


@dataclass(frozen=True)
class RankFailure:
    """What is known about one rank that did not return a result.

    ``kind`` is ``"exception"`` (fn or the set-up raised), ``"signal"`` (the
    process died from a signal it did not expect), ``"exit"`` (it exited with a
    code and no report), ``"interrupted"`` (on live ranks: nblaunch
    interrupted its call after another rank failed; the rank lives on),
    ``"stopped"`` (nblaunch stopped it after another
    rank failed), ``"left"`` (it returned or exited with code 0 while its
    peers still waited for it in a collective; ``message`` says how and
    where they waited) or ``"node"`` (another node's launcher was interrupted or
    timed out; ``rank`` is that node's first rank). ``time`` is the wall-clock time the failure was observed:
    inside the rank for exceptions, in the kernel for deaths.
    """

    rank: int
    kind: str
    time: float
    exc_type: str = ""
    message: str = ""
    remote_traceback: str = ""
    exitcode: Optional[int] = None
    signal: Optional[int] = None
    last_lines: tuple[str, ...] = ()
    node: Optional[int] = None  # set in a multi-node launch
    host: Optional[str] = None  # the machine, where the pool knows it (a cluster's node name)
    exception: Optional[BaseException] = field(default=None, compare=False, repr=False)
    frames: Optional[bytes] = field(default=None, compare=False, repr=False)  # rank.postmortem.snapshot

    @property
    def label(self) -> str:
        """``rank 3``; in a multi-node launch ``rank 3 on n2`` (its host, when
        known) or ``rank 3 (node 1)``."""
        if self.host:
            return f"rank {self.rank} on {self.host}"
        return f"rank {self.rank}" + (f" (node {self.node})" if self.node is not None else "")

    @property
    def signal_name(self) -> str:
        return _signal_name(self.signal) if self.signal else ""

    @property
    def is_consequence(self) -> bool:
        """True when this failure is most likely caused by another rank's.

        A rank whose peer died sees its collective fail with a transport error
        ("Connection closed by peer" in gloo, "remote process exited" in NCCL);
        that error is real but it is not the root cause.
        """
        if self.kind in NBLAUNCH_ENDED:
            return True
        if self.kind != "exception":
            return False
        text = f"{self.exc_type}: {self.message}"
        return bool(_PEER_LOSS.search(text))

    def summary(self) -> str:
        """One line: what happened to this rank."""
        if self.kind == "exception":
            gpu = " (the GPU ran out of memory)" if self.exc_type.endswith("OutOfMemoryError") else ""
            return f"{self.label} raised {self.exc_type}{gpu}: {self.message}".rstrip()
        if self.kind == "signal":
            return f"{self.label} was killed by {self.signal_name}" + (
                " (the out-of-memory killer is the usual sender)"
                if self.signal == _signal.SIGKILL
                else ""
            )
        if self.kind == "node":  # the launcher of a whole node ended its ranks
            who = f"node {self.node} " if self.node is not None else ""  # None: a machine no node of the job
            return f"{who}{self.message}; its ranks were stopped"
        if self.kind == "stopped":
            return f"{self.label} was stopped by nblaunch after the failure above"
        if self.kind == "left":
            return f"{self.label} {self.message}"
        if self.kind == "interrupted":
            return f"{self.label}: its call was interrupted by nblaunch after the failure above (the rank is kept)"
        return f"{self.label} exited with code {self.exitcode} without returning a result"

    def brief(self) -> str:
        """A few words, for a restart's line: ``rank 1 on n2 killed by SIGKILL``, ``node n3 lost``."""
        if self.kind == "exception":
            return f"{self.label} raised {self.exc_type}"
        if self.kind == "signal":
            return f"{self.label} killed by {signal_name_of(self.signal)}"
        if self.kind == "node" and (self.host or self.node is not None):
            return f"node {self.host or self.node} lost"
        if self.kind == "exit":
            return f"{self.label} exited with code {self.exitcode}"
        return self.summary()

    @property
    def row(self) -> str:
        """How the view's row of this rank ends: ``stopped``/``interrupted``
        when nblaunch ended it, else ``failed``."""
        return self.kind if self.kind in NBLAUNCH_ENDED else "failed"


# -- every way a RankFailure is made ------------------------------------------

def reported(rank: int, node: Optional[int], time: float, exc_type: str, message: str, traceback: str,
             exception: Optional[bytes], interrupted: bool = False, frames: Optional[bytes] = None) -> RankFailure:
    """A rank's own report of an exception (``channel.Failure``). On live
    ranks, a ``KeyboardInterrupt`` nblaunch asked for is kind
    ``interrupted``: the rank is kept, and it is no one's root cause."""
    if interrupted and exc_type == "KeyboardInterrupt":
        return RankFailure(rank, "interrupted", time, exc_type=exc_type, remote_traceback=traceback, node=node)
    try:
        exc = pickle.loads(exception) if exception is not None else None
    except Exception:
        exc = None
    return RankFailure(rank, "exception", time, exc_type=exc_type, message=message, remote_traceback=traceback,
                       exception=exc, exitcode=1, node=node, frames=frames)  # the worker's exit code after a report


def unreadable_result(rank: int, node: Optional[int], time: float, exc: BaseException) -> RankFailure:
    """A result the kernel could not take (unpicklable here, or over the limit)."""
    why = str(exc) if isinstance(exc, ValueError) and "NBLAUNCH_MAX_RESULT_BYTES" in str(exc) else (
        f"the result of rank {rank} could not be unpickled in the kernel: {exc}")
    return RankFailure(rank, "exception", time, exc_type=type(exc).__qualname__, message=why, node=node)


def death(rank: int, node: Optional[int], time: float, code: int, stopped: bool, signals_sent: set,
          last_lines: tuple) -> RankFailure:
    """A rank that ended without a result or a report. Stopped by nblaunch
    (``stopped``: it was signalled while still in its call) unless it died of
    a signal nblaunch never sent: a segfault, or a SIGKILL from elsewhere
    between nblaunch's SIGTERM and its SIGKILL."""
    sig = -code if code < 0 else None
    if stopped and not (sig is not None and sig not in signals_sent):
        return RankFailure(rank, "stopped", time, exitcode=code, signal=sig, last_lines=last_lines, node=node)
    if sig is not None:
        return RankFailure(rank, "signal", time, exitcode=code, signal=sig, last_lines=last_lines, node=node)
    return RankFailure(rank, "exit", time, exitcode=code, last_lines=last_lines, node=node)


def on_host(failure: RankFailure, host: Optional[str]) -> RankFailure:
    """The failure of a rank on a node named ``host`` (None: not known),
    labelled ``rank 3 on n2``."""
    if host is None or failure.host is not None or failure.node is None:
        return failure
    return dataclasses.replace(failure, host=host)


def node_lost(rank: int, node: Optional[int], time: float, what: str) -> RankFailure:
    """A failure of kind ``"node"``: the ranks of a node ended for a reason
    outside them, named by ``what``. A cluster launch's rank whose machine
    left (its agent's connection closed, or the engine ended its node), or
    a node's launcher that ended its ranks (interrupted, timed out; ``rank``
    is then the node's first rank, told to the other nodes)."""
    return RankFailure(rank, "node", time, message=what, node=node)


MAX_RECORD_TRACEBACK = 65536


def to_record(failure: RankFailure) -> str:
    """A failure as JSON, to tell other nodes (the exception object stays here)."""
    record = {k: v for k, v in dataclasses.asdict(dataclasses.replace(failure, exception=None, frames=None)).items()
              if k not in ("exception", "frames")}
    record["remote_traceback"] = record["remote_traceback"][-MAX_RECORD_TRACEBACK:]
    return json.dumps(record)


def from_record(text: Any) -> RankFailure:
    record = json.loads(text)
    record["last_lines"] = tuple(record.get("last_lines") or ())
    return RankFailure(**record)


# Transport errors a rank sees when a *peer* went away first. Matched on the
# exception text because gloo and NCCL raise plain RuntimeError/DistBackendError.
_PEER_LOSS = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|"
    r"remote process exited|NCCL communicator was aborted|"
    r"ProcessGroupGloo.*(?:recv|send|connect)|Socket Timeout|"
    r"DistNetworkError|TCPStore.*(?:closed|reset)",
    re.IGNORECASE,
)


def signal_name_of(num: Optional[int]) -> str:
    """``SIGKILL`` (a bare name, for short lines)."""
    try:
        return _signal.Signals(num).name
    except (ValueError, TypeError):
        return f"signal {num}"


def _signal_name(num: int) -> str:
    try:
        return f"{_signal.Signals(num).name}({-num})"
    except ValueError:
        return f"signal {num}"


def _split_fatal(lines: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """A rank's last lines, split into what it printed and, when it died in
    C (faulthandler's "Fatal Python error" report), where: the error and the
    crashing thread's own frames. The whole report is already in the rank's
    output just above; the error keeps the part a reader needs, once."""
    start = next((i for i, line in enumerate(lines) if line.startswith("Fatal Python error")), None)
    if start is None:
        return list(lines), []
    printed = list(lines[:start])[-10:]
    crash = [lines[start].removeprefix("Fatal Python error: ")]
    rest = list(lines[start + 1:])
    head = next((i for i, line in enumerate(rest)
                 if line.startswith(("Current thread", "Stack (most recent call first)"))), None)
    if head is not None:
        for line in rest[head + 1:]:
            if not line.strip():
                break
            frame = parse_frame(line)
            if frame is None or not is_machinery(frame[0]):
                crash.append(line)
    return printed, crash


@dataclass(frozen=True)
class Departure:
    """A rank that ended its part of a call without an error: ``how`` is
    ``"returned"``, ``"exited (code 0)"`` (``sys.exit(0)``, ``os._exit(0)``)."""

    rank: int
    time: float
    how: str
    node: Optional[int] = None
    exitcode: Optional[int] = None  # 0 when it exited, None when it returned

    @classmethod
    def of_return(cls, rank: int, node: Optional[int], when: Optional[float], exited: bool) -> "Departure":
        """A rank whose result arrived (``exited``: it then left with code 0)."""
        return cls(rank, when or time.time(), "exited (code 0)" if exited else "returned", node,
                   exitcode=0 if exited else None)


# The innermost frame of torch.distributed's collectives in a traceback.
_COLLECTIVE_FRAME = re.compile(r'distributed_c10d\.py", line \d+,? in (\w+)')


def collective_in(traceback: str) -> Optional[str]:
    """The torch.distributed call a (most recent call last) traceback was in."""
    names = _COLLECTIVE_FRAME.findall(traceback or "")
    return names[-1] if names else None


def left_early(departure: Departure, waiting: dict[str, Optional[str]]) -> RankFailure:
    """The failure of a rank that left while others (``label -> the
    collective each was in``) still waited for it."""
    names = sorted({name for name in waiting.values() if name})
    where = " or ".join(names) if names else "a collective"
    labels = list(waiting)
    if len(labels) == 1:
        who = f"{labels[0]} was"
    else:  # "ranks 0 and 2", "ranks 0 (node 0), 3 (node 1) and 5 (node 1)"
        numbers = [label.removeprefix("rank ") for label in labels]
        who = f"ranks {', '.join(numbers[:-1])} and {numbers[-1]} were"
    return RankFailure(departure.rank, "left", departure.time, node=departure.node, exitcode=departure.exitcode,
                       message=f"{departure.how} while {who} in {where}")


def blame_departures(failures: list[RankFailure], departures: list[Departure]) -> list[RankFailure]:
    """A rank that leaves a collective early (an early-stopping path, a
    ``main()`` that exits) gives its peers a transport error ("Connection
    closed by peer") and no error of its own. When those errors are all the
    failures there are, the first rank that left is the cause: its failure
    is added (and an ``os._exit(0)``'s bare exit is replaced by it)."""
    exits = [f for f in failures if f.kind == "exit" and f.exitcode == 0]
    others = [f for f in failures if f not in exits]
    peer_lost = [f for f in others if f.kind == "exception" and f.is_consequence]
    if not peer_lost or any(not f.is_consequence for f in others):
        return failures
    gone = departures + [Departure(f.rank, f.time, "exited (code 0)", f.node, exitcode=0) for f in exits]
    if not gone:
        return failures
    first = min(gone, key=lambda d: d.time)
    waiting = {f.label: collective_in(f.remote_traceback) for f in sorted(peer_lost, key=lambda f: f.rank)}
    return others + [left_early(first, waiting)]


def root_cause(failures: list[RankFailure]) -> RankFailure:
    """The failure to blame: the earliest that is not a consequence of another;
    failing that, the earliest that a rank reported (not one nblaunch caused)."""
    primary = [f for f in failures if not f.is_consequence]
    reported = [f for f in failures if f.kind not in NBLAUNCH_ENDED]
    return min(primary or reported or failures, key=lambda f: f.time)


class WorkerError(LaunchError):
    """One or more ranks failed; the first one to fail is the subject.

    Attributes: ``rank`` (global), ``node`` (None on one machine), ``exitcode``, ``signal``, ``remote_traceback`` (of the
    root-cause rank), ``failures`` (every rank that did not return, root cause
    first), ``log_dir`` (where each rank's full output is kept), ``note`` (on
    live ranks: what became of them), ``attempts`` (with ``max_restarts``:
    one line per earlier generation, what ended it; this error is the last
    attempt's). When the rank's exception could be sent back it is chained
    as ``__cause__``.
    """

    def __init__(self, failures: list[RankFailure], log_dir: Optional[str] = None, note: str = "",
                 attempts: tuple = ()):
        cause = root_cause(failures)
        others = sorted((f for f in failures if f is not cause), key=lambda f: f.rank)
        self.failures = [cause, *others]
        self.rank = cause.rank
        self.node = cause.node
        self.exitcode = cause.exitcode
        self.signal = cause.signal
        self.remote_traceback = cause.remote_traceback
        self.log_dir = log_dir
        self.note = note
        self.attempts = tuple(attempts)
        super().__init__(self._render())

    @property
    def root(self) -> RankFailure:
        return self.failures[0]

    def _render_lines(self) -> list[str]:
        cause = self.root
        lines = [cause.summary()]
        if cause.remote_traceback:
            lines += ["", f"Traceback from {cause.label}:", in_notebook_terms(cause.remote_traceback.rstrip())]
        if cause.kind != "exception" and cause.last_lines:
            printed, crash = _split_fatal(cause.last_lines)
            if printed:
                lines += ["", f"Last lines printed by {cause.label}:"]
                lines += [f"  {line}" for line in printed]
            if crash:
                lines += ["", f"Where {cause.label} crashed ({crash[0]}; most recent call first):"]
                lines += [f"  {in_notebook_terms(line.strip())}" for line in crash[1:]]
        others = self.failures[1:]
        if others:
            lines += ["", "Other ranks:"] + [f"  {f.summary()}" for f in others]
        if self.log_dir:
            whose = "this node's ranks" if any(f.node is not None for f in self.failures) else "every rank"
            lines += ["", f"Full output of {whose}: {self.log_dir}"]
        if self.attempts:
            n = len(self.attempts) + 1
            lines += ["", f"Every attempt ({n}, max_restarts={n - 1}):"]
            lines += [f"  attempt {i} of {n}: {line}" for i, line in enumerate(self.attempts, 1)]
            lines += [f"  attempt {n} of {n}: {self.root.brief()} (above)"]
        if self.note:
            lines += ["", self.note]
        return lines

    def _render(self) -> str:
        return "\n".join(self._render_lines())

    def _render_traceback_(self) -> list[str]:
        # IPython calls this instead of formatting our own (launcher-internal)
        # traceback, so the cell shows the failing rank's traceback.
        return [f"WorkerError: {line}" if i == 0 else line for i, line in enumerate(self._render_lines())]

    def __reduce__(self):
        return (type(self), (self.failures, self.log_dir, self.note, self.attempts))
