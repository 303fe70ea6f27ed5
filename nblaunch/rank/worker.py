"""What runs inside one rank.

Order matters and is the contract: watch for the kernel's death, take over
file descriptors 1/2, set the torchrun environment, report ``Started``, set up
the process group, load and run ``fn``, report ``Result`` or ``Failure``, tear
down, and leave with ``os._exit`` (never through interpreter shutdown, which
can hang on threads or atexit handlers the kernel left in a forked child).
"""
from __future__ import annotations

import dataclasses
import datetime
import gc
import os
import pickle
import signal
import sys
import time
from multiprocessing.connection import Connection
from typing import Any, Optional

from ..system import linux
from .progress import begin_rank, finish_call, new_call, start_if_gpu
from ..wire.channel import CLOSE, RELEASE, Answer, Call, EventSender, Phase, Preempting, Result, Started
from . import debugger, lifeline, setup as rank_setup, stacks, term
from .interrupts import CallInterrupt, group_seq
from .results import check_size, dump_result, report
from .spec import WorkerSpec, current_spec, set_current

__all__ = ["WorkerSpec", "run_worker", "current_spec"]  # the spec's names, from .spec, as before

_LINGER_AFTER_FAILURE_S = 2.0

def run_worker(spec: WorkerSpec, job: Any, go: Connection, events: Connection,
               output: Connection, parent: Optional[int] = None) -> None:
    """Entry point of a rank process. ``go`` delivers the rank's place in the
    job (global rank, world size, where the ranks' store is) once the
    kernel's forks are done and the nodes have met (a zygote's first ranks
    get it while it still forks the later ones). Then the rank serves calls
    (:func:`_serve`): a launch's rank exactly one, ``job`` (``(fn, args,
    kwargs)``, or a ``payload.PackedJob`` of them when the rank was not
    forked); a live rank (``spec.live``, ``job`` None) those the kernel sends
    until it says ``CLOSE``, after reporting its set-up as call 0. Events
    name the rank by its local rank: the kernel knows the rest. ``parent``:
    the process that started this one, when it may already be gone (a rank
    forked by :mod:`nblaunch.engines.zygote`)."""
    # What the rank inherited or imported is never collected in it: a full
    # collection visits (writes to) every object, so a forked rank would copy
    # the kernel's whole heap, 44 MiB and 0.1 s for 400,000 of the notebook's
    # objects (measured; 4 MiB and 0.3 ms frozen). Garbage fn makes is
    # collected as usual; ``gc.unfreeze()`` in fn undoes this.
    gc.freeze()
    # Before any thread: SIGTERM is nblaunch's stop or the job's end, told apart by its sender.
    term.block(spec.kernel_pid, os.path.dirname(spec.stack_file) if spec.stack_file else "")
    prepared = rank_setup.prepared()  # by a zygote, before it forked this rank
    if prepared is None:
        lifeline.default_stop_signals()
    lifeline.watch_parent(spec.kernel_pid, os.getppid() if parent is None else parent, each_poll=_start_if_gpu)
    rank_setup.point_fds(output)
    if prepared is None:
        rank_setup.become_rank(spec)
    elif rank_setup.prepared_output():
        os.write(2, rank_setup.prepared_output())
    if isinstance(prepared, BaseException):  # said here, where the rank's stderr is the kernel's pipe
        raise prepared
    if spec.stack_file:
        stacks.register(spec.stack_file)
    sender = EventSender(events)
    local = spec.local_rank
    term.watch(lambda sig, by: sender.send(Preempting(local, sig, by)))
    begin_rank(sender, local)
    made_group = False
    try:
        lifeline.lead_own_group()
        spec = dataclasses.replace(spec, **go.recv())  # go stays open for RELEASE and calls
        set_current(spec)
        os.environ.update(rank_setup.torchrun_env(spec))
        os.environ.update(rank_setup.slurm_env(spec, os.environ))
        os.environ.update(spec.env)
        sender.send(Started(local, os.getpid(), time.time()))
        made_group = rank_setup.setup_torch(spec, sender)
        debugger.install(sender, go, local)
        if spec.live:
            sender.send(Result(local, pickle.dumps(None), call=0, seq=group_seq()))
    except BaseException as exc:  # noqa: BLE001 - every failure must be reported
        report(sender, local, "setup", exc)
        _linger_and_leave()
    calls = _calls_from(go) if spec.live else iter([Call(0, job)])
    if not _serve(spec, sender, go, calls) and not spec.live:
        _linger_and_leave()
    if made_group:
        _destroy_group()
    _leave(0)


def _start_if_gpu() -> None:
    try:
        start_if_gpu()
    except Exception:  # a torch half imported by the main thread: the next poll
        pass


def _linger_and_leave() -> None:
    """After a failure that ends the rank: stay up until the kernel stops
    every rank. Exiting now would close our sockets and hand the peers a
    "Connection closed by peer" error of their own before the kernel has
    stopped them."""
    time.sleep(_LINGER_AFTER_FAILURE_S)
    _leave(1)


def _calls_from(go: Connection):
    """A live rank's calls, as the kernel sends them, until ``CLOSE``."""
    while True:
        try:
            msg = go.recv()
        except EOFError:
            return
        if msg == RELEASE or isinstance(msg, Answer):  # a result that needed no wait; a debugger gone
            continue
        if msg == CLOSE or not isinstance(msg, Call):
            return
        yield msg


def _serve(spec: WorkerSpec, sender: EventSender, go: Connection, calls) -> bool:
    """Run each call, report its end (``Result`` or ``Failure``), and return
    whether the last one succeeded. A live rank runs it in its own namespace
    (:mod:`nblaunch.rank.namespace`), where an exception ends the call, not the
    rank. The kernel interrupts a live call (its interrupt button, or another
    rank's failure) by writing the call's number to ``interrupt_file`` and
    sending SIGINT: a ``KeyboardInterrupt`` in the call's function, raised as
    the function starts if the call was still loading. A SIGINT for a call
    that has ended is ignored, so it never lands in the next call or in a
    report."""
    from . import namespace

    ns = namespace.current() if spec.live else None
    interrupt = CallInterrupt(spec.interrupt_file, spec.restart_count)
    if spec.interrupt_file:
        signal.signal(signal.SIGINT, interrupt.handler)
    ok = True
    for call in calls:
        interrupt.begin(call.id)
        new_call(call.id)
        debugger.begin_call(call.id)
        _call_timeout(spec, call.timeout)
        phase = "load"
        try:
            fn, args, kwargs = ns.load(call.job) if ns is not None else _load(spec, call.job)
            phase = "fn"
            exited = False
            try:
                interrupt.running = True
                sender.send(Phase(spec.local_rank, "in fn", call=call.id))
                if interrupt.pending or interrupt.asked():  # it came while the call was loading
                    raise KeyboardInterrupt
                value = fn(*args, **kwargs)
            except SystemExit as exc:  # sys.exit(0) in a rank is an ordinary return
                if exc.code not in (None, 0):
                    raise
                value, exited = None, True
            finally:
                interrupt.running = False
            ended = time.time()
            interrupt.end()
            if ns is not None:
                ns.forget()
            phase = "result"
            payload, shared = dump_result(spec.rank, value)
            check_size(spec.rank, value, len(payload) + shared)
            finish_call()
            _flush_output()  # what fn printed reaches the pipe before its result: the kernel reads it first
            sender.send(Result(spec.local_rank, payload, shared, call=call.id, seq=group_seq(), time=ended,
                               exited=exited))
            del value
            if shared:  # keep the storages alive until the kernel has them
                _await_release(go)
            ok = True
        except BaseException as exc:  # noqa: BLE001 - every failure must be reported
            interrupt.end()
            if ns is not None:
                ns.forget()
            try:
                finish_call()
            except Exception:
                pass
            _flush_output()
            report(sender, spec.local_rank, phase, exc, call=call.id, seq=group_seq())
            del exc
            ok = False
    return ok


def _await_release(go: Connection) -> None:
    """Until the kernel has fetched this result's shared memory (or died, and so do we)."""
    try:
        while go.recv() != RELEASE:
            pass
    except (EOFError, OSError):
        pass


def _call_timeout(spec: WorkerSpec, timeout: Optional[float]) -> None:
    """A live call's collectives give up a little after the call's own
    timeout (as a launch's do), so the kernel's timeout, with every rank's
    stack, comes first; without one, torch's default. Through a private
    torch call (``_set_pg_timeout``, torch >= 2.3): there is no public one,
    and a process group's timeout is otherwise fixed when it is made."""
    if not spec.live or spec.backend is None:
        return
    try:
        import torch.distributed as dist

        from .env import pg_timeout_for

        if dist.is_initialized():
            dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=pg_timeout_for(timeout)))
    except Exception:  # an older torch: the group keeps the timeout it was made with
        pass


def _load(spec: WorkerSpec, job: Any) -> tuple:
    """A rank forked from the kernel inherits the job as objects; other ranks
    (and ranks a node agent forked) get it packed."""
    return job if isinstance(job, tuple) else job.load()


def _destroy_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        if current_spec() is not None:
            rank_setup.wait_for_peers_joined(current_spec())
        dist.destroy_process_group()


def _leave(code: int) -> None:
    try:
        lifeline.end_children()
    except Exception:
        pass
    _flush_output()
    os._exit(code)


def _flush_output() -> None:
    """What the rank wrote and still buffers, into its pipe."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    # C stdio too: printf from a C extension sits in libc's buffer (fully
    # buffered on a pipe), which os._exit would throw away.
    if linux.fflush is not None:
        linux.fflush(None)
