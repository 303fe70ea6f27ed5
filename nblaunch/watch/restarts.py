"""A launch's restarts (``max_restarts``) and resizes (nodes back, with
``min_nodes``): what ended each generation, said in the next one's view
("restart 1 of 2: rank 1 on n2 killed by SIGKILL at step 412; 2 nodes, 4
ranks", "restart 2 of 3: n3 back; 3 nodes, 6 ranks"), in the final summary,
and in the last attempt's ``WorkerError``, which lists every attempt's cause.

"restart k of m": k counts every restart so far, m the restarts this launch
may take by now (``max_restarts``, plus one for each resize: never counted)."""
from __future__ import annotations

import time
from typing import Optional

from ..errors import WorkerError

__all__ = ["History", "may_restart", "size_strip"]


class History:
    """The restarts of one launch, as lines."""

    def __init__(self, max_restarts: int):
        self.max_restarts = max_restarts
        self.causes: list[str] = []  # what ended each earlier attempt: "rank 1 killed by SIGKILL at step 412"
        self.lines: list[str] = []  # the view's: "restart 1 of 2: ...; 4 ranks"
        self.resizes = 0
        self._t0 = time.monotonic()
        self.sizes: list[tuple[float, int]] = []  # (seconds since the launch began, its nodes from then on)

    def begin(self, nodes: int) -> None:
        """The launch begins on ``nodes`` nodes."""
        self._t0, self.sizes = time.monotonic(), [(0.0, nodes)]

    def record(self, exc: WorkerError, steps: dict, nodes: int, world_size: int) -> None:
        """Generation ``len(causes)`` failed with ``exc`` (``steps``: global
        rank -> its bar's last step); the next has ``nodes`` and ``world_size``."""
        self._add(exc.root.brief() + at_step(steps, exc.root.rank), nodes, world_size)

    def resized(self, back: list, nodes: int, world_size: int, taken: bool = True) -> None:
        """Generation ``len(causes)`` ended because the nodes ``back`` came back; the next is
        larger (``taken``), or not, if they were gone again when it was made."""
        self.resizes += 1
        self._add(f"{', '.join(back)} back" + ("" if taken else ", gone again before it could be used"), nodes,
                  world_size)

    def _add(self, cause: str, nodes: int, world_size: int) -> None:
        self.sizes.append((time.monotonic() - self._t0, nodes))
        self.causes.append(cause)
        size = (f"{nodes} nodes, " if nodes > 1 else "") + f"{world_size} ranks"
        self.lines.append(f"restart {len(self.causes)} of {self.max_restarts + self.resizes}: {cause}; {size}")

    def final(self, exc: WorkerError) -> WorkerError:
        """The last attempt's error, listing every earlier attempt's cause."""
        if not self.causes:
            return exc
        return WorkerError(exc.failures, exc.log_dir, exc.note, attempts=tuple(self.causes))

    def summary(self) -> Optional[str]:
        """The final summary's line (None: no restart)."""
        if not self.lines:
            return None
        strip = ""
        if len({n for _, n in self.sizes}) > 1:  # the nodes against time: "3 from 0:00, 2 from 0:12, 3 from 0:41"
            strip = (f"; nodes over time: {size_strip(self.sizes, time.monotonic() - self._t0)} ("
                     + ", ".join(f"{n} from {_clock(t)}" for t, n in self.sizes) + ")")
        return f"finished after {len(self.lines)} restart(s): " + "; ".join(self.lines) + strip


_BARS = "▁▂▃▄▅▆▇█"


def _clock(seconds: float) -> str:
    """``12:04``; past an hour ``26:12:04`` (a week-long run's hours are counted on, not days)."""
    t = int(seconds)
    return f"{t // 3600}:{t % 3600 // 60:02d}:{t % 60:02d}" if t >= 3600 else f"{t // 60}:{t % 60:02d}"


def size_strip(sizes: list, total: float, cells: int = 24) -> str:
    """The nodes against time as one line of bars, ``cells`` wide, each the size at its
    middle (``sizes``: (seconds from the start, nodes from then on), in order)."""
    most = max(n for _, n in sizes)
    out = []
    for i in range(cells):
        t = (i + 0.5) * total / cells
        n = [n for start, n in sizes if start <= t][-1] if total > 0 else sizes[-1][1]
        out.append(_BARS[max(0, round(n / most * (len(_BARS) - 1)))])
    return "".join(out)


def at_step(steps: dict, rank: int) -> str:
    """`` at step 412``: where the rank's progress bar was (the furthest of any rank's, if it had none)."""
    step = steps.get(rank, max(steps.values()) if steps else None)
    return f" at step {step}" if step is not None else ""


def may_restart(engine, exc: WorkerError) -> bool:
    """Whether a failed generation is replaced: yes, except where a node's
    launcher was stopped or a node was lost (kind ``node``), unless the
    engine can go on without the lost nodes (``engine.shrink``: a cluster,
    or nodes joined by the c10d rendezvous, with ``min_nodes``), which it then does."""
    if exc.root.kind != "node":
        return True
    return engine.shrink(exc.failures)
