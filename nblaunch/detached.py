"""Detached runs: ``nblaunch.submit(..., detach=True)`` and ``nblaunch.attach(run_id)``.

A detached run is owned by a supervisor process (:mod:`nblaunch.supervisor`)
in a session of its own: restarting the kernel, its crash, or Jupyter
killing the kernel's process group leave it training. Its state is kept on
disk, in a run folder under :func:`runs_root`; any kernel of this machine
reads it: :func:`attach` redraws the run's view with its history (progress,
metric charts, the last lines the ranks printed) and follows it;
``nblaunch.runs(all=True)`` lists every detached run. The folder (the
ranks' logs with it) is kept until ``run.forget()``.

The kernel and the supervisor share nothing but that folder and one
signal: ``run.stop()`` sends SIGTERM to the supervisor, named by its
identity (pid and start time, :mod:`nblaunch.procid`: a pid reused by
another process is never signalled), and it stops the ranks as an
interrupt stops a launch.
"""
from __future__ import annotations

import collections
import contextvars
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

from . import procid
from .errors import LaunchError, WorkerError
from .postmortem import with_rank_frames
from .runs import Run, RunStopped, config_shows_widgets, kernel_runs, register
from .session import LaunchResults
from .supervisor import STOP_FILE, write_atomically
from .view import WidgetDisplay, make_display
from .wire.payload import CloudJob

__all__ = ["start_detached", "attach", "detached_runs", "runs_root", "FOLLOW_EVERY_S"]

FOLLOW_EVERY_S = 0.2
_LINE = re.compile(r"\[rank (\d+)\] (.*)", re.S)


def runs_root() -> Path:
    """``$NBLAUNCH_RUNS_DIR``, else ``$XDG_CACHE_HOME/nblaunch/runs`` (``~/.cache/nblaunch/runs``)."""
    explicit = os.environ.get("NBLAUNCH_RUNS_DIR")
    if explicit:
        return Path(explicit)
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "nblaunch" / "runs"


class DetachedRun(Run):
    """A run whose supervisor keeps it on disk; a :class:`~nblaunch.runs.Run`
    in every respect, read from its folder (``run_dir``)."""

    detached = True

    def __init__(self, run_id: str, config, run_dir: Path, proc: Optional[subprocess.Popen] = None):
        super().__init__(run_id, config)
        self.run_dir = run_dir
        self._proc = proc  # the supervisor, where this kernel started it (reaped here)
        self._lock = threading.Lock()
        self._state_key: tuple = ()
        self._snapshot: Optional[dict] = None

    # -- what is on disk -------------------------------------------------------------

    @property
    def status(self) -> str:
        self.refresh()
        return self._status

    def done(self) -> bool:
        self.refresh()
        return self._done.is_set()

    def exception(self, timeout: Optional[float] = None) -> Optional[BaseException]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.done():
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"run {self.id} is still {self._status} after {timeout:g} s")
            self._done.wait(FOLLOW_EVERY_S)
        return self._error

    def refresh(self, snapshot: Optional[dict] = None) -> Optional[dict]:
        """Read the run's folder: its outcome once it ended, else its state
        (returned). A supervisor gone without an outcome is a failure."""
        with self._lock:
            if self._done.is_set():
                return None
            if self._proc is not None:
                self._proc.poll()  # reaps it once it left
            outcome = _load(self.run_dir / "outcome.pkl")
            if outcome is not None:
                self._conclude(outcome)
                return None
            snapshot = snapshot or self._state()
            if snapshot is not None:
                self._status = "running" if snapshot["status"] == "running" else self._status
                self.log_dir = snapshot["state"].log_dir or self.log_dir
            if not _supervisor_running(self.run_dir) and _load(self.run_dir / "outcome.pkl") is None:
                if self._stop.is_set():  # stopped before it could say so (SIGTERM while it started)
                    self._conclude({"status": "stopped"})
                    return None
                log = self.run_dir / "supervisor.log"
                self._finish("failed", error=LaunchError(
                    f"the supervisor of run {self.id} ended without an outcome (killed?); its ranks ended "
                    f"with it. Its output: {log}; the ranks' output: {self.run_dir / 'logs'}"))
                return None
            return snapshot

    def _state(self) -> Optional[dict]:
        """state.pkl, read again only once rewritten (it holds every metric's history)."""
        try:
            st = (self.run_dir / "state.pkl").stat()
        except OSError:
            return None
        if (st.st_mtime_ns, st.st_size, st.st_ino) != self._state_key:
            self._state_key, self._snapshot = (st.st_mtime_ns, st.st_size, st.st_ino), _load(self.run_dir / "state.pkl")
        return self._snapshot

    def _conclude(self, outcome: dict) -> None:
        status = outcome["status"]
        self.log_dir = outcome.get("log_dir") or self.log_dir
        if status == "finished":
            self._finish(status, results=LaunchResults(outcome["results"], outcome["log_dir"], outcome["log_files"]))
        elif status == "stopped":
            self._finish(status, error=RunStopped(f"run {self.id} was stopped (run.stop()); every rank was "
                                                  f"stopped. Full output: {self.log_dir}"))
        else:
            error = outcome.get("error")
            if isinstance(error, WorkerError):  # its traceback did not travel: %debug opens the rank's frames
                error = with_rank_frames(error)
            self._finish(status, error=error or LaunchError(
                f"run {self.id} {status}: {outcome.get('error_text', '')}".strip()))

    # -- acting ------------------------------------------------------------------------

    def stop(self, timeout: Optional[float] = 30.0) -> None:
        if not self.done():
            self._stop.set()
            try:
                (Path(self.run_dir) / STOP_FILE).touch()  # this SIGTERM is a stop, not SLURM's notice
            except OSError:
                pass
            _signal_supervisor(self.run_dir, signal.SIGTERM)
        try:
            self.exception(timeout)
        except TimeoutError:
            pass

    def forget(self) -> None:
        """Stop the run if it still trains, then remove its folder (its state,
        results and the ranks' logs): nothing of it is left."""
        self.stop()
        ident = _identity(self.run_dir)
        deadline = time.monotonic() + 10
        while ident and procid.same_process(ident) and time.monotonic() < deadline:
            if self._proc is not None:
                self._proc.poll()
            time.sleep(0.02)  # the supervisor leaves right after writing its outcome
        if self._proc is not None:
            self._proc.wait(1)
        shutil.rmtree(self.run_dir, ignore_errors=True)
        super().forget()

    # -- the view -------------------------------------------------------------------------

    def follow(self) -> None:
        """Draw the run's view in the current cell (its history at once)
        and keep it moving, from a thread, until the run ends."""
        if self.config.display == "none":
            return
        handle = None
        if config_shows_widgets(self.config.display):
            from IPython.display import HTML, display

            handle = display(HTML(f"<i>nblaunch: run {self.id}</i>"), display_id=True)
        view = (WidgetDisplay(handle=handle, keep_widgets=True) if handle is not None
                else make_display(self.config.display))
        self._views.append(view)
        drawn = {"snapshot": None, "lines": 0, "generation": -1}  # what this view shows
        self._draw(view, self.refresh(), drawn)
        threading.Thread(target=contextvars.copy_context().run, args=(self._follow, view, drawn),
                         name=f"nblaunch-follow-{self.id}", daemon=True).start()

    def _follow(self, view, drawn: dict) -> None:
        while True:
            snapshot = self.refresh()
            if snapshot is None and self._done.is_set():
                break
            self._draw(view, snapshot, drawn)
            time.sleep(FOLLOW_EVERY_S)
        self._draw(view, self._state(), drawn)
        view.close(self._status)

    def _draw(self, view, snapshot: Optional[dict], drawn: dict) -> None:
        """The supervisor's model, and the lines printed since ``drawn`` (this view's last draw)."""
        if snapshot is None or snapshot is drawn["snapshot"]:
            if snapshot is not None:
                view.tick()  # the elapsed time moves on
            return
        drawn["snapshot"] = snapshot
        state = snapshot["state"]
        if len(self._views) > 1:  # each view its own model (a view marks what it drew in it)
            state = pickle.loads(pickle.dumps(state))
        if snapshot["generation"] != drawn["generation"]:  # a restart's new generation
            drawn["generation"], drawn["lines"] = snapshot["generation"], 0
            view.begin(state.world_size, state.method, state.backend, state.log_dir, state.call)
        tail = snapshot["tail"]
        new = min(snapshot["lines"] - drawn["lines"], len(tail))
        drawn["lines"] = snapshot["lines"]
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
    root = runs_root()
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    run_dir = root / run_id
    run_dir.mkdir(mode=0o700)  # its pickles are loaded by the supervisor and by kernels: this user's alone
    try:
        job = CloudJob(fn, tuple(args), kwargs).pack(sharing=False)  # by value: the supervisor is a new process
        write_atomically(run_dir / "run.pkl", pickle.dumps({"config": config, "submitted": time.time()}))
        write_atomically(run_dir / "job.pkl", pickle.dumps({"job": job, "path": sys.path, "cwd": os.getcwd()}))
        package_parent = str(Path(__file__).resolve().parent.parent)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [package_parent,
                                                                       os.environ.get("PYTHONPATH")])))
        with open(run_dir / "supervisor.log", "wb") as log:
            proc = subprocess.Popen([sys.executable, "-m", "nblaunch.supervisor", str(run_dir)],
                                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True, close_fds=True, env=env, cwd=os.getcwd())
        write_atomically(run_dir / "supervisor.id", procid.identity(proc.pid).encode())
    except BaseException:
        shutil.rmtree(run_dir, ignore_errors=True)
        raise
    run = DetachedRun(run_id, config, run_dir, proc)
    run.follow()
    return run


def attach(run_id: str) -> DetachedRun:
    """The detached run ``run_id`` (see ``nblaunch.runs(all=True)``), its view
    redrawn in this cell with its history, following it until it ends."""
    for run in kernel_runs():
        if run.id == run_id and run.detached:
            run.follow()
            return run
    run = _read(runs_root() / str(run_id))
    if run is None:
        known = ", ".join(r.id for r in detached_runs()) or "none"
        raise LaunchError(f"no detached run {run_id!r} under {runs_root()} (detached runs: {known})")
    run.follow()
    register(run)
    return run


def detached_runs() -> list:
    """Every detached run with a folder under :func:`runs_root`, oldest first."""
    root = runs_root()
    if not root.is_dir():
        return []
    found = [_read(d) for d in sorted(root.iterdir()) if d.is_dir()]
    return [r for r in found if r is not None]


def _read(run_dir: Path) -> Optional[DetachedRun]:
    if not _mine(run_dir):
        return None
    asked = _load(run_dir / "run.pkl")
    if asked is None:
        return None
    run = DetachedRun(run_dir.name, asked["config"], run_dir)
    run.started_at = asked.get("submitted", run.started_at)
    run.refresh()
    return run


def _load(path: Path) -> Optional[dict]:
    """A file written whole (``os.replace``), or None if not there (yet)."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    return pickle.loads(data)


def _mine(run_dir: Path) -> bool:
    """A run folder this user made and no one else may write to: what is
    unpickled from it is trusted as the user's own."""
    try:
        st = run_dir.stat()
    except OSError:
        return False
    return st.st_uid == os.getuid() and not st.st_mode & 0o022


def _identity(run_dir: Path) -> Optional[str]:
    try:
        return (run_dir / "supervisor.id").read_text()
    except OSError:
        return None


def _supervisor_running(run_dir: Path) -> bool:
    ident = _identity(run_dir)
    return ident is None or procid.same_process(ident)  # no id yet: being started


def _signal_supervisor(run_dir: Path, sig: int) -> None:
    ident = _identity(run_dir)
    if ident and procid.same_process(ident):
        try:
            os.kill(int(ident.split(":")[0]), sig)
        except ProcessLookupError:
            pass
