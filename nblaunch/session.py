"""Sessions: a launch's ranks, and live ranks that stay up across cells.

    ranks = nblaunch.start(num_processes=4)   # ranks up, process group made
    ranks.run(setup)                          # `global model` in setup ...
    ranks.run(train, 3)                       # ... is `model` here
    ranks.pull("model", rank=0)
    ranks.close()

A :class:`Session` owns the config, the engine and each generation of ranks (a
:class:`~nblaunch.engines.pool.RankPool`); every call on it is one
:class:`~nblaunch.watch.CallWatch`. ``notebook_launcher`` is a session whose
ranks serve one call; :class:`Ranks` is a session whose ranks serve calls
until closed.

A call that fails on some live ranks interrupts the others
(``KeyboardInterrupt`` in their Python code) and keeps every rank. The ranks
are restarted, and the error says so, when they cannot be brought back to a
sound state: a rank died, a rank did not answer the interrupt within
``watch.INTERRUPT_GRACE_S`` (blocked in a collective its peers never
joined), or the ranks issued different numbers of collectives on the default
group (their next one would pair with the wrong operation). Never a
silently half-working session.
"""
from __future__ import annotations

import multiprocessing
import threading
import warnings
import weakref
from typing import Any, Callable, Optional

from .rank import namespace, worker
from .wire.channel import CLOSE, Call
from .config import LaunchConfig, check_call, check_call_options
from .view import SHOW_AFTER_S, TextDisplay, make_display
from .engines import Engine, engine_for, inflight
from .errors import LaunchError, LaunchTimeout, Preempted, WorkerError, render_interrupt
from .preempt import Catcher
from .restarts import History, may_restart
from .wire.payload import check_sendable
from .engines.pool import RankPool
from .launch_watch import LaunchWatch
from .live_watch import LiveCallWatch
from .postmortem import with_rank_frames
from .watch import STOP_GRACE_S, CallWatch, ranks_label

__all__ = ["start", "Ranks", "active", "Session", "LaunchResults"]

CLOSE_WAIT_S = 2.0  # close -> ranks gone on their own, before they are killed

# One launch or call at a time per process. Two at once (cells run from
# threads) hung 1 time in 10 to 90: a rank forked while the other launch's
# store thread held glibc's resolver lock deadlocks in getnameinfo (seen
# with gdb). A second one is refused at once instead. The ``with`` statement
# takes it: a stop-button press just after an ``acquire()`` written out kept
# it for good, and every later launch was refused (tests/press_scan.py).
_one_at_a_time_lock = threading.Lock()

_active: Optional[weakref.ref] = None


def active() -> Optional["Ranks"]:
    """This kernel's open live session, if any."""
    ranks = _active() if _active is not None else None
    return ranks if ranks is not None and ranks.is_up else None


class LaunchResults(list):
    """What ``notebook_launcher`` (and a call on live ranks) returns: this
    node's per-rank results in local-rank order (a plain list in every other
    respect), plus where each rank's full output was kept: ``log_dir`` and
    ``log_files`` (one per rank, in the same order), and ``restarts``: one
    line per restart it took (``max_restarts``)."""

    def __init__(self, results, log_dir: str, log_files: list):
        super().__init__(results)
        self.log_dir = log_dir
        self.log_files = log_files
        self.restarts: list[str] = []


class Session:
    """The ranks of one launch or one live session, generation after generation.

    It owns the config, the engine (chosen once: it decides how ranks are
    made and where), the current :class:`~nblaunch.engines.pool.RankPool` and the
    restarts. A launch (:meth:`launch`) is a session whose ranks serve one
    call and end; with ``max_restarts`` a failed generation is replaced.
    Live ranks (:meth:`open`, :meth:`call`, :meth:`close`) serve calls until
    closed, and a generation that can no longer be trusted is replaced
    before the next call. Each call is one :class:`~nblaunch.watch.CallWatch`."""

    def __init__(self, config: LaunchConfig, live: bool, kept_in: Optional[list] = None):
        if kept_in is not None:
            kept_in.append(self)  # first: its maker releases it (``release``) whatever comes next
        self.config, self.live = config, live
        self.pool: Optional[RankPool] = None
        self.restarts = 0
        self.runs = 0  # run calls made on live ranks (pull and push are not counted)
        self._messages = 0  # calls sent to live ranks (run, pull, push): their events' call number
        self.history = History(config.max_restarts)  # a launch's restarts
        self._steps: dict = {}  # the last generation's steps, global rank -> its bar's last step
        self.shrunk = ""  # live ranks: why they run on fewer nodes than at first, said by the next run
        # A launch's view of each generation, ``make_view(display, show_after=...)``:
        # a background run (nblaunch.runs) draws into its cell and watches for run.stop().
        self.make_view = make_display
        self.engine: Engine = engine_for(config, live=live, owner=self)
        self.world_size = self.engine.world_size

    def release(self) -> None:
        """Close the engine, if made, and leave the launches in flight, safe twice (a press
        before the engine was handed back left it in flight: every later launch forkserver's)."""
        try:
            if getattr(self, "engine", None) is not None:  # not made, if its making was interrupted
                self.engine.close()
        finally:
            inflight.leave(self)

    # -- a launch ----------------------------------------------------------------------

    def launch(self, fn: Callable, args: list, kwargs: dict) -> LaunchResults:
        """``fn`` on fresh ranks; their results, or the error of the last attempt.

        With ``max_restarts`` a failed generation is replaced by a new one
        (``TORCHELASTIC_RESTART_COUNT`` counts them); each restart is said in
        the next generation's view, and the last attempt's ``WorkerError``
        lists every attempt's cause. A preemption (:mod:`nblaunch.preempt`)
        is never restarted: the job is ending."""
        global_method = ""  # not read yet
        try:
            global_method = multiprocessing.get_start_method(allow_none=True)
            return self._attempts(fn, args, kwargs)
        finally:
            self.release()
            if global_method is None:
                # Spawn and forkserver starts fix multiprocessing's default; the kernel had none.
                multiprocessing.set_start_method(None, force=True)

    def _attempts(self, fn: Callable, args: list, kwargs: dict) -> LaunchResults:
        c, engine = self.config, self.engine
        notices = [engine.notice] if engine.notice else []
        history = self.history = History(c.max_restarts)
        job = engine.job(fn, tuple(args), kwargs)
        catcher = Catcher(c.preempt_grace)  # armed while each generation's ranks run
        for attempt in range(c.max_restarts + 1):
            try:
                results = self._attempt(job, attempt, notices + history.lines, catcher)
                results.restarts = list(history.lines)
                return results
            except WorkerError as exc:
                if attempt == c.max_restarts or catcher.caught or not may_restart(self.engine, exc):
                    raise history.final(exc) from exc.__cause__
                self.restarts += 1
                history.record(exc, self._steps, engine.job_nodes, engine.job_world_size)
        raise AssertionError("unreachable")

    def _attempt(self, job: Any, attempt: int, notices: list[str], catcher: Optional[Catcher] = None) -> LaunchResults:
        """One generation of ranks with the launch's one call, its own view and log folder."""
        c, engine = self.config, self.engine
        pool, view, outcome, watch = None, None, "failed", None
        try:  # from here on, an interrupt anywhere leaves nothing open
            pool = engine.new_pool(job, attempt)
            self.world_size = engine.world_size  # a generation on fewer nodes has fewer ranks
            view = self.make_view(c.display, show_after=SHOW_AFTER_S)
            view.begin(self.world_size, engine.method, engine.backend or "", str(pool.log_dir))
            for text in notices + ([pool.notice] if pool.notice else []):
                view.notice(text)
            watch = LaunchWatch(pool, view, 0, timeout=c.timeout, stall_warning=c.stall_warning,
                              job_size=getattr(job, "size", 0), preemption=catcher)
            results = watch.run(lambda: engine.place(pool, view))
            outcome = "finished"
            if self.history.summary():  # the final summary says what it took
                view.notice(self.history.summary())
            return LaunchResults(results, str(pool.log_dir), pool.log_files)
        except KeyboardInterrupt:
            outcome = "interrupted"
            raise
        except LaunchTimeout:
            outcome = "timed out"
            raise
        except Preempted:
            outcome = "preempted"
            raise
        finally:
            self._steps = watch.steps if watch is not None else {}
            try:
                if pool is not None:
                    pool.close()
            finally:
                if view is not None:
                    view.close(outcome)

    # -- live ranks ----------------------------------------------------------------------

    def open(self) -> None:
        """Start a generation of live ranks and wait until each has made its
        process group (its call 0). Raises ``WorkerError`` if one cannot."""
        engine = self.engine
        self.world_size = engine.world_size  # fewer after a lost node (min_nodes)
        pool = engine.new_pool(None, self.restarts)
        view = TextDisplay(show_status=False)  # set-up prints (warnings) only
        view.begin(self.world_size, engine.method, engine.backend or "", str(pool.log_dir))
        for text in filter(None, [engine.notice, pool.notice]):
            view.notice(text)
        watch = LiveCallWatch(pool, view, 0)
        try:
            watch.run(lambda: engine.place(pool, view))
        except BaseException:
            _shut(pool)
            raise
        finally:
            view.flush()
        self.pool = pool

    def call(self, job: bytes, timeout: Optional[float], display: str, counted: bool) -> "tuple[list, CallWatch]":
        """One call on the live ranks; ``counted``: a ``run`` (the view's
        call number), not a pull or push. Returns the results and the watch
        (whose ``broken`` says whether the ranks must be replaced)."""
        if self.pool is None:  # an earlier restart failed
            self.restart()
        pool = self.pool
        self._messages += 1
        number = self._messages
        view = make_display(display, show_after=SHOW_AFTER_S)
        name = f"call {self.runs + counted}"
        view.begin(self.world_size, self.engine.method, self.engine.backend or "", str(pool.log_dir),
                   call=self.runs + counted if counted else 0)
        if self.shrunk and counted:  # the first run after a lost node says so
            view.notice(self.shrunk)
            self.shrunk = ""
        watch = LiveCallWatch(pool, view, number, timeout=timeout,
                          stall_warning=self.config.stall_warning, name=name)
        if counted:
            self.runs += 1

        def begin() -> None:
            for rank in range(pool.size):
                view.rank_status(rank, "running")
                pool.send(rank, Call(number, job, timeout))  # False: it died; its exit says so

        try:
            results = watch.run(begin)
        except BaseException as exc:
            view.close("interrupted" if isinstance(exc, KeyboardInterrupt)
                       else "timed out" if isinstance(exc, LaunchTimeout) else "failed")
            raise _with_note(exc, self._after(watch, exc)) from (exc.__cause__ if isinstance(exc, WorkerError) else None)
        view.close("finished")
        if watch.broken:
            warnings.warn(f"{name} returned, but {self._after(watch)}", RuntimeWarning, stacklevel=4)
        return LaunchResults(results, str(pool.log_dir), pool.log_files)

    def _after(self, watch: CallWatch, exc: Optional[BaseException] = None) -> str:
        """After a call that did not end well: replace broken ranks (on the
        nodes still up, when a node was lost and ``min_nodes`` allows); say
        what became of them."""
        if not watch.broken:
            others = " (the other ranks' calls were interrupted)" if watch.interrupted else ""
            return f"The live ranks are still up and keep their state{others}."
        if isinstance(exc, WorkerError) and exc.root.kind == "node" and may_restart(self.engine, exc):
            self.shrunk = f"the ranks run on the {self.engine.job_nodes} nodes still up since {exc.root.brief()}"
        try:
            self.restart()
        except BaseException as exc:  # noqa: BLE001 - said in the note; the next run tries again
            return (f"The ranks could not be kept ({watch.broken}), and starting new ones failed: {exc}. "
                    "The next run tries again.")
        on = f" on the {self.engine.job_nodes} nodes still up" if self.shrunk else ""
        return (f"The session restarted its ranks{on} ({watch.broken}): what earlier calls built in them "
                "is gone; run your set-up again.")

    def restart(self) -> None:
        """Replace the live ranks with a new generation (their state is lost)."""
        self.close()
        self.restarts += 1
        self.open()

    def close(self) -> None:
        """End the live ranks (safe twice, and from a finalizer)."""
        pool, self.pool = self.pool, None
        if pool is not None:
            _shut(pool)

    def end(self) -> None:
        """Close the ranks for good, and give back what the engine holds (an allocation it asked for)."""
        try:
            self.close()
        finally:
            self.release()


def _shut(pool: RankPool) -> None:
    """Ask every rank to leave, kill what has not within ``CLOSE_WAIT_S``, release everything."""
    for rank in range(pool.size):
        pool.send(rank, CLOSE)
    pool.wait(CLOSE_WAIT_S)
    pool.stop(STOP_GRACE_S)
    pool.close()


class _Generation:
    """The session, for the finalizer (which must not hold the ``Ranks``)."""

    def __init__(self, session: Session):
        self.session = session

    def close(self) -> None:
        self.session.end()


class Ranks:
    """Ranks that stay up between cells; made by :func:`start`.

    ``run(fn, *args, **kwargs)`` runs ``fn`` on every rank, in each rank's own
    namespace, with a launch's live view, and returns the per-rank results
    (or raises :class:`~nblaunch.WorkerError`, ``LaunchTimeout``,
    ``KeyboardInterrupt``). ``pull``/``push`` move named objects out of and
    into the ranks. ``close()`` ends them (so does the kernel's end, and this
    object being garbage collected). ``status`` says what is up.
    """

    def __init__(self, config: LaunchConfig):
        self._session = Session(config, live=True)
        self._finalizer = weakref.finalize(self, _Generation(self._session).close)
        self._closed = False
        self._session.open()

    # -- public -------------------------------------------------------------------

    def run(self, fn: Callable, *args, timeout: Optional[float] = None, display: Optional[str] = None,
            **kwargs):
        """``fn(*args, **kwargs)`` on every rank; returns ``[result of rank 0, ...]``.

        ``fn`` sees the rank's namespace: names it binds with ``global`` stay
        for later calls; names it uses from the notebook come with it, unless
        the rank bound that name itself (the rank's value wins). ``timeout``
        and ``display`` are this call's (see ``notebook_launcher``); to pass
        an argument of those names to ``fn``, use ``functools.partial``."""
        args, kwargs = check_call(fn, args, kwargs)
        check_call_options(timeout, display or "auto")
        return self._call(_pack(fn, tuple(args), kwargs), timeout, display or self._session.config.display, True)

    def pull(self, name: str, rank: Optional[int] = None):
        """The object bound to ``name`` in rank ``rank`` (None: a list, one per
        rank). Tensors come through shared memory; a module or optimizer is
        pulled as a copy (its ``state_dict()`` is usually what you want)."""
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"name must be an identifier, got {name!r}")
        if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int)
                                 or not 0 <= rank < self.num_processes):
            raise ValueError(f"rank must be None or an int in [0, {self.num_processes}), got {rank!r}")
        results = self._call(_pack(_pull_on, (name, rank), {}), None, "none", False)
        return list(results) if rank is None else results[rank]

    def push(self, **values) -> None:
        """Bind ``values`` by name in every rank (a copy each), replacing what a rank had."""
        self._call(_pack(namespace.push, (values,), {}), None, "none", False)

    def restart(self) -> None:
        """End the ranks and start new ones (their state is lost)."""
        self._check_usable()
        with one_at_a_time():
            self._session.restart()

    def close(self) -> None:
        """End the ranks. Closing twice is fine."""
        self._closed = True
        self._session.end()

    @property
    def restarts(self) -> int:
        """How many times the ranks were replaced (settable: a count of your own)."""
        return self._session.restarts

    @restarts.setter
    def restarts(self, value: int) -> None:
        self._session.restarts = value

    @property
    def num_processes(self) -> int:
        """The ranks up (fewer than at first once a lost node was left out: ``min_nodes``)."""
        return self._session.world_size

    @property
    def is_up(self) -> bool:
        return not self._closed and self._session.pool is not None

    @property
    def pids(self) -> list[int]:
        pool = self._session.pool
        return list(pool.pids) if pool is not None else []

    @property
    def status(self) -> str:
        """``up``, ``closed``, or what is wrong; with the ranks, calls and restarts."""
        session = self._session
        pool = session.pool
        if self._closed or pool is None:
            return "closed"
        dead = [pool.global_rank(r) for r in range(pool.size) if not pool.alive(r)]
        engine = session.engine
        what = f"{self.num_processes} ranks ({engine.method}, {engine.backend or 'no process group'})"
        if dead:
            return (f"down: {ranks_label(dead)} ended outside a call; the next run reports it and restarts the ranks "
                    f"(their state is lost) | {what}")
        restarts = f", restarted {session.restarts}x" if session.restarts else ""
        return f"up: {what}, {session.runs} calls{restarts} | output: {pool.log_dir}"

    def __repr__(self) -> str:
        return f"<nblaunch.Ranks {self.status}>"

    def __enter__(self) -> "Ranks":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- inside ---------------------------------------------------------------------

    def _check_usable(self) -> None:
        if self._closed:
            raise LaunchError("these live ranks were closed; start new ones with nblaunch.start()")
        if worker.current_spec() is not None:
            raise LaunchError("live ranks cannot be used from inside a rank; call from the notebook")

    def _call(self, job: bytes, timeout: Optional[float], display: str, counted: bool):
        self._check_usable()
        with one_at_a_time():
            return self._session.call(job, timeout, display, counted)


def _with_note(exc: BaseException, note: str) -> BaseException:
    if isinstance(exc, WorkerError):
        return with_rank_frames(WorkerError(exc.failures, exc.log_dir, note=note))
    if isinstance(exc, LaunchTimeout):
        return LaunchTimeout(f"{exc}\n{note}", log_dir=exc.log_dir)
    render = getattr(exc, "_render_traceback_", None)
    if isinstance(exc, KeyboardInterrupt) and render is not None and "restarted" in note:
        lines = render()
        render_interrupt(exc, lines + [note])
    return exc


def one_at_a_time(what: str = "a launch or a call on live ranks is already running in this kernel "
                               "(from another thread); wait for it to return") -> threading.Lock:
    """For a ``with`` statement: one launch or call on live ranks at a time
    in this kernel (see ``_one_at_a_time_lock``). A second is refused at
    once; two begun at the very same instant run one after the other."""
    if _one_at_a_time_lock.locked():
        raise LaunchError(what)
    return _one_at_a_time_lock


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
          stall_warning: Optional[float] = 60.0, cluster=None, num_nodes: int = 1,
          min_nodes: Optional[int] = None) -> Ranks:
    """Start ``num_processes`` ranks that stay up across cells; returns :class:`Ranks`.

    The ranks get what a ``notebook_launcher`` rank gets (torchrun's
    environment, a process group, the rank's device) once, then wait for
    ``run`` calls. One session per kernel at a time; ``notebook_launcher``
    still works while one is up (not at the same moment as a call). Use it as
    a context manager, or ``close()`` it; it also ends with the kernel.
    ``cluster="slurm"`` (and ``num_nodes``): ranks on the nodes of a SLURM
    allocation, as ``notebook_launcher`` has them; ``min_nodes``: when a
    node is lost, the ranks are restarted on the nodes still up if at least
    this many (the next run says so).
    """
    global _active
    config = LaunchConfig(num_processes, start_method=start_method, backend=backend,
                          init_process_group=init_process_group, master_addr=master_addr,
                          threads_per_rank=threads_per_rank, display=display, stall_warning=stall_warning,
                          cluster=cluster, num_nodes=num_nodes, min_nodes=min_nodes)
    if worker.current_spec() is not None:
        raise LaunchError("nblaunch.start was called inside a rank; start live ranks from the notebook")
    up = active()
    status = up.status if up is not None else None
    del up  # a traceback kept by IPython must not keep the session alive
    if status is not None:
        raise LaunchError(f"live ranks are already up in this kernel ({status}); "
                          "close them first (ranks.close() or %nblaunch stop)")
    with one_at_a_time():
        ranks = Ranks(config)
    _active = weakref.ref(ranks)
    return ranks
