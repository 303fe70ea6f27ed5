"""The supervisor of a detached run: ``python -m nblaunch.background.supervisor RUN_DIR``.

A small process in a session of its own (started with ``setsid`` by
:func:`nblaunch.background.detached.start_detached`), so that what ends a kernel (Jupyter
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

from ..outcome import Outcome
from .folder import Ended, RunFolder, Snapshot

__all__ = ["main", "WRITE_EVERY_S", "ATTACH_LINES"]

WRITE_EVERY_S = 0.25
ATTACH_LINES = 2000  # the ranks' last lines kept for a kernel that attaches (every line is in logs/)


def _recorder_class():
    from ..view import View, clip
    from ..view.ansi import strip

    class Recorder(View):
        """A view that keeps the run's state in its folder instead of drawing it."""

        def __init__(self, folder: RunFolder, generation: int):
            super().__init__()
            self._folder = folder
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
            self._folder.write_state(Snapshot(self.status, self.state, self.lines, list(self.tail),
                                              self.generation, time.time()))

    return Recorder


def main(run_dir: str) -> int:
    folder = RunFolder(run_dir)
    os.environ["NBLAUNCH_LOG_DIR"] = str(folder.logs)
    stop = []
    # run.stop() says so in the folder first: a SIGTERM from anyone else is
    # SLURM's to every process of a job (the ranks take it as a preemption
    # notice, nblaunch.rank.term), not a stop.
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True) if folder.stop_asked() else None)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # not its own: only run.stop() (SIGTERM) ends a run
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    from ..errors import RunStopped
    from ..session import Session

    asked = folder.take_job()
    # Where the kernel found its modules: the job names its functions' modules (by reference).
    sys.path[:0] = [p for p in asked["path"] if p not in sys.path]
    os.chdir(asked["cwd"])
    config = dataclasses.replace(folder.asked().config, background=False, display="none")
    Recorder = _recorder_class()
    views: list = []

    def make_view(kind: str, show_after: float = 0.0):
        views.append(Recorder(folder, len(views)))
        return views[-1]

    try:
        if stop:
            raise RunStopped(folder.run_id, log_dir=str(folder.logs))
        fn, args, kwargs = pickle.loads(asked["job"])
        session = Session(config, live=False)
        session.make_view = make_view
        session.stop_requested = lambda: bool(stop)
        outcome = Outcome.finished(session.launch(fn, args, kwargs))
    except BaseException as exc:  # noqa: BLE001 - the run's verdict, for whichever kernel collects it
        outcome = Outcome.of(exc)
    folder.write_outcome(Ended.of(outcome, views[-1].state.log_dir if views else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
