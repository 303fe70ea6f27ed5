"""A detached run's folder: the one place its files are named, read and written.

``RUN_DIR`` (``$NBLAUNCH_RUNS_DIR/<id>``, the user's alone, mode 0700):

- ``run.pkl``: what was asked (:class:`Asked`), written by the kernel;
- ``job.pkl``: the call and where the kernel found its modules, read once
  by the supervisor and removed (it may be large);
- ``supervisor.id``: the supervisor's identity (pid and start time);
- ``supervisor.log``: its own output; ``logs/``: each rank's;
- ``state.pkl``: the run as it goes (:class:`Snapshot`), rewritten whole;
- ``outcome.pkl``: how it ended (:class:`Ended`), written once;
- ``stop``: ``run.stop()`` was asked (its SIGTERM is then a stop, not SLURM's notice).

Each file is written whole (:func:`~nblaunch.system.files.write_atomically`)
and pickles a plain dict, the same keys since detached runs began (one
added: ``outcome.pkl``'s results pickled apart, ``results_pickled``): a folder
written by an earlier nblaunch is still listed, attached and forgotten (a
class it names from a module that moved since is found where it is now).
"""
from __future__ import annotations

import dataclasses
import io
import os
import pickle
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from ..outcome import Outcome
from ..system.files import write_atomically

__all__ = ["RunFolder", "Asked", "Snapshot", "Ended"]

# Modules that moved since a run folder could have been written: an old
# pickle's class is found where it lives now.
_MOVED = {"nblaunch.runs": "nblaunch.background.in_kernel", "nblaunch.detached": "nblaunch.background.detached",
          "nblaunch.supervisor": "nblaunch.background.supervisor", "nblaunch.progress": "nblaunch.rank.progress",
          "nblaunch.preempt": "nblaunch.watch.preempt", "nblaunch.postmortem": "nblaunch.watch.postmortem"}


@dataclass
class Asked:
    """``run.pkl``: the launch's config and when it was submitted."""

    config: Any
    submitted: float = field(default_factory=time.time)


@dataclass
class Snapshot:
    """``state.pkl``: the run's status, its view's model (``LaunchState``),
    how many lines the ranks wrote and the last of them, which generation
    of ranks (restarts) and when it was written."""

    status: str
    state: Any
    lines: int = 0
    tail: list = field(default_factory=list)
    generation: int = 0
    written: float = 0.0


@dataclass
class Ended:
    """``outcome.pkl``: the run's status, and its results (with where the
    logs are) or its error (with its text, kept where the error itself could
    not be pickled). On disk the results are pickled apart
    (``results_pickled``) and read by :meth:`loaded_results` only: listing
    runs never unpickles a tensor (and so never imports torch)."""

    status: str
    results: Optional[list] = None
    log_dir: str = ""
    log_files: Optional[list] = None
    error: Optional[BaseException] = None
    error_text: str = ""
    ended: float = 0.0
    results_pickled: Optional[bytes] = None

    def loaded_results(self) -> Optional[list]:
        """The results (unpickled now, once, where they were kept apart)."""
        if self.results is None and self.results_pickled is not None:
            self.results, self.results_pickled = _loads(self.results_pickled), None
        return self.results

    @classmethod
    def of(cls, outcome: Outcome, log_dir: str) -> "Ended":
        import traceback

        results, error = outcome.results, outcome.error
        return cls(outcome.status, results=None if results is None else list(results),
                   log_dir=getattr(results, "log_dir", None) or log_dir,
                   log_files=getattr(results, "log_files", None), error=error, ended=time.time(),
                   error_text="" if error is None else "".join(traceback.format_exception_only(type(error), error)))


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        return super().find_class(_MOVED.get(module, module), name)


class RunFolder:
    """The files of the run in ``path`` (see the module doc)."""

    ASKED, JOB, IDENTITY, STATE, OUTCOME, STOP = ("run.pkl", "job.pkl", "supervisor.id", "state.pkl",
                                                 "outcome.pkl", "stop")

    def __init__(self, path):
        self.path = Path(path)
        self.logs = self.path / "logs"
        self.supervisor_log = self.path / "supervisor.log"
        self._state_key: tuple = ()
        self._snapshot: Optional[Snapshot] = None

    @property
    def run_id(self) -> str:
        return self.path.name

    @classmethod
    def make(cls, root: Path, run_id: str) -> "RunFolder":
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        (root / run_id).mkdir(mode=0o700)  # its pickles are loaded by the supervisor and by kernels
        return cls(root / run_id)

    def mine(self) -> bool:
        """This user made it and no one else may write to it: what is
        unpickled from it is trusted as the user's own."""
        try:
            st = self.path.stat()
        except OSError:
            return False
        return st.st_uid == os.getuid() and not st.st_mode & 0o022

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)

    # -- what was asked ------------------------------------------------------------

    def write_asked(self, asked: Asked) -> None:
        self._write(self.ASKED, pickle.dumps(_record(asked)))

    def asked(self) -> Optional[Asked]:
        found = self._load(self.ASKED)
        return None if found is None else Asked(found["config"], found.get("submitted", 0.0))

    def write_job(self, job: bytes, path: list, cwd: str) -> None:
        self._write(self.JOB, pickle.dumps({"job": job, "path": path, "cwd": cwd}))

    def take_job(self) -> dict:
        """The call (``job``, ``path``, ``cwd``), removed once read: only the supervisor needs it, once."""
        found = _loads((self.path / self.JOB).read_bytes())
        (self.path / self.JOB).unlink()
        return found

    # -- the supervisor ------------------------------------------------------------

    def write_identity(self, identity: str) -> None:
        self._write(self.IDENTITY, identity.encode())

    def identity(self) -> Optional[str]:
        try:
            return (self.path / self.IDENTITY).read_text()
        except OSError:
            return None

    def ask_stop(self) -> None:
        try:
            (self.path / self.STOP).touch()
        except OSError:
            pass

    def stop_asked(self) -> bool:
        return (self.path / self.STOP).exists()

    # -- the run as it goes, and its end ---------------------------------------------

    def write_state(self, snapshot: Snapshot) -> None:
        self._write(self.STATE, pickle.dumps(_record(snapshot)))

    def state(self) -> Optional[Snapshot]:
        """``state.pkl``, read again only once rewritten (it holds every metric's history)."""
        try:
            st = (self.path / self.STATE).stat()
        except OSError:
            return None
        key = (st.st_mtime_ns, st.st_size, st.st_ino)
        if key != self._state_key:
            found = self._load(self.STATE)
            self._state_key, self._snapshot = key, None if found is None else _typed(Snapshot, found)
        return self._snapshot

    def write_outcome(self, ended: Ended) -> None:
        """The outcome pickled; an error or results that cannot be (an
        exception class of the notebook's) are kept as text."""
        import cloudpickle

        record = _record(ended)
        try:
            if record["results"] is not None:
                record["results_pickled"], record["results"] = cloudpickle.dumps(record["results"]), None
            data = cloudpickle.dumps(record)
        except Exception as exc:  # noqa: BLE001 - the text survives any pickling problem
            kept = {k: v for k, v in record.items() if k not in ("error", "results", "results_pickled")}
            if ended.results is not None:
                kept.update(status="failed", error_text=f"the results could not be kept: {exc!r}")
            data = cloudpickle.dumps(kept)
        self._write(self.OUTCOME, data)

    def outcome(self) -> Optional[Ended]:
        found = self._load(self.OUTCOME)
        if found is None:
            return None
        return _typed(Ended, found)

    # -- inside ----------------------------------------------------------------------

    def _write(self, name: str, data: bytes) -> None:
        write_atomically(self.path / name, data)

    def _load(self, name: str) -> Optional[dict]:
        """A file written whole, or None if not there (yet)."""
        try:
            data = (self.path / name).read_bytes()
        except OSError:
            return None
        return _loads(data)


def _record(item) -> dict:
    """The dict on disk (shallow: the view's model is pickled as it is)."""
    return {f.name: getattr(item, f.name) for f in dataclasses.fields(item)}


def _typed(kind, record: dict):
    return kind(**{f.name: record[f.name] for f in dataclasses.fields(kind) if f.name in record})


def _loads(data: bytes):
    return _Unpickler(io.BytesIO(data)).load()
