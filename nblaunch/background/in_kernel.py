"""Background runs: ``nblaunch.submit`` (:mod:`nblaunch.background.submit`) returns a :class:`Run` at once.

    run = nblaunch.submit(train, args=(cfg,), num_processes=4)   # the cell returns
    run.done(), run.status                                         # meanwhile, in other cells
    run.result()                                                   # LaunchResults, or the WorkerError
    run.stop()                                                     # every rank stopped and cleaned up

A run is a launch (:class:`~nblaunch.session.Session`) whose call watch runs
in a thread of its own rather than the cell's, so the kernel runs other
cells meanwhile, and several runs train side by side, each with its own
ranks, process groups, store port and view. What makes that safe and not
just possible: a run's ranks start from the forkserver, not by a fork of
the kernel (``plan.choose_start_method``, ``shared``), since the kernel's
other threads hold what locks they please at any instant.

The run's thread never receives the kernel's interrupt (Python delivers
signals to the main thread only), so interrupting a cell leaves every run
alone. ``run.stop()`` sets the run's stop event, which its session's call
watch asks each tick (``Session.stop_requested``, within 0.1 s); the watch
then does what it does on an interrupt (stacks, SIGTERM, SIGKILL, the
tree-wide clean-up), raises ``RunStopped``, and the run ends ``stopped``.

The view is shown where ``submit`` was called, drawn into a display made
there (:class:`~nblaunch.view.WidgetDisplay`'s ``handle``) and fed from the
run's thread, which runs in a copy of the cell's context (ipykernel 7 sends
what a thread prints to the cell of its context). ``detach=True`` hands the
run to a supervisor process instead (:mod:`nblaunch.background.detached`).
"""
from __future__ import annotations

import contextvars
import itertools
import threading
import time
import uuid
from typing import Callable, Optional

from ..config import LaunchConfig
from ..errors import RunStopped
from ..outcome import STATUSES, Outcome
from ..session import LaunchResults, Session
from ..view import SHOW_AFTER_S, WidgetDisplay, make_display
from ..view.base import in_kernel
from .. import registry
from ..engines.plan import SHARED_WHY
from ..wire.payload import check_sendable

__all__ = ["Run", "start_here", "new_id", "config_shows_widgets"]
_done_lock = threading.Lock()  # a run's end and its done callbacks
_numbers = itertools.count(1)


class _RunView:
    """The run's view as the session sees it: the real one (drawn into the
    run's cell), noting the log folder and the run's start."""

    def __init__(self, run: "Run", inner):
        self._run, self._inner = run, inner

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def begin(self, world_size, method, backend, log_dir, call=0) -> None:
        self._run.log_dir = log_dir
        self._inner.begin(world_size, method, backend, log_dir, call)

    def show(self) -> None:
        self._inner.show()
        self._run._set_status("running")  # after: a running run's view is there to show again



class Run:
    """A launch training in the background (``concurrent.futures.Future``-like).

    ``id``: its name in this kernel (``nblaunch.runs()``); ``status``:
    ``starting``, ``running``, ``finished``, ``failed``, ``stopped``,
    ``timed out`` or ``preempted``; ``log_dir``: the ranks' full output (once started).
    ``done()``, ``result(timeout=None)`` (the ``LaunchResults``, or raises
    the run's error: ``WorkerError``, ``LaunchTimeout``, :class:`RunStopped`),
    ``exception(timeout=None)``, ``stop()``, ``view()`` (the live view again,
    in the current cell)."""

    detached = False

    def __init__(self, run_id: str, config: LaunchConfig):
        self.id = run_id
        self.config = config
        self.log_dir: Optional[str] = None
        self.started_at = time.time()
        self.ended_at: Optional[float] = None
        self._status = "starting"
        self._stop = threading.Event()
        self._done = threading.Event()
        self._results: Optional[LaunchResults] = None
        self._error: Optional[BaseException] = None
        self._views: list = []  # each generation's view, the newest last
        self._callbacks: list = []

    # -- the Future-like part ----------------------------------------------------

    @property
    def status(self) -> str:
        return self._status

    def done(self) -> bool:
        return self._done.is_set()

    def running(self) -> bool:
        return not self.done()

    def result(self, timeout: Optional[float] = None) -> LaunchResults:
        """The per-rank results once the run ends; raises its error, or
        ``TimeoutError`` if it is still running after ``timeout`` seconds."""
        error = self.exception(timeout)
        if error is not None:
            raise error
        return self._results

    def exception(self, timeout: Optional[float] = None) -> Optional[BaseException]:
        if not self._done.wait(timeout):
            raise TimeoutError(f"run {self.id} is still {self._status} after {timeout:g} s")
        return self._error

    def add_done_callback(self, fn: Callable[["Run"], None]) -> None:
        """``fn(run)`` once the run ends (at once if it has), in the run's thread."""
        with _done_lock:
            if not self._done.is_set():
                self._callbacks.append(fn)
                return
        fn(self)

    def stop(self, timeout: Optional[float] = 30.0) -> None:
        """Stop every rank (what an interrupt does to a launch) and wait up
        to ``timeout`` seconds for the run to end. Safe on a run that ended."""
        self._stop.set()
        self._done.wait(timeout)

    def view(self) -> None:
        """Show the run's view in the current cell (live while it runs)."""
        from IPython.display import display

        view = self._views[-1] if self._views else None
        if view is None:
            print(repr(self))
        elif getattr(view, "box", None) is not None and not self.done():
            display(view.box)
        elif hasattr(view, "static_html") and getattr(view, "header", None) is not None:
            display({"text/html": view.static_html(), "text/plain": view.static_text()}, raw=True)
        else:
            print(repr(self))

    def view_state(self):
        """The model of the run's newest view (``LaunchState``: each rank's
        bars and metrics), or None before its first."""
        view = self._views[-1] if self._views else None
        return getattr(view, "state", None)

    def forget(self) -> None:
        """Drop the run from ``nblaunch.runs()`` (stopping it first if it still runs)."""
        if not self.done():
            self.stop()
        for view in self._views:  # the widgets a reopened tab would show: kept until now
            if isinstance(view, WidgetDisplay):
                view.drop_widgets()
        registry.drop_run(self.id)

    def __repr__(self) -> str:
        took = f", {time.time() - self.started_at:.0f} s" if not self.done() else ""
        where = f" | output: {self.log_dir}" if self.log_dir else ""
        return (f"<nblaunch.Run {self.id}: {self._status}{took}, {self.config.num_processes} ranks"
                f"{' (detached)' if self.detached else ''}{where}>")

    # -- inside -------------------------------------------------------------------------

    def _set_status(self, status: str) -> None:
        if self._status not in STATUSES:
            self._status = status

    def _finish(self, outcome: Outcome) -> None:
        error = outcome.error
        if isinstance(error, RunStopped):
            error = error.named(self.id)
        self._results, self._error = outcome.results, error
        self.ended_at = self.ended_at or time.time()
        with _done_lock:
            self._status = outcome.status
            self._done.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            try:
                fn(self)
            except Exception as exc:  # noqa: BLE001 - one callback must not keep the others
                print(f"[nblaunch] run {self.id}: a done callback failed: {exc!r}")

    def _watch(self, session: Session, fn, args, kwargs, release: Callable[[], None]) -> None:
        """The run's thread: the launch, its verdict kept for ``result``.
        ``release`` (once the ranks are gone, before the verdict is out):
        the run is no longer in flight."""
        try:
            if self._stop.is_set():
                raise RunStopped(self.id, log_dir=self.log_dir)
            session.stop_requested = self._stop.is_set
            outcome = Outcome.finished(session.launch(fn, args, kwargs))
        except BaseException as exc:  # noqa: BLE001 - the run's verdict, raised by result()
            outcome = Outcome.of(exc)
        finally:
            try:
                session.engine.close()  # safe twice: the launch closed it, unless stopped before it began
            finally:
                release()
        self._finish(outcome)


def start_here(run_id: str, config: LaunchConfig, fn, args: list, kwargs: dict) -> Run:
    """The run's thread makes its session (its engine: seconds for a cluster's,
    ``import torch`` for the first launch of a kernel) and watches the launch."""
    if config.start_method == "fork":  # said now, not in the run's thread (plan.choose_start_method)
        raise ValueError("start_method='fork' cannot be used for a background run: " + SHARED_WHY
                         + ". Use 'auto' (the forkserver), or notebook_launcher.")
    check_sendable(fn, args, kwargs)  # pickled for the forkserver: what cannot be sent is named now
    run = Run(run_id, config)
    make_view = _view_maker(run)
    # In flight from now, not from when its thread has made the engine: a
    # launch the cell makes next must not fork while this thread runs.
    def leave() -> None:
        registry.leave(run)

    def watch() -> None:
        try:
            session = Session(config, live=False)
        except BaseException as exc:  # noqa: BLE001 - the run's verdict, raised by result()
            leave()
            run._finish(Outcome.of(exc))
            return
        session.make_view = make_view
        run._watch(session, fn, args, kwargs, release=leave)

    try:
        registry.enter(run, lambda others: None)
        threading.Thread(target=contextvars.copy_context().run, args=(watch,), name=f"nblaunch-run-{run_id}",
                         daemon=True).start()
    except BaseException:
        leave()
        raise
    return run


def _view_maker(run: Run) -> Callable:
    """Each generation's view: drawn into a display made now, in the calling
    cell (widgets), or printing (text, in the run's thread)."""
    handle = None
    if config_shows_widgets(run.config.display):
        from IPython.display import HTML, display

        handle = display(HTML(f"<i>nblaunch: run {run.id} starting</i>"), display_id=True)

    def make(kind: str, show_after: float = SHOW_AFTER_S):
        inner = (WidgetDisplay(handle=handle, keep_widgets=True) if handle is not None
                 else make_display(kind, show_after=show_after))
        run._views.append(inner)
        return _RunView(run, inner)

    return make


def config_shows_widgets(display: str) -> bool:
    """Whether ``display`` means widgets here (a kernel with ipywidgets)."""
    import importlib.util

    if display == "widget":
        return True
    return display == "auto" and in_kernel() and importlib.util.find_spec("ipywidgets") is not None


def new_id() -> str:
    return f"{time.strftime('%m%d-%H%M%S')}-{next(_numbers)}-{uuid.uuid4().hex[:4]}"
