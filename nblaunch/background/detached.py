"""Detached runs: ``nblaunch.submit(..., detach=True)`` and ``nblaunch.attach(run_id)``.

A detached run is owned by a supervisor process (:mod:`nblaunch.background.supervisor`)
in a session of its own: restarting the kernel, its crash, or Jupyter
killing the kernel's process group leave it training. Its state is kept on
disk, in a run folder under :func:`runs_root`; any kernel of this machine
reads it: :func:`attach` redraws the run's view with its history (progress,
metric charts, the last lines the ranks printed) and follows it;
``nblaunch.runs(all=True)`` lists every detached run. The folder (the
ranks' logs with it) is kept until ``run.forget()``.

The kernel and the supervisor share nothing but that folder and one
signal: ``run.stop()`` sends SIGTERM to the supervisor, named by its
identity (pid and start time, :mod:`nblaunch.system.procid`: a pid reused by
another process is never signalled), and it stops the ranks as an
interrupt stops a launch.
"""
from __future__ import annotations

import collections
import contextvars
import os
import pickle
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

from ..system import procid
from ..errors import LaunchError, RunStopped, WorkerError
from ..outcome import Outcome
from ..watch.postmortem import with_rank_frames
from .folder import Asked, Ended, RunFolder, Snapshot
from .. import registry
from .in_kernel import Run, config_shows_widgets
from ..session import LaunchResults
from ..view import WidgetDisplay, make_display
from ..wire.payload import CloudJob

__all__ = ["start_detached", "attach", "detached_run", "detached_runs", "runs_root", "FOLLOW_EVERY_S"]

FOLLOW_EVERY_S = 0.2
_LINE = re.compile(r"\[rank (\d+)\] (.*)", re.S)
RUN_ID = re.compile(r"[\w.-]+")  # a folder's name under runs_root(), never a path


def runs_root() -> Path:
    """``$NBLAUNCH_RUNS_DIR``, else ``$XDG_CACHE_HOME/nblaunch/runs`` (``~/.cache/nblaunch/runs``)."""
    explicit = os.environ.get("NBLAUNCH_RUNS_DIR")
    if explicit:
        return Path(explicit)
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "nblaunch" / "runs"


class DetachedRun(Run):
    """A run whose supervisor keeps it on disk; a :class:`~nblaunch.background.in_kernel.Run`
    in every respect, read from its folder (``run_dir``)."""

    detached = True

    def __init__(self, folder: RunFolder, config, proc: Optional[subprocess.Popen] = None):
        super().__init__(folder.run_id, config)
        self.folder = folder
        self.run_dir = folder.path
        self._proc = proc  # the supervisor, where this kernel started it (reaped here)
        self._lock = threading.Lock()
        self._ended: Optional[Ended] = None  # its outcome once read; the results unpickled on result() only

    # -- what is on disk -------------------------------------------------------------

    @property
    def status(self) -> str:
        self.refresh()
        return self._status

    def done(self) -> bool:
        self.refresh()
        return self._done.is_set()

    def result(self, timeout: Optional[float] = None) -> LaunchResults:
        super().result(timeout)
        with self._lock:
            if self._results is None and self._ended is not None and self._ended.status == "finished":
                ended = self._ended
                self._results = LaunchResults(ended.loaded_results(), ended.log_dir, ended.log_files)
        return self._results

    def view_state(self):
        snapshot = self.folder.state()
        return None if snapshot is None else snapshot.state

    def exception(self, timeout: Optional[float] = None) -> Optional[BaseException]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.done():
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"run {self.id} is still {self._status} after {timeout:g} s")
            self._done.wait(FOLLOW_EVERY_S)
        return self._error

    def refresh(self, snapshot: Optional[Snapshot] = None) -> Optional[Snapshot]:
        """Read the run's folder: its outcome once it ended, else its state
        (returned). A supervisor gone without an outcome is a failure."""
        with self._lock:
            if self._done.is_set():
                return None
            if self._proc is not None:
                self._proc.poll()  # reaps it once it left
            ended = self.folder.outcome()
            if ended is not None:
                self._conclude(ended)
                return None
            snapshot = snapshot or self.folder.state()
            if snapshot is not None:
                self._status = "running" if snapshot.status == "running" else self._status
                self.log_dir = snapshot.state.log_dir or self.log_dir
            if not _supervisor_running(self.folder) and self.folder.outcome() is None:
                if self._stop.is_set():  # stopped before it could say so (SIGTERM while it started)
                    self._conclude(Ended("stopped"))
                    return None
                self._finish(Outcome.of(LaunchError(
                    f"the supervisor of run {self.id} ended without an outcome (killed?); its ranks ended "
                    f"with it. Its output: {self.folder.supervisor_log}; the ranks' output: {self.folder.logs}")))
                return None
            return snapshot

    def _conclude(self, ended: Ended) -> None:
        self.log_dir = ended.log_dir or self.log_dir
        self._ended, self.ended_at = ended, ended.ended or time.time()
        if ended.status == "finished":
            self._finish(Outcome.finished(None))  # the results: read by result(), not by every look at the run
            return
        error = ended.error
        if isinstance(error, WorkerError):  # its traceback did not travel: %debug opens the rank's frames
            error = with_rank_frames(error)
        elif ended.status == "stopped" and not isinstance(error, RunStopped):  # a folder of an earlier nblaunch
            error = RunStopped(self.id, log_dir=self.log_dir)
        self._finish(Outcome(ended.status, error=error or LaunchError(
            f"run {self.id} {ended.status}: {ended.error_text}".strip())))

    # -- acting ------------------------------------------------------------------------

    def stop(self, timeout: Optional[float] = 30.0) -> None:
        if not self.done():
            self._stop.set()
            self.folder.ask_stop()  # this SIGTERM is a stop, not SLURM's notice
            _signal_supervisor(self.folder, signal.SIGTERM)
        try:
            self.exception(timeout)
        except TimeoutError:
            pass

    def forget(self) -> None:
        """Stop the run if it still trains, then remove its folder (its state,
        results and the ranks' logs): nothing of it is left."""
        self.stop()
        ident = self.folder.identity()
        deadline = time.monotonic() + 10
        while ident and procid.same_process(ident) and time.monotonic() < deadline:
            if self._proc is not None:
                self._proc.poll()
            time.sleep(0.02)  # the supervisor leaves right after writing its outcome
        if self._proc is not None:
            self._proc.wait(1)
        self.folder.remove()
        super().forget()

    # -- the view -------------------------------------------------------------------------

    def follow(self, display: Optional[str] = None, wait: bool = False) -> None:
        """Draw the run's view in the current cell (its history at once)
        and keep it moving, from a thread, until the run ends; ``display``
        (the run's own by default): ``"text"`` for a terminal; ``wait``:
        follow it in this thread, returning once it ended (an interrupt
        leaves the run going)."""
        display = display or self.config.display
        if display == "none":
            return
        handle = None
        if config_shows_widgets(display):
            from IPython.display import HTML, display

            handle = display(HTML(f"<i>nblaunch: run {self.id}</i>"), display_id=True)
        view = (WidgetDisplay(handle=handle, keep_widgets=True) if handle is not None
                else make_display(display))
        self._views.append(view)
        drawn = {"snapshot": None, "lines": 0, "generation": -1}  # what this view shows
        self._draw(view, self.refresh(), drawn)
        if wait:
            self._follow(view, drawn)
            return
        threading.Thread(target=contextvars.copy_context().run, args=(self._follow, view, drawn),
                         name=f"nblaunch-follow-{self.id}", daemon=True).start()

    def _follow(self, view, drawn: dict) -> None:
        while True:
            snapshot = self.refresh()
            if snapshot is None and self._done.is_set():
                break
            self._draw(view, snapshot, drawn)
            time.sleep(FOLLOW_EVERY_S)
        self._draw(view, self.folder.state(), drawn)
        view.close(self._status)

    def _draw(self, view, snapshot: Optional[Snapshot], drawn: dict) -> None:
        """The supervisor's model, and the lines printed since ``drawn`` (this view's last draw)."""
        if snapshot is None or snapshot is drawn["snapshot"]:
            if snapshot is not None:
                view.tick()  # the elapsed time moves on
            return
        drawn["snapshot"] = snapshot
        state = snapshot.state
        if len(self._views) > 1:  # each view its own model (a view marks what it drew in it)
            state = pickle.loads(pickle.dumps(state))
        if snapshot.generation != drawn["generation"]:  # a restart's new generation
            drawn["generation"], drawn["lines"] = snapshot.generation, 0
            view.begin(state.world_size, state.method, state.backend, state.log_dir, state.call)
        tail = snapshot.tail
        new = min(snapshot.lines - drawn["lines"], len(tail))
        drawn["lines"] = snapshot.lines
        fresh = tail[len(tail) - new:] if new > 0 else []
        view.state = state
        state.changed = True
        kept = collections.deque(state.tail, maxlen=state.tail.maxlen)  # the supervisor's tail, already whole
        for line in fresh:
            m = _LINE.match(line)
            if m:
                view.rank_lines(int(m.group(1)) - state.first_rank, [m.group(2)])
        state.tail = kept
        if getattr(view, "box", True) is None:
            view.show()
        view.tick(force=True) if isinstance(view, WidgetDisplay) else view.tick()


def start_detached(run_id: str, config, fn, args: list, kwargs: dict) -> DetachedRun:
    """Write the run's folder and start its supervisor (in a session of its own)."""
    folder = RunFolder.make(runs_root(), run_id)
    try:
        job = CloudJob(fn, tuple(args), kwargs).pack(sharing=False)  # by value: the supervisor is a new process
        folder.write_asked(Asked(config))
        folder.write_job(job, sys.path, os.getcwd())
        package_parent = str(Path(__file__).resolve().parents[2])  # the folder holding the nblaunch package
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [package_parent,
                                                                       os.environ.get("PYTHONPATH")])))
        with open(folder.supervisor_log, "wb") as log:
            proc = subprocess.Popen([sys.executable, "-m", "nblaunch.background.supervisor", str(folder.path)],
                                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True, close_fds=True, env=env, cwd=os.getcwd())
        folder.write_identity(procid.identity(proc.pid))
    except BaseException:
        folder.remove()
        raise
    run = DetachedRun(folder, config, proc)
    run.follow()
    return run


def attach(run_id: str) -> DetachedRun:
    """The detached run ``run_id`` (see ``nblaunch.runs(all=True)``), its view
    redrawn in this cell with its history, following it until it ends."""
    for run in registry.runs():
        if run.id == run_id and run.detached:
            run.follow()
            return run
    run = detached_run(str(run_id))
    if run is None:
        known = ", ".join(r.id for r in detached_runs()) or "none"
        raise LaunchError(f"no detached run {run_id!r} under {runs_root()} (detached runs: {known})")
    run.follow()
    registry.add_run(run)
    return run


def detached_run(run_id: str) -> Optional[DetachedRun]:
    """The detached run ``run_id`` read from its folder, or None if there is none."""
    if not RUN_ID.fullmatch(run_id) or run_id.strip(".") == "":
        raise ValueError(f"{run_id!r} is not a run id (e.g. 1207-142203-1-a3f9: see nblaunch.runs(all=True))")
    return _read(RunFolder(runs_root() / run_id))


def detached_runs() -> list:
    """Every detached run with a folder under :func:`runs_root`, oldest first."""
    root = runs_root()
    if not root.is_dir():
        return []
    found = [_read(RunFolder(d)) for d in sorted(root.iterdir()) if d.is_dir()]
    return [r for r in found if r is not None]


def _read(folder: RunFolder) -> Optional[DetachedRun]:
    if not folder.mine():  # what is unpickled from it must be this user's own
        return None
    asked = folder.asked()
    if asked is None:
        return None
    run = DetachedRun(folder, asked.config)
    run.started_at = asked.submitted or run.started_at
    run.refresh()
    return run


def _supervisor_running(folder: RunFolder) -> bool:
    ident = folder.identity()
    return ident is None or procid.same_process(ident)  # no id yet: being started


def _signal_supervisor(folder: RunFolder, sig: int) -> None:
    ident = folder.identity()
    if ident and procid.same_process(ident):
        try:
            os.kill(int(ident.split(":")[0]), sig)
        except ProcessLookupError:
            pass
