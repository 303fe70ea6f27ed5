"""What every view does with the call watch's reports: keep the model
(:class:`~nblaunch.view.state.LaunchState`) and admit rank output within the
rate that Jupyter's IOPub channel allows. Renderers (:mod:`.text`,
:mod:`.widget`) subclass :class:`View` and draw."""
from __future__ import annotations

import collections
import sys
import time
from typing import Optional

from . import ansi
from .state import LOG_TAIL, MAX_BYTES_PER_S, MAX_LINE_CHARS, MAX_LINES_PER_S, LaunchState, clip

__all__ = ["View", "in_kernel"]

# Of a rank's lines the rate left out, its last ones are shown as its call
# ends (what it printed last is what tells what went wrong): this many per
# rank, and this many in all.
LAST_UNSHOWN = 5
LAST_UNSHOWN_ALL = 100


class _Budget:
    """A token bucket: ``rate`` a second, at most ``burst`` saved up."""

    def __init__(self, rate: float, burst: float):
        self.rate, self.burst, self.tokens = rate, burst, burst
        self._t = time.monotonic()

    def refill(self) -> None:
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self._t) * self.rate)
        self._t = now


class View:
    """The calls a view gets, in the cell's thread: ``begin``, ``place``,
    ``show``, ``rank_status``/``progress``/``metrics``/``resources``,
    ``rank_lines``/``rank_live``, ``notice``, ``tick`` (about ten times a
    second), ``close(outcome)``. ``BURST_LINES``: output lines shown at once
    before the sustained rate applies."""

    BURST_LINES = MAX_LINES_PER_S

    def __init__(self):
        self.state = LaunchState()
        self._hidden: collections.Counter = collections.Counter()
        self._unshown: dict = {}  # rank -> its last lines left out, since its last line shown
        self._lines = _Budget(MAX_LINES_PER_S, burst=self.BURST_LINES)
        self._bytes = _Budget(MAX_BYTES_PER_S, burst=4 * MAX_BYTES_PER_S)

    def begin(self, world_size: int, method: str, backend: str, log_dir: str, call: int = 0) -> None:
        self.state.begin(world_size, method, backend, log_dir, call)

    def show(self) -> None:
        """Once the ranks are started: build what is to be built."""

    def place(self, first_rank: int, world_size: int, node: Optional[int], num_nodes: int,
              hosts: Optional[list] = None, backend: Optional[str] = None) -> None:
        """Where the ranks sit; a cluster launch gives each row's machine
        (``hosts``) and the backend its nodes chose."""
        self.state.place(first_rank, world_size, node, num_nodes, hosts)
        if backend is not None:
            self.state.backend = backend

    def rank_phase(self, rank: int, phase: str) -> None:
        self.state.set_phase(rank, phase)

    def rank_status(self, rank: int, status: str) -> None:
        self.state.set_rank(rank, status)

    def progress(self, event) -> None:
        self.state.progress(event)

    def metrics(self, event) -> None:
        self.state.metrics(event)

    def resources(self, usage: dict) -> None:
        self.state.resources(usage)

    def rank_live(self, rank: int, text: Optional[str]) -> None:
        """The line a rank is rewriting with carriage returns (or has not
        ended yet); None once it ended."""

    def _admit(self, rank: int, lines: list[str]) -> list[str]:
        """The lines to show of those a rank wrote: ``MAX_LINES_PER_S`` and
        ``MAX_BYTES_PER_S`` sustained over all ranks, with a burst allowance;
        the rest are counted and named in a notice (the log files keep them)."""
        self.state.tail.extend(f"[rank {rank}] {ansi.strip(clip(line))}" for line in lines[-LOG_TAIL:])
        self.state.rank_output(rank, lines)
        self._lines.refill()
        self._bytes.refill()
        shown = []
        for line in lines:
            cost = min(len(line), MAX_LINE_CHARS) + 40  # the tag and markup around it
            if self._lines.tokens < 1 or self._bytes.tokens < cost:
                break
            self._lines.tokens -= 1
            self._bytes.tokens -= cost
            shown.append(line)
        self._hidden[rank] += len(lines) - len(shown)
        if len(shown) < len(lines):
            self._unshown.setdefault(rank, collections.deque(maxlen=LAST_UNSHOWN)).extend(
                lines[len(shown):][-LAST_UNSHOWN:])
        elif shown:
            self._unshown.pop(rank, None)
        return shown

    def _last_unshown(self) -> list[tuple[int, str]]:
        """``(rank, line)``: each rank's last lines the rate left out, for the
        view's end (no longer counted as not shown)."""
        out: list = []
        for rank in sorted(self._unshown):
            room = LAST_UNSHOWN_ALL - len(out)
            lines = list(self._unshown[rank])[-room:] if room > 0 else []
            self._hidden[rank] = max(0, self._hidden[rank] - len(lines))
            out += [(rank, line) for line in lines]
        self._unshown.clear()
        return out

    def _hidden_notices(self) -> list[str]:
        notices = [f"[nblaunch] rank {rank}: {count} more lines not shown here; "
                   f"all are in {self.state.log_dir}/rank{rank}.log"
                   for rank, count in sorted(self._hidden.items()) if count]
        self._hidden.clear()
        return notices


def in_kernel() -> bool:
    ip = sys.modules.get("IPython")
    shell = ip.get_ipython() if ip is not None else None
    return shell is not None and getattr(shell, "kernel", None) is not None
