"""A rank's debugger, answered from the notebook.

A rank has no terminal: ``breakpoint()``, ``pdb.set_trace()`` and
``torch.distributed.breakpoint()`` in it open a :class:`RankPdb`, a plain
``pdb.Pdb`` whose terminal is the kernel. What pdb prints is held until it
asks for a line; then the text and the prompt travel to the kernel as a
``Prompt`` event, and the rank waits for the ``Answer`` on its go pipe (the
pipe every rank already reads, relayed by a cluster node's agent: no new
port). The kernel asks the user with ``input()`` -- Jupyter's stdin channel,
or the terminal of a script -- and says ``Answer(None)`` where no one can
answer (nbclient, papermill, nbval, a script without a terminal): the rank
then goes on, and breakpoints stay off for the rest of its call.

``Paused`` events frame a session: from the first stop until the user
continues (``c``) or quits (``q``); meanwhile the kernel holds the call's
timers and its peers' rows say why they wait. ``q`` leaves the debugger
and lets the rank run on, breakpoints off for the rest of its call: pdb's
``BdbQuit`` would fail the call while its peers wait in a collective, and
live ranks would then have to be restarted, losing their state. Stopping
is the stop button's job, as for any launch.
"""
from __future__ import annotations

import io
import os
import pdb
import sys
import threading
from typing import Any, Callable, Optional

from ..wire.channel import Answer, Paused, Prompt

__all__ = ["install", "begin_call", "RankPdb"]

_desk: Optional["_Desk"] = None
# The torch.distributed (None: none imported) install_hooks last ran with
# in this process or in the zygote it was forked from; False: never ran.
_hooked_for: Any = False


class _NoFrontEnd(Exception):
    """The kernel said no one can answer a prompt here."""


class _Desk:
    """The rank's line to the kernel for its debugger (one per rank process)."""

    def __init__(self, sender, go, rank: int):
        self.sender, self.go, self.rank = sender, go, rank
        self.pid = os.getpid()
        self.call = 0
        self.off_in_call: Optional[int] = None  # no one could answer in this call
        self.lock = threading.Lock()  # one prompt at a time, whichever thread broke

    def usable(self) -> bool:
        # A process the rank forked (a DataLoader worker) inherited the pipes:
        # its answers would be the rank's.
        return os.getpid() == self.pid and self.off_in_call != self.call

    def ask(self, text: str, prompt: str) -> str:
        with self.lock:
            self.sender.send(Prompt(self.rank, text, prompt, call=self.call))
            while True:
                msg = self.go.recv()
                if isinstance(msg, Answer):
                    break
        if msg.line is None:
            self.off_in_call = self.call
            raise _NoFrontEnd
        return msg.line

    def paused(self, paused: bool, where: str = "", text: str = "") -> None:
        self.sender.send(Paused(self.rank, paused, where, call=self.call, text=text))


class _Terminal(io.TextIOBase):
    """pdb's stdin and stdout in a rank: output is held until pdb reads."""

    def __init__(self, desk: _Desk):
        self._desk = desk
        self._held: list[str] = []

    def writable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self._held.append(text)
        return len(text)

    def take(self) -> str:
        """What pdb printed since it last read."""
        text = "".join(self._held)
        self._held.clear()
        return text

    def readline(self, size: int = -1) -> str:
        text = self.take()
        head, newline, prompt = text.rpartition("\n")
        return self._desk.ask(head + newline, prompt) + "\n"


class RankPdb(pdb.Pdb):
    """``pdb.Pdb`` with the kernel for a terminal. ``on_resume``: run once,
    when the user first lets the rank run again (``torch.distributed.breakpoint``'s
    barrier, so that ``n`` stops at the user's next line, after it)."""

    def __init__(self, desk: _Desk, on_resume: Optional[Callable[[], None]] = None, **kwargs):
        self._terminal = terminal = _Terminal(desk)
        # nosigint: a live rank's interrupts are SIGINT, and nblaunch's.
        super().__init__(stdin=terminal, stdout=terminal, nosigint=True, **kwargs)
        self.use_rawinput = False
        self._desk = desk
        self._on_resume = on_resume
        self._in_session = False

    def set_trace(self, frame=None, **kwargs):
        if _usable():
            super().set_trace(frame if frame is not None else sys._getframe(1), **kwargs)

    def interaction(self, frame, tb_or_exc):
        if not self._in_session:
            self._in_session = True
            shown = frame if frame is not None else None
            where = (f"{shown.f_code.co_filename}:{shown.f_lineno} in {shown.f_code.co_name}"
                     if shown is not None else "")
            self._desk.paused(True, where)
        try:
            super().interaction(frame, tb_or_exc)
        except _NoFrontEnd:
            self.forget()
            self.clear_all_breaks()
            self.set_continue()

    def _resuming(self) -> None:
        on_resume, self._on_resume = self._on_resume, None
        if on_resume is not None:
            on_resume()

    def _session_over(self) -> None:
        if self._in_session:
            self._in_session = False
            self._desk.paused(False, text=self._terminal.take())

    def set_step(self):
        self._resuming()
        super().set_step()

    def set_next(self, frame):
        self._resuming()
        super().set_next(frame)

    def set_return(self, frame):
        self._resuming()
        super().set_return(frame)

    def set_until(self, frame, lineno=None):
        self._resuming()
        super().set_until(frame, lineno)

    def set_continue(self):
        self._resuming()
        super().set_continue()
        self._session_over()

    def do_quit(self, arg):
        """q(uit): leave the debugger; this rank runs on, its breakpoints
        off until its next call (the stop button stops the launch)."""
        self._desk.off_in_call = self._desk.call
        self.message("rank runs on without the debugger; its breakpoints are off for the rest of this call "
                     "(the stop button stops the launch)")
        self.clear_all_breaks()
        self.set_continue()
        return 1

    do_q = do_exit = do_quit


def install(sender, go, rank: int) -> None:
    """Make this rank's ``breakpoint()``, ``pdb.set_trace()`` and (once torch
    is imported) ``torch.distributed.breakpoint()`` open a :class:`RankPdb`."""
    global _desk
    _desk = _Desk(sender, go, rank)
    if _hooked_for is not sys.modules.get("torch.distributed"):  # not yet, or torch imported since
        install_hooks()


def install_hooks() -> None:
    """The hooks :func:`install` needs, set once for a generation in its
    zygote (:func:`nblaunch.rank.setup.prepare_for_ranks`): setting them
    in each rank wrote to ~70 pages of the kernel's it then copied."""
    global _hooked_for
    sys.breakpointhook = _breakpointhook
    pdb.set_trace = _set_trace
    dist = sys.modules.get("torch.distributed")
    if dist is not None and hasattr(dist, "breakpoint"):
        dist.breakpoint = _dist_breakpoint
        # Where the notebook bound torch's own function before the rank
        # existed (``from torch.distributed import breakpoint``), its pdb is ours.
        for factory in ("_make_distributed_pdb", "_DistributedPdb"):
            if hasattr(dist, factory):
                setattr(dist, factory, lambda: RankPdb(_desk))
    _hooked_for = dist


def begin_call(call: int) -> None:
    """The rank starts call ``call`` (a live rank: breakpoints are on again)."""
    if _desk is not None:
        _desk.call = call


def _usable() -> bool:
    if os.environ.get("PYTHONBREAKPOINT") == "0":  # Python's own switch, honoured as breakpoint() would
        return False
    return _desk is not None and _desk.usable()


def _breakpointhook(*args, **kwargs) -> None:
    if _usable():
        RankPdb(_desk).set_trace(sys._getframe().f_back)


def _set_trace(*, header: Optional[str] = None) -> None:
    if not _usable():
        return
    debugger = RankPdb(_desk)
    if header is not None:
        debugger.message(header)
    debugger.set_trace(sys._getframe().f_back)


_skipped: dict = {}


def _dist_breakpoint(rank: int = 0, skip: int = 0, timeout_s: Optional[float] = 3600) -> None:
    """``torch.distributed.breakpoint``: rank ``rank`` stops at its caller's
    next line; every other rank waits in a barrier until it runs on. As in
    torch, the groups' collectives then wait ``timeout_s`` (the barrier too)."""
    import datetime

    import torch.distributed as dist

    caller = sys._getframe(1)
    if skip > 0:
        key = (caller.f_code.co_filename, caller.f_lineno)
        _skipped[key] = _skipped.get(key, 0) + 1
        if _skipped[key] <= skip:
            return
    if timeout_s is not None:
        try:
            for group in dist.distributed_c10d._pg_map:
                dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=timeout_s), group)
        except Exception:  # noqa: BLE001 - an older torch: the groups keep their timeout
            pass
    if dist.get_rank() == rank and _usable():
        RankPdb(_desk, on_resume=dist.barrier).set_trace(caller)
    else:
        dist.barrier()
