"""Sessions: the ranks of a launch, or of live ranks that stay up across cells.

A :class:`Session` owns the config, the engine and each generation of ranks (a
:class:`~nblaunch.engines.pool.RankPool`); every call on it is one
:class:`~nblaunch.watch.call.CallWatch`. ``notebook_launcher`` is a session whose
ranks serve one call; live ranks (:mod:`nblaunch.live`) are a session whose
ranks serve calls until closed.

A call that fails on some live ranks interrupts the others
(``KeyboardInterrupt`` in their Python code) and keeps every rank. The ranks
are restarted, and the error says so, when they cannot be brought back to a
sound state: a rank died, a rank did not answer the interrupt within
``watch.live.INTERRUPT_GRACE_S`` (blocked in a collective its peers never
joined), or the ranks issued different numbers of collectives on the default
group (their next one would pair with the wrong operation). Never a
silently half-working session.
"""
from __future__ import annotations

import itertools
import multiprocessing
import sys
import threading
import warnings
from typing import Any, Callable, Optional

from .wire.channel import CLOSE, Call
from .config import LaunchConfig
from .view import SHOW_AFTER_S, TextDisplay, make_display
from . import registry
from .engines import Engine, engine_for
from .errors import LaunchError, LaunchTimeout, WorkerError, render_interrupt
from .outcome import status_of
from .watch.preempt import Catcher
from .watch.restarts import History, may_restart
from .watch.resize import Resized
from .engines.pool import RankPool
from .engines.procs import InterruptsDeferred
from .watch.launch import LaunchWatch
from .watch.live import LiveCallWatch
from .watch.postmortem import with_rank_frames
from .watch.call import STOP_GRACE_S, CallWatch

__all__ = ["Session", "LaunchResults", "one_at_a_time"]

CLOSE_WAIT_S = 2.0  # close -> ranks gone on their own, before they are killed

# One launch or call at a time per process. Two at once (cells run from threads)
# hung 1 time in 10 to 90: a rank forked while the other launch's store thread held
# glibc's resolver lock deadlocks in getnameinfo (gdb). A second one is refused at
# once. Taken by ``with``: a press just after an ``acquire()`` kept it for good.


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
    Live ranks (:meth:`open`, :meth:`call`, :meth:`close_ranks`) serve calls until
    closed, and a generation that can no longer be trusted is replaced
    before the next call. Each call is one :class:`~nblaunch.watch.call.CallWatch`."""

    def __init__(self, config: LaunchConfig, live: bool, kept_in: Optional[list] = None):
        if kept_in is not None:
            kept_in.append(self)  # first: its maker releases it (``release_engine``) whatever comes next
        self.config, self.live = config, live
        self.pool: Optional[RankPool] = None
        self.restarts = 0
        self.runs = 0  # run calls made on live ranks (pull and push are not counted)
        self._messages = 0  # calls sent to live ranks (run, pull, push): their events' call number
        self.history = History(config.max_restarts)  # a launch's restarts
        self._steps: dict = {}  # the last generation's steps, global rank -> its bar's last step
        self.shrunk = ""  # live ranks: why they run on fewer nodes than at first, said by the next run
        self.calling = False  # a call on live ranks is under way (its view names a lost node)
        # A launch's view of each generation, ``make_view(display, show_after=...)``
        # (a background run draws into its cell), and its owner's stop, asked each
        # tick (a background run's ``run.stop()``: the launch raises RunStopped).
        self.make_view = make_display
        self.stop_requested: Callable[[], bool] = lambda: False
        self.engine: Engine = engine_for(config, live=live, owner=self)
        self.world_size = self.engine.world_size

    def release_engine(self) -> None:
        """Close the engine, if made (not if its making was interrupted), and leave the launches in
        flight, safe twice (a press before the engine was handed back left it in flight for good)."""
        try:
            if getattr(self, "engine", None) is not None:
                self.engine.close()
        finally:
            registry.leave(self)

    # -- a launch ----------------------------------------------------------------------

    def launch(self, fn: Callable, args: list, kwargs: dict) -> LaunchResults:
        """``fn`` on fresh ranks; their results, or the error of the last attempt.

        With ``max_restarts`` a failed generation is replaced by a new one
        (``TORCHELASTIC_RESTART_COUNT`` counts them); each restart is said in
        the next generation's view, and the last attempt's ``WorkerError``
        lists every attempt's cause. A preemption (:mod:`nblaunch.watch.preempt`)
        is never restarted: the job is ending."""
        global_method = ""  # not read yet
        try:
            global_method = multiprocessing.get_start_method(allow_none=True)
            return self._attempts(fn, args, kwargs)
        finally:
            self.release_engine()
            if global_method is None:  # spawn and forkserver starts fix multiprocessing's default
                multiprocessing.set_start_method(None, force=True)

    def _attempts(self, fn: Callable, args: list, kwargs: dict) -> LaunchResults:
        """Generation after generation, as torch elastic's ``_invoke_run``: a
        failure restarts while ``max_restarts`` allows; nodes back (``min_nodes``)
        restart into the larger world, never counted."""
        c, engine = self.config, self.engine
        notices = [engine.notice] if engine.notice else []
        history = self.history
        job = engine.job(fn, tuple(args), kwargs)
        catcher = Catcher(c.preempt_grace)  # armed while each generation's ranks run
        history.begin(engine.job_nodes)
        failed, said, grown = 0, [], []
        for attempt in itertools.count():
            said += engine.said()  # a replacement node asked for, granted, given back
            just_grown, grown = grown, []  # the nodes this generation was grown onto
            try:
                results = self._attempt(job, attempt, notices + history.lines + said, catcher)
                results.restarts = list(history.lines)
                return results
            except Resized as resized:
                grown = engine.grow(resized.nodes)
                history.resized([engine.node_label(n) for n in grown or resized.nodes], engine.job_nodes,
                                engine.job_world_size, taken=bool(grown))
            except WorkerError as exc:
                if failed == c.max_restarts or catcher.caught or not may_restart(self.engine, exc):
                    raise history.final(exc) from exc.__cause__
                failed += 1
                self.restarts += 1
                history.record(exc, self._steps, engine.job_nodes, engine.job_world_size)
            except LaunchError as exc:  # not a WorkerError (a subclass): a generation that could not start
                # A generation grown onto nodes back that could not start: one went again between its
                # last probe and the start. The run goes on without them, as after a lost node.
                labels = [engine.node_label(n) for n in just_grown]
                if not just_grown or isinstance(exc, LaunchTimeout) or not engine.ungrow(just_grown):
                    raise
                history.resized(labels, engine.job_nodes, engine.job_world_size, taken=False)
        raise AssertionError("unreachable")

    def _attempt(self, job: Any, attempt: int, notices: list[str], catcher: Optional[Catcher] = None) -> LaunchResults:
        """One generation of ranks with the launch's one call, its own view and log folder."""
        c, engine = self.config, self.engine
        pool, view, status, watch = None, None, "failed", None
        try:  # from here on, an interrupt anywhere leaves nothing open
            with InterruptsDeferred():  # made, then kept: a press as it returned lost it
                pool = engine.new_pool(job, attempt)
            self.world_size = engine.world_size  # a generation on fewer nodes has fewer ranks
            view = self.make_view(c.display, show_after=SHOW_AFTER_S)
            view.begin(self.world_size, engine.method, engine.backend or "", str(pool.log_dir))
            for text in notices + ([pool.notice] if pool.notice else []):
                view.notice(text)
            watch = LaunchWatch(pool, view, 0, timeout=c.timeout, stall_warning=c.stall_warning,
                                job_size=getattr(job, "size", 0), preemption=catcher,
                                nodes_back=engine.nodes_back if c.min_nodes is not None else None,
                                node_label=engine.node_label,
                                resized_elsewhere=engine.resized_elsewhere if c.min_nodes is not None else None,
                                stop_requested=self.stop_requested)
            results = watch.run(lambda: engine.place(pool, view))
            status = "finished"
            if self.history.summary():  # the final summary says what it took
                view.notice(self.history.summary())
            return LaunchResults(results, str(pool.log_dir), pool.log_files)
        except BaseException as exc:
            status = "resized" if isinstance(exc, Resized) else status_of(exc)
            raise
        finally:
            self._steps = watch.steps if watch is not None else {}
            try:
                if pool is not None:
                    pool.close()
            finally:
                if view is not None:
                    view.close(status)

    # -- live ranks ----------------------------------------------------------------------

    def open(self) -> None:
        """Start a generation of live ranks and wait until each has made its
        process group (its call 0). Raises ``WorkerError`` if one cannot."""
        engine, pool, view = self.engine, None, TextDisplay(show_status=False)  # set-up prints (warnings) only
        self.world_size = engine.world_size  # fewer after a lost node (min_nodes)
        try:  # from the pool's making on, an interrupt anywhere shuts it
            with InterruptsDeferred():  # made, then kept: a press as it returned lost it
                pool = engine.new_pool(None, self.restarts)
            view.begin(self.world_size, engine.method, engine.backend or "", str(pool.log_dir))
            for text in filter(None, [engine.notice, pool.notice]):
                view.notice(text)
            LiveCallWatch(pool, view, 0).run(lambda: engine.place(pool, view))
            self.pool = pool
            pool.on_lost = self._lost_between_calls
        except BaseException:
            self.pool = None
            if pool is not None:
                _shut(pool)
            raise
        finally:
            view.flush()

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
        for line in self.engine.said() if counted else []:
            view.notice(line)
        back = self.engine.nodes_back() if counted and self.config.min_nodes is not None else []
        if back:  # live ranks never grow unasked: their state would be lost
            back = [self.engine.node_label(n) for n in back]
            view.notice(f"{', '.join(back)} {'is' if len(back) == 1 else 'are'} back: ranks.grow() takes "
                        f"{'it' if len(back) == 1 else 'them'} in (the ranks restart on more nodes; what they hold is lost)")
        watch = LiveCallWatch(pool, view, number, timeout=timeout,
                          stall_warning=self.config.stall_warning, name=name)
        if counted:
            self.runs += 1

        def begin() -> None:
            for rank in range(pool.size):
                view.rank_status(rank, "running")
                pool.send(rank, Call(number, job, timeout))  # False: it died; its exit says so

        try:
            self.calling = True
            results = watch.run(begin)
        except BaseException as exc:
            view.close(status_of(exc))
            raise _with_note(exc, self._recover(watch, exc)) from (exc.__cause__ if isinstance(exc, WorkerError) else None)
        finally:
            self.calling = False
        view.close("finished")
        if watch.broken:
            warnings.warn(f"{name} returned, but {self._recover(watch)}", RuntimeWarning, stacklevel=4)
        return LaunchResults(results, str(pool.log_dir), pool.log_files)

    def _lost_between_calls(self, line: str) -> None:
        """(the pool's heartbeat thread) A node of the live ranks was lost: said at once when no call
        runs (a call's view names it), on stderr, which a kernel shows in the cell running or last run."""
        if not self.calling:
            print(f"nblaunch: {line} while no call ran; {self.next_run_restarts()}", file=sys.stderr, flush=True)

    def next_run_restarts(self) -> str:
        """What the next run does about ranks lost between calls."""
        on = " on the nodes still up" if self.config.min_nodes else ""
        return f"the next run reports it and restarts the ranks{on} (their state is lost)"

    def _recover(self, watch: CallWatch, exc: Optional[BaseException] = None) -> str:
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

    def grow(self) -> list:
        """Live ranks onto the nodes back (``engine.nodes_back``), restarted: their state is lost.
        Returns the nodes taken in (none: nothing was back, the ranks are left as they are)."""
        back = self.engine.grow(self.engine.nodes_back())
        if back:
            self.restart()
        return back

    def restart(self) -> None:
        """Replace the live ranks with a new generation (their state is lost)."""
        self.close_ranks()
        self.restarts += 1
        self.open()

    def close_ranks(self) -> None:
        """End the live ranks (safe twice, from a finalizer, and before its making was done)."""
        pool, self.pool = getattr(self, "pool", None), None
        if pool is not None:
            _shut(pool)

    def end(self) -> None:
        """Close the ranks for good, and give back what the engine holds (an allocation it asked for)."""
        try:
            self.close_ranks()
        finally:
            self.release_engine()


def _shut(pool: RankPool) -> None:
    """Ask every rank to leave, kill what has not within ``CLOSE_WAIT_S``, release everything."""
    for rank in range(pool.size):
        pool.send(rank, CLOSE)
    pool.wait(CLOSE_WAIT_S)
    pool.stop(STOP_GRACE_S)
    pool.close()


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
    in this kernel (:data:`nblaunch.registry.foreground`). A second is refused
    at once; two begun at the very same instant run one after the other."""
    if registry.foreground.locked():
        raise LaunchError(what)
    return registry.foreground
