"""The supervisor of a detached run: ``python -m nblaunch.supervisor RUN_DIR``.

A small process in a session of its own (started with ``setsid`` by
:func:`nblaunch.detached.start_detached`), so that what ends a kernel (Jupyter
kills the kernel's whole process group; a crash) does not reach it. It runs
the launch the kernel asked for (a :class:`~nblaunch.session.Session`, the
same call watch, its ranks forked from its own single thread) and keeps
the run's state on disk in ``RUN_DIR`` (the user's alone, mode 0700), for
any kernel of that user to read; it was given ``run.pkl`` (the config) and
``job.pkl`` (the call, removed once read), and writes:

- ``state.pkl``: the status, the view's model (progress, metric history,
  each rank's state, notices), the ranks' last ``ATTACH_LINES`` lines and
  how many they wrote, rewritten (atomically) when it changed, at most
  every ``WRITE_EVERY_S``;
- ``outcome.pkl``: once the run ends, its status and the results (with the
  log files) or the error;
- ``logs/``: each rank's full output (``NBLAUNCH_LOG_DIR``);
- ``supervisor.log``: the supervisor's own output.

SIGTERM from ``run.stop()`` (which writes ``stop`` in the folder first; any
other SIGTERM is SLURM's notice to the ranks) stops the run as an interrupt
stops a launch. The supervisor leaves once the outcome is written; the files
stay until ``run.forget()``.
"""
from __future__ import annotations

import collections
import dataclasses
import os
import pickle
import signal
import sys
import time
from pathlib import Path

__all__ = ["main", "write_atomically", "WRITE_EVERY_S", "ATTACH_LINES"]

WRITE_EVERY_S = 0.25
ATTACH_LINES = 2000  # the ranks' last lines kept for a kernel that attaches (every line is in logs/)


def write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


class _Stop(KeyboardInterrupt):
    """``run.stop()`` reached the supervisor: the watch stops the ranks as on an interrupt."""


def _recorder_class():
    from .view import View, clip
    from .view.ansi import strip

    class Recorder(View):
        """A view that keeps the run's state on disk instead of drawing it.
        Its ``tick`` raises ``_Stop`` once ``stopping()`` says so."""

        def __init__(self, run_dir: Path, stopping, generation: int):
            super().__init__()
            self._path = run_dir / "state.pkl"
            self._stopping = stopping
            self.generation = generation
            self.lines = 0  # lines the ranks wrote, all told (the tail keeps the last ones)
            self.status = "starting"
            self._written = 0.0
            self.tail: collections.deque = collections.deque(maxlen=ATTACH_LINES)

        def show(self) -> None:
            self.status = "running"
            self.write()

        def rank_lines(self, rank: int, lines: list) -> None:
            label = self.state.label(rank)
            tagged = [f"[rank {label}] {strip(clip(line))}" for line in lines]
            self.state.tail.extend(tagged[-self.state.tail.maxlen:])
            self.tail.extend(tagged[-ATTACH_LINES:])
            self.lines += len(lines)
            self.state.changed = True

        def notice(self, text: str) -> None:
            self.state.notices.append(text)
            self.state.changed = True

        def tick(self, force: bool = False) -> None:
            if self._stopping():
                raise _Stop()
            # Only what changed: the model holds every metric's history (up to
            # view.state.MAX_POINTS a rank), not to be rewritten for nothing all night.
            if force or (self.state.changed and time.monotonic() - self._written >= WRITE_EVERY_S):
                self.write()

        def close(self, outcome: str) -> None:
            self.state.end(outcome)
            self.status = outcome
            self.write()

        def write(self) -> None:
            self._written = time.monotonic()
            self.state.changed = False
            snapshot = {"status": self.status, "state": self.state, "lines": self.lines, "tail": list(self.tail),
                        "generation": self.generation, "written": time.time()}
            write_atomically(self._path, pickle.dumps(snapshot))

    return Recorder


STOP_FILE = "stop"  # in the run folder: written by run.stop() before its SIGTERM


def main(run_dir: str) -> int:
    here = Path(run_dir)
    os.environ["NBLAUNCH_LOG_DIR"] = str(here / "logs")
    stop = []
    # run.stop() says so in the folder first: a SIGTERM from anyone else is
    # SLURM's to every process of a job (the ranks take it as a preemption
    # notice, nblaunch.rank.term), not a stop.
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True) if (here / STOP_FILE).exists() else None)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # not its own: only run.stop() (SIGTERM) ends a run
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    from .errors import LaunchTimeout
    from .session import Session

    asked = pickle.loads((here / "job.pkl").read_bytes())
    (here / "job.pkl").unlink()  # it may be large (arguments by value), and is needed only now
    # Where the kernel found its modules: the job names its functions' modules (by reference).
    sys.path[:0] = [p for p in asked["path"] if p not in sys.path]
    os.chdir(asked["cwd"])
    config = dataclasses.replace(pickle.loads((here / "run.pkl").read_bytes())["config"], background=False,
                                 display="none")
    Recorder = _recorder_class()
    views: list = []

    def make_view(kind: str, show_after: float = 0.0):
        views.append(Recorder(here, lambda: bool(stop), len(views)))
        return views[-1]

    outcome: dict = {"status": "failed"}
    try:
        if stop:
            raise _Stop()
        fn, args, kwargs = pickle.loads(asked["job"])
        session = Session(config, live=False)
        session.make_view = make_view
        results = session.launch(fn, args, kwargs)
        outcome = {"status": "finished", "results": list(results), "log_dir": results.log_dir,
                   "log_files": results.log_files}
    except _Stop:
        outcome = {"status": "stopped", "error_text": "run.stop() stopped every rank"}
    except LaunchTimeout as exc:
        outcome = _failure("timed out", exc)
    except BaseException as exc:  # noqa: BLE001 - the run's verdict, for whichever kernel collects it
        outcome = _failure("failed", exc)
    outcome["log_dir"] = outcome.get("log_dir") or (views[-1].state.log_dir if views else "")
    outcome["ended"] = time.time()
    write_atomically(here / "outcome.pkl", _dumps(outcome))
    return 0


def _failure(status: str, exc: BaseException) -> dict:
    import traceback

    return {"status": status, "error": exc, "error_text": "".join(traceback.format_exception_only(type(exc), exc))}


def _dumps(outcome: dict) -> bytes:
    """The outcome pickled; an error or results that cannot be (an exception
    class of the notebook's) are kept as text."""
    import cloudpickle

    try:
        return cloudpickle.dumps(outcome)
    except Exception as exc:  # noqa: BLE001 - the text survives any pickling problem
        kept = {k: v for k, v in outcome.items() if k not in ("error", "results")}
        if "results" in outcome:
            kept.update(status="failed", error_text=f"the results could not be kept: {exc!r}")
        return cloudpickle.dumps(kept)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
