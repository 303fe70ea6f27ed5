"""The agents' ``srun`` steps, as the rank pool sees them (:class:`Steps`):
one per job, the allocation's and each replacement's (:mod:`.slurm_spares`),
their output in one log."""
from __future__ import annotations

import os
import signal
import subprocess
import time
from typing import Optional

from .agent_engine import AgentStep

__all__ = ["Steps"]


class Steps(AgentStep):
    """The agents' ``srun`` steps (one per job: the allocation's, and each
    replacement's), as the rank pool sees them."""

    what = "srun step"

    def __init__(self, procs: list, log_path: str):
        self._procs, self._log = procs, log_path

    def poll(self) -> Optional[int]:
        """The first exit code of a step that ended (None while every one runs)."""
        return next((code for code in (p.poll() for p in self._procs) if code is not None), None)

    def output(self) -> str:
        try:
            with open(self._log, errors="replace") as f:
                return f.read()[-20000:]
        except OSError:
            return ""

    def news(self) -> str:
        """Why an agent vanished without a word: a cancelled step's agents
        get SIGKILL, and srun then says so."""
        deadline = time.monotonic() + 1.0
        for proc in self._procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        said = [line.strip() for line in self.output().splitlines()
                if "CANCELLED" in line or "error:" in line or "DUE TO" in line]
        return f"was ended by SLURM ({said[0]})" if said else ""

    def end(self, timeout: float) -> None:
        """The step ends when its agents do; one that does not is cancelled
        as srun is told to (SIGINT twice within a second: srun's own rule)."""
        deadline = time.monotonic() + timeout
        for proc in self._procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _cancel(proc)


def _cancel(proc: subprocess.Popen) -> None:
    """An ``srun`` step cancelled: SIGINT twice within a second (srun's own rule), then SIGKILL."""
    for sig in (signal.SIGINT, signal.SIGINT, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except OSError:
            break
        try:
            proc.wait(0.5)
            return
        except subprocess.TimeoutExpired:
            continue
    proc.wait()
