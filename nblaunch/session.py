"""Live ranks: ranks that stay up across cells, each call with a launch's view, results and errors.

    ranks = nblaunch.start(num_processes=4)   # ranks up, process group made
    ranks.run(setup)                          # `global model` in setup ...
    ranks.run(train, 3)                       # ... is `model` here
    ranks.pull("model", rank=0)
    ranks.close()

The ranks are the same :mod:`nblaunch.worker` processes a launch starts, told
to serve calls (``WorkerSpec.live``); each call is watched by the same
:class:`~nblaunch.supervisor.Supervisor` loop, with a call number on every
event. What is added here is only what a lifetime longer than one call needs:
sending calls, interrupting a call without ending the ranks, and deciding
when the ranks can no longer be trusted.

A call that fails on some ranks interrupts the others (``KeyboardInterrupt``
in their Python code) and keeps every rank. The ranks are restarted, and the
error says so, when they cannot be brought back to a sound state: a rank died,
a rank did not answer the interrupt within ``INTERRUPT_GRACE_S`` (blocked in a
collective its peers never joined), or the ranks issued different numbers of
collectives on the default group (their next one would pair with the wrong
operation). Never a silently half-working session.
"""
from __future__ import annotations

import os
import signal
import time
import warnings
import weakref
from typing import Callable, Optional

import psutil


from . import launcher, namespace, worker
from .channel import CLOSE, Call, Failure, Result
from .display import SHOW_AFTER_S, TextDisplay, make_display
from .errors import LaunchError, RankFailure, WorkerError, render_interrupt
from .logs import new_launch_dir, release_launch_dir
from .nodes import SingleNode
from .payload import check_sendable
from .resources import Sampler, gpu_devices
from .supervisor import _NO_RESULT, STOP_GRACE_S, LaunchTimeout, Supervisor, _Rank

__all__ = ["start", "Ranks", "active"]

INTERRUPT_GRACE_S = 2.0  # interrupt -> every rank idle again, or the ranks are restarted
# The stop button in a loop with a bar: the ranks stop together at an agreed
# step (worker._CallInterrupt); this is how long they get to reach it.
STEP_STOP_WAIT_S = 20.0
CLOSE_WAIT_S = 2.0  # close -> ranks gone on their own, before they are killed

_active: Optional[weakref.ref] = None


def active() -> Optional["Ranks"]:
    """This kernel's open live session, if any."""
    ranks = _active() if _active is not None else None
    return ranks if ranks is not None and ranks.is_up else None


class _LiveSupervisor(Supervisor):
    """The ranks of one generation of a session, and the watch of each call."""

    def __init__(self, ctx, specs, display, log_dir, group, forked: bool):
        # The job comes with each call; a forked rank is told it was forked.
        super().__init__(ctx, specs, () if forked else None, display, log_dir, group)
        self.broken: Optional[str] = None  # why these ranks cannot be trusted any more
        self._in_call = False
        self._closing = False
        self._shut = False
        self._answer_by: Optional[float] = None
        self._interrupted: set[int] = set()
        self._stopping_at: dict[int, int] = {}  # rank -> the loop step it stops at (the stop button)
        self._opened = False

    # -- lifetime ---------------------------------------------------------------

    def open(self) -> None:
        """Start every rank and wait until each has made its process group
        (its "call 0"). Raises ``WorkerError`` if one cannot."""
        try:
            self._start()
            while not self._call_over():
                self._pass()
        except BaseException:
            self.shutdown()
            raise
        failures = [r.failure for r in self._ranks if r.failure is not None]
        if failures:
            self.shutdown()
            error = WorkerError(failures, log_dir=str(self._log_dir))
            raise error from error.root.exception
        self._opened = True

    def shutdown(self) -> None:
        """Ask every rank to leave, kill what has not within ``CLOSE_WAIT_S``,
        and release everything. Safe to call twice, from a finalizer too."""
        if self._shut:
            return
        self._shut = self._closing = True
        for r in self._ranks:
            try:
                r.go.send(CLOSE)
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + CLOSE_WAIT_S
        for r in self._ranks:
            if r.proc.pid is not None:
                r.proc.join(max(0.0, deadline - time.monotonic()))
        self._stop(STOP_GRACE_S)
        self._cleanup()
        self._group.close()
        release_launch_dir(self._log_dir)

    def dead(self) -> list[int]:
        """Ranks whose process has ended (between calls nothing watches them)."""
        return [r.global_rank for r in self._ranks if r.proc.pid is None or r.proc.exitcode is not None
                or not _alive(r.proc.pid)]

    @property
    def pids(self) -> list[int]:
        return [r.proc.pid for r in self._ranks]

    @property
    def interrupted(self) -> bool:
        """Whether the last call was interrupted on some rank."""
        return bool(self._interrupted)

    @property
    def log_dir(self) -> str:
        return str(self._log_dir)

    # -- one call -----------------------------------------------------------------

    def call(self, number: int, job: bytes, display, timeout: Optional[float],
             stall_warning: Optional[float]) -> list:
        self._call = number
        self._display = display
        self._timeout = timeout
        self._stall_warning, self._stalled = stall_warning, set()
        self._stop_at = self._stop_deadline = self._answer_by = self._left_check = None
        self._result_bytes = 0
        self._interrupted, self._stopping_at = set(), {}
        self._sampler = Sampler(gpu_devices([r.spec.local_rank for r in self._ranks]))
        for r in self._ranks:
            r.result, r.failure, r.stopped, r.signals_sent, r.departure = _NO_RESULT, None, False, set(), None
            display.state.set_rank(r.rank, "running")
            try:
                r.go.send(Call(number, job))
            except (OSError, ValueError):
                pass  # it died; its sentinel says so
        display.show()
        self._in_call = True
        t0 = time.monotonic()
        try:
            while not self._call_over():
                self._pass()
                self._check_answers()
                if timeout is not None and time.monotonic() - t0 > timeout and not self.broken:
                    where = self._where()
                    kept = self._interrupt_all()
                    raise LaunchTimeout(
                        f"call {number} did not finish within {timeout:g} s; where each rank was "
                        f"(innermost frame first):\n{where}\n{self._fate(kept)} Full output: {self._log_dir}",
                        log_dir=str(self._log_dir))
        except KeyboardInterrupt as exc:
            where = self._where()
            self._display.notice("interrupted (where each rank was: in the error below)")
            kept = self._interrupt_all(at_a_step=True)
            render_interrupt(exc, [f"KeyboardInterrupt: call {number} was interrupted on every rank. "
                                   f"{self._fate(kept)} Where each rank was (innermost frame first):",
                                   where, f"Full output: {self._log_dir}"])
            raise
        finally:
            self._in_call = False
        return self._outcome()

    def _fate(self, kept: bool) -> str:
        return ("The ranks are idle and keep their state." if kept
                else f"The ranks could not be kept: {self.broken}.")

    def _interrupt_all(self, at_a_step: bool = False) -> bool:
        """Interrupt every rank still in the call; True if all are idle
        again within ``INTERRUPT_GRACE_S`` (else the ranks are broken).
        ``at_a_step`` (the stop button): ranks in a loop with a bar stop
        together at a step they agree on, where no collective is pending."""
        self._answer_by = None  # a fresh grace from now
        self._interrupt(at_a_step)
        try:
            while not self._call_over() and not self.broken:
                self._pass()
                self._check_answers()
        except KeyboardInterrupt:
            self._break("the interrupt was pressed again while the ranks were stopping")
        return not self.broken

    def _interrupt(self, at_a_step: bool = False) -> None:
        how = f"{self._call} at a step" if at_a_step else str(self._call)  # see worker._CallInterrupt
        for r in self._ranks:
            if r.exited or r.result is not _NO_RESULT or r.failure is not None:
                continue
            self._interrupted.add(r.rank)
            try:
                _write_atomically(r.spec.interrupt_file, how)
                os.kill(r.proc.pid, signal.SIGINT)  # the rank alone: DataLoader workers follow their rank
            except (OSError, TypeError):
                pass
        if self._answer_by is None:
            self._answer_by = time.monotonic() + INTERRUPT_GRACE_S

    def _on_stopping(self, r: _Rank, event) -> None:
        if r.rank not in self._interrupted or self._answer_by is None or self.broken:
            return
        if event.at and not any(self._stopping_at.values()):
            self._display.notice(f"every rank stops after step {event.at} of its loop, where no collective "
                                 "is pending (press stop again to stop at once; the ranks are then restarted)")
        self._stopping_at[r.rank] = event.at
        self._answer_by = max(self._answer_by, time.monotonic() + STEP_STOP_WAIT_S)

    def _check_answers(self) -> None:
        if self._answer_by is None or self.broken or time.monotonic() < self._answer_by or self._call_over():
            return
        stuck = [r.global_rank for r in self._ranks
                 if not r.exited and r.result is _NO_RESULT and r.failure is None]
        if self._stopping_at:
            self._break(f"{_ranks_label(stuck)} did not reach the agreed stop step within {STEP_STOP_WAIT_S:g} s "
                        f"of being interrupted; where each rank was:\n{self._where()}")
            return
        self._break(f"{_ranks_label(stuck)} did not stop within {INTERRUPT_GRACE_S:g} s of being interrupted "
                    "(most likely blocked in a collective that another rank never joined)")

    def _break(self, reason: str) -> None:
        """These ranks cannot be trusted: stop them all (the session restarts them)."""
        if self.broken:
            return
        self.broken = reason
        self._display.notice(f"{reason}; restarting the ranks (what earlier calls built in them is lost)")
        Supervisor._begin_stop(self)

    # -- the steps of the watch that differ from a launch --------------------------

    def _begin_stop(self) -> None:
        """A rank failed: during a call, interrupt the others rather than end them."""
        if self._in_call and not self.broken:
            self._interrupt()
        else:
            super()._begin_stop()

    def _on_failure(self, failure: RankFailure) -> None:
        if failure.kind == "interrupted" and self._answer_by is not None:
            # A rank answered the interrupt under way: the others have been
            # asked too (and may be on their way to the agreed step, which
            # a second interrupt would cut short).
            return
        if failure.kind == "left" and self._in_call:
            # The ranks that wait for it are in a collective: no interrupt reaches them.
            self._break(failure.summary())
        super()._on_failure(failure)

    def _failure_of(self, r: _Rank, event: Failure) -> RankFailure:
        r.seq = event.seq
        if r.rank in self._interrupted and event.exc_type == "KeyboardInterrupt":
            return r.failure_at("interrupted", event.time, exc_type=event.exc_type,
                                remote_traceback=event.traceback)
        return super()._failure_of(r, event)

    def _take_result(self, r: _Rank, event: Result) -> None:
        r.seq = event.seq
        super()._take_result(r, event)

    def _on_exit(self, r: _Rank) -> None:
        super()._on_exit(r)
        if self._opened and not self._closing:
            self._break(r.failure.summary() if r.failure is not None else f"rank {r.global_rank} exited")

    def _outcome(self) -> list:
        failures = self._blamed()
        seqs = {r.global_rank: r.seq for r in self._ranks if not r.exited and r.seq >= 0}
        if not self.broken and len(set(seqs.values())) > 1:
            counts = ", ".join(f"rank {rank}: {n}" for rank, n in sorted(seqs.items()))
            self._break(f"the ranks' process group is out of step (collectives issued: {counts})")
        if not failures:
            return [r.result for r in self._ranks]
        error = WorkerError(failures, log_dir=str(self._log_dir))
        raise error from error.root.exception


def _write_atomically(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _alive(pid: int) -> bool:
    # A killed rank shows as a zombie a moment before waitpid can reap it
    # (its other threads are still exiting).
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _ranks_label(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


class _Generation:
    """The session's current ranks, for the finalizer (which must not hold the session)."""

    def __init__(self):
        self.supervisor: Optional[_LiveSupervisor] = None

    def close(self) -> None:
        sup, self.supervisor = self.supervisor, None
        if sup is not None:
            sup.shutdown()


class Ranks:
    """Ranks that stay up between cells; made by :func:`start`.

    ``run(fn, *args, **kwargs)`` runs ``fn`` on every rank, in each rank's own
    namespace, with a launch's live view, and returns the per-rank results
    (or raises :class:`~nblaunch.WorkerError`, ``LaunchTimeout``,
    ``KeyboardInterrupt``). ``pull``/``push`` move named objects out of and
    into the ranks. ``close()`` ends them (so does the kernel's end, and this
    object being garbage collected). ``status`` says what is up.
    """

    def __init__(self, num_processes: int, settings: dict, addr: str):
        self.num_processes = num_processes
        self._settings = settings
        self._addr = addr
        self._gen = _Generation()
        self._finalizer = weakref.finalize(self, self._gen.close)
        self._calls = 0
        self.restarts = 0
        self._closed = False
        self._plan = None
        self._up()

    # -- public -------------------------------------------------------------------

    def run(self, fn: Callable, *args, timeout: Optional[float] = None, display: Optional[str] = None,
            **kwargs):
        """``fn(*args, **kwargs)`` on every rank; returns ``[result of rank 0, ...]``.

        ``fn`` sees the rank's namespace: names it binds with ``global`` stay
        for later calls; names it uses from the notebook come with it, unless
        the rank bound that name itself (the rank's value wins). ``timeout``
        and ``display`` are this call's (see ``notebook_launcher``); to pass
        an argument of those names to ``fn``, use ``functools.partial``."""
        # The launch's own checks of fn (callable, not async, not a
        # generator), its arguments, timeout and display.
        launcher._validate(fn, args, kwargs, self.num_processes, "auto", "auto", True, None, None,
                           timeout, display or "auto", None)
        return self._call(_pack(fn, args, kwargs), timeout, display or self._settings["display"])

    def pull(self, name: str, rank: Optional[int] = None):
        """The object bound to ``name`` in rank ``rank`` (None: a list, one per
        rank). Tensors come through shared memory; a module or optimizer is
        pulled as a copy (its ``state_dict()`` is usually what you want)."""
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"name must be an identifier, got {name!r}")
        if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int)
                                 or not 0 <= rank < self.num_processes):
            raise ValueError(f"rank must be None or an int in [0, {self.num_processes}), got {rank!r}")
        results = self._call(_pack(_pull_on, (name, rank), {}), None, "none")
        return list(results) if rank is None else results[rank]

    def push(self, **values) -> None:
        """Bind ``values`` by name in every rank (a copy each), replacing what a rank had."""
        self._call(_pack(namespace.push, (values,), {}), None, "none")

    def restart(self) -> None:
        """End the ranks and start new ones (their state is lost)."""
        self._check_usable()
        with _one_at_a_time():
            self._gen.close()
            self.restarts += 1
            self._up()

    def close(self) -> None:
        """End the ranks. Closing twice is fine."""
        self._closed = True
        self._gen.close()

    @property
    def is_up(self) -> bool:
        return not self._closed and self._gen.supervisor is not None

    @property
    def pids(self) -> list[int]:
        sup = self._gen.supervisor
        return sup.pids if sup is not None else []

    @property
    def status(self) -> str:
        """``up``, ``closed``, or what is wrong; with the ranks, calls and restarts."""
        sup = self._gen.supervisor
        if self._closed or sup is None:
            return "closed"
        dead = sup.dead()
        what = f"{self.num_processes} ranks ({self._plan.method}, {self._plan.backend or 'no process group'})"
        if dead:
            return (f"down: {_ranks_label(dead)} ended outside a call; the next run reports it and restarts the ranks "
                    f"(their state is lost) | {what}")
        restarts = f", restarted {self.restarts}x" if self.restarts else ""
        return f"up: {what}, {self._calls} calls{restarts} | output: {sup.log_dir}"

    def __repr__(self) -> str:
        return f"<nblaunch.Ranks {self.status}>"

    def __enter__(self) -> "Ranks":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- inside ---------------------------------------------------------------------

    def _up(self) -> None:
        """Start a generation of ranks (the first, or after a restart)."""
        s = self._settings
        self._plan = plan = launcher.plan_ranks(
            self.num_processes, s["start_method"], s["backend"], s["init_process_group"],
            s["threads_per_rank"], None, self._addr, live=True)
        log_dir, log_notice = new_launch_dir()
        specs = [worker.WorkerSpec(rank=local, local_rank=local, stack_file=str(log_dir / f"local{local}.stacks"),
                                   interrupt_file=str(log_dir / f"local{local}.interrupt"), **plan.specs_base)
                 for local in range(self.num_processes)]
        view = TextDisplay(show_status=False)  # set-up prints (warnings) only
        view.begin(self.num_processes, plan.method, plan.backend or "", str(log_dir))
        for text in filter(None, [plan.notice, log_notice]):
            view.notice(text)
        group = SingleNode(self._addr, self.num_processes, plan.pg_timeout)
        sup = _LiveSupervisor(plan.ctx, specs, view, log_dir, group, forked=plan.method == "fork")
        try:
            sup.open()
        finally:
            view.flush()
        self._gen.supervisor = sup

    def _check_usable(self) -> None:
        if self._closed:
            raise LaunchError("these live ranks were closed; start new ones with nblaunch.start()")
        if worker.current_spec() is not None:
            raise LaunchError("live ranks cannot be used from inside a rank; call from the notebook")

    def _call(self, job: bytes, timeout: Optional[float], display: str):
        self._check_usable()
        with _one_at_a_time():
            if self._gen.supervisor is None:  # an earlier restart failed
                self.restarts += 1
                self._up()
            sup = self._gen.supervisor
            self._calls += 1
            view = make_display(display, show_after=SHOW_AFTER_S)
            view.begin(self.num_processes, self._plan.method, self._plan.backend or "", sup.log_dir,
                       call=self._calls)
            try:
                results = sup.call(self._calls, job, view, timeout, self._settings["stall_warning"])
            except BaseException as exc:
                outcome = ("interrupted" if isinstance(exc, KeyboardInterrupt)
                           else "timed out" if isinstance(exc, LaunchTimeout) else "failed")
                view.close(outcome)
                note = self._after(sup)
                raise _with_note(exc, note) from (exc.__cause__ if isinstance(exc, WorkerError) else None)
            view.close("finished")
            if sup.broken:
                note = self._after(sup)
                warnings.warn(f"call {self._calls} returned, but {note}", RuntimeWarning, stacklevel=3)
            return launcher.LaunchResults(results, sup.log_dir, sup.log_files)

    def _after(self, sup: _LiveSupervisor) -> str:
        """After a call that did not end well: restart broken ranks; say what became of them."""
        if not sup.broken:
            others = " (the other ranks' calls were interrupted)" if sup.interrupted else ""
            return f"The live ranks are still up and keep their state{others}."
        reason = sup.broken
        self._gen.close()
        try:
            self.restarts += 1
            self._up()
        except BaseException as exc:  # noqa: BLE001 - said in the note; the next run tries again
            return (f"The ranks could not be kept ({reason}), and starting new ones failed: {exc}. "
                    "The next run tries again.")
        return (f"The session restarted its ranks ({reason}): what earlier calls built in them "
                "is gone; run your set-up again.")


def _with_note(exc: BaseException, note: str) -> BaseException:
    if isinstance(exc, WorkerError):
        return WorkerError(exc.failures, exc.log_dir, note=note)
    if isinstance(exc, LaunchTimeout):
        return LaunchTimeout(f"{exc}\n{note}", log_dir=exc.log_dir)
    render = getattr(exc, "_render_traceback_", None)
    if isinstance(exc, KeyboardInterrupt) and render is not None and "restarted" in note:
        lines = render()
        render_interrupt(exc, lines + [note])
    return exc


class _one_at_a_time:
    """One launch or call at a time in this kernel (see ``launcher._one_launch``)."""

    def __enter__(self):
        if not launcher._one_launch.acquire(blocking=False):
            raise LaunchError("a launch or a call on live ranks is already running in this kernel "
                              "(from another thread); wait for it to return")
        return self

    def __exit__(self, *exc):
        launcher._one_launch.release()


def _pack(fn, args: tuple, kwargs: dict) -> bytes:
    try:
        return namespace.pack_call(fn, args, kwargs)
    except Exception:
        check_sendable(fn, args, kwargs)  # names the part that cannot be sent
        raise


def _pull_on(name: str, rank: Optional[int]):
    """In each rank: the named object from the one asked (None from the others)."""
    if rank is not None and worker.current_spec().rank != rank:
        return None
    return namespace.pull(name)


def start(num_processes: int, *, start_method: str = "auto", backend: str = "auto",
          init_process_group: bool = True, master_addr: Optional[str] = None,
          threads_per_rank: Optional[int] = None, display: str = "auto",
          stall_warning: Optional[float] = 60.0) -> Ranks:
    """Start ``num_processes`` ranks that stay up across cells; returns :class:`Ranks`.

    The ranks get what a ``notebook_launcher`` rank gets (torchrun's
    environment, a process group, the rank's device) once, then wait for
    ``run`` calls. One session per kernel at a time; ``notebook_launcher``
    still works while one is up (not at the same moment as a call). Use it as
    a context manager, or ``close()`` it; it also ends with the kernel.
    """
    global _active
    launcher._validate(_noop, (), {}, num_processes, start_method, backend, init_process_group,
                       master_addr, threads_per_rank, None, display, stall_warning)
    addr = master_addr or "127.0.0.1"
    launcher._validate_settings(addr)
    if worker.current_spec() is not None:
        raise LaunchError("nblaunch.start was called inside a rank; start live ranks from the notebook")
    up = active()
    status = up.status if up is not None else None
    del up  # a traceback kept by IPython must not keep the session alive
    if status is not None:
        raise LaunchError(f"live ranks are already up in this kernel ({status}); "
                          "close them first (ranks.close() or %nblaunch stop)")
    settings = dict(start_method=start_method, backend=backend, init_process_group=init_process_group,
                    threads_per_rank=threads_per_rank, display=display, stall_warning=stall_warning)
    with _one_at_a_time():
        ranks = Ranks(num_processes, settings, addr)
    _active = weakref.ref(ranks)
    return ranks


def _noop():
    pass
