"""Replacement nodes for an allocation nblaunch asked for (``Slurm(nodes=N)``
with ``min_nodes``): when a node is lost, SLURM is asked for a one-node
allocation in its place (the same partition and options, the time the first
allocation has left, none of the nodes the run had), and the run grows into
it once it is granted and has answered for ``node_back_after``, as into a
node that came back. Inside the user's own allocation only its nodes are used:
no replacement is asked for there.

SLURM cannot add a node to a running job (job expansion is gone from recent
versions), so each replacement is a job of its own, with an ``srun`` step of
its own for its agent. A request still pending at the end is cancelled, and
every replacement is given back (``scancel``) when the launch or the live
ranks end, or as soon as the run is at ``max_nodes`` without it.
"""
from __future__ import annotations

import datetime
import os
import re
import signal
import subprocess
import threading
from typing import Callable, Optional

__all__ = ["Replacement", "Spares", "minutes_left"]


def minutes_left(fields: dict, now: Optional[datetime.datetime] = None) -> Optional[int]:
    """Whole minutes until the end of the job ``fields`` (``scontrol show job``)
    describe; None when it has no time limit (or SLURM does not say)."""
    if fields.get("TimeLimit", "UNLIMITED") in ("UNLIMITED", "Partition_Limit", "NONE"):
        return None
    try:
        end = datetime.datetime.fromisoformat(fields["EndTime"])
    except (KeyError, ValueError):
        return None
    seconds = (end - (now or datetime.datetime.now())).total_seconds()
    return max(1, int(seconds // 60))


class Replacement:
    """One ``salloc --no-shell --nodes=1`` in the background, in place of ``instead_of``.
    ``job`` is known from SLURM's first line (while it is still pending); ``host`` once granted."""

    def __init__(self, args: list[str], env: dict, instead_of: str, read_host: Callable[[str], tuple]):
        self.instead_of = instead_of
        self.job: Optional[str] = None
        self.host: Optional[str] = None
        self.cpus = 1
        self.failed = ""  # what SLURM said when it refused
        self._read_host = read_host
        self._output = bytearray()
        self._proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, env=env, start_new_session=True)
        os.set_blocking(self._proc.stdout.fileno(), False)

    @property
    def pending(self) -> bool:
        return self.host is None and not self.failed

    def poll(self) -> None:
        """Read what salloc said; once it has ended, the node granted (or why not)."""
        if not self.pending:
            return
        self._read()
        found = re.search(rb"job allocation (\d+)", self._output)
        if found and self.job is None:
            self.job = found.group(1).decode()
        code = self._proc.poll()
        if code is None:
            return
        self._read()
        self._proc.stdout.close()
        if code != 0 or self.job is None:
            self.failed = self._output.decode(errors="replace").strip() or f"salloc ended with code {code}"
            return
        try:
            self.host, self.cpus = self._read_host(self.job)
        except Exception as exc:  # noqa: BLE001 - the grant is unusable: said, and given back
            self.failed = str(exc)

    def cancel(self) -> None:
        """The request withdrawn, or the node given back."""
        if self._proc.poll() is None:
            try:  # salloc withdraws a pending request itself on SIGINT
                os.killpg(self._proc.pid, signal.SIGINT)
                self._proc.wait(5)
            except (OSError, subprocess.TimeoutExpired):
                self._proc.kill()
                self._proc.wait()
        if not self._proc.stdout.closed:
            self._read()
            self._proc.stdout.close()
        found = re.search(rb"job allocation (\d+)", self._output)
        job = self.job or (found.group(1).decode() if found else None)
        if job is not None:
            try:
                subprocess.run(["scancel", job], capture_output=True, timeout=30)
            except (subprocess.TimeoutExpired, OSError):
                pass

    def _read(self) -> None:
        try:
            while chunk := os.read(self._proc.stdout.fileno(), 1 << 16):
                self._output += chunk
        except (BlockingIOError, OSError, ValueError):
            pass


class Spares:
    """The replacements of one run: asked for (:meth:`ask`), granted
    (:meth:`granted`), given back (:meth:`give_back`, :meth:`close`), and what
    became of each, for the view (:meth:`said`); used from the kernel's
    thread and the probes' thread alike."""

    def __init__(self, make: Callable[[str, list], Replacement]):
        self._make = make  # (instead_of, exclude) -> a Replacement started
        self._all: list[Replacement] = []
        self._lock = threading.Lock()
        self._said: list[str] = []
        self._granted_said: set = set()

    def ask(self, lost: list[str], room: int, exclude: list[str]) -> list[Replacement]:
        """One request per lost node, as long as those pending or granted and
        unused (``exclude`` names every node in use) stay within ``room``."""
        with self._lock:
            self._poll()
            waiting = [r for r in self._all if r.pending or (r.host and r.host not in exclude)]
            made = []
            for name in lost[:max(0, room - len(waiting))]:
                try:
                    made.append(self._make(name, exclude + [r.host for r in self._all if r.host]))
                except Exception as exc:  # noqa: BLE001 - no request: said, and the run goes on on fewer nodes
                    self._said.append(f"could not ask SLURM for a node in place of {name}: {exc}")
                    continue
                self._said.append(f"asked SLURM for a node in place of {name}" + (
                    f" (job {made[-1].job})" if made[-1].job else "") + ": the run grows into it once granted")
            self._all += made
            return made

    def granted(self) -> list[Replacement]:
        """Every replacement granted and not given back, in the order asked for."""
        with self._lock:
            self._poll()
            return [r for r in self._all if r.host]

    def said(self) -> list[str]:
        """What became of the requests since last asked: asked for, granted, refused, given back."""
        with self._lock:
            self._poll()
            for r in self._all:
                if r.host and id(r) not in self._granted_said:
                    self._granted_said.add(id(r))
                    self._said.append(f"SLURM granted {r.host} (job {r.job}) in place of {r.instead_of}")
                elif r.failed:
                    self._said.append(f"SLURM refused a node in place of {r.instead_of}: {r.failed.splitlines()[-1]}")
            self._all = [r for r in self._all if not r.failed]
            out, self._said = self._said, []
            return out

    def label(self, host: str) -> str:
        """``host`` as notices name it: a replacement says whose place it takes."""
        with self._lock:
            instead = next((r.instead_of for r in self._all if r.host == host), None)
        return f"{host} (in place of {instead})" if instead else host

    def job_of(self, host: str) -> Optional[str]:
        with self._lock:
            return next((r.job for r in self._all if r.host == host), None)

    def give_back(self, keep: list[str], why: str = "") -> list[Replacement]:
        """Every request and replacement but those on ``keep`` (the nodes in use)
        withdrawn; ``why`` given: said (the end of the run says nothing)."""
        with self._lock:
            out = [r for r in self._all if r.host not in keep]
            self._all = [r for r in self._all if r.host in keep]
        for r in out:
            r.cancel()
            if why:
                what = f"{r.host} (job {r.job})" if r.host else f"the request (job {r.job})"
                with self._lock:
                    self._said.append(f"gave back {what}, asked for in place of {r.instead_of}: {why}")
        return out

    def lost(self, hosts: list[str]) -> None:
        """Replacements on ``hosts`` lost: given back (a one-node job ends with its node)."""
        with self._lock:
            gone = [r for r in self._all if r.host in hosts]
            self._all = [r for r in self._all if r.host not in hosts]
        for r in gone:
            r.cancel()

    def close(self) -> None:
        self.give_back([])

    def _poll(self) -> None:
        for r in self._all:
            r.poll()
