"""Many ranks at a glance: the rules of the view above ``MANY_ABOVE`` ranks.

A row per rank stops being readable past a dozen, and drawing one costs the
kernel in proportion to the world on every redraw. Above ``MANY_ABOVE`` the
view shows what a person watching 512 ranks asks for, in a size bounded by
the screen:

- the spread of the ranks' progress and rate (min / median / max);
- the stragglers: the ranks furthest behind the median, by name (rank,
  host), how far behind (steps, and seconds at the median's rate) and
  since when; the worst each rank ever was is kept for the final view;
- per node, on a cluster: its ranks' median progress and its slowest rank;
- per metric, the median over the ranks at each step and the band from
  the lowest to the highest (:class:`StepBands`), instead of a line per rank.

Pure: no drawing (``many_html``), no processes; fed by ``LaunchState``.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Optional

__all__ = ["MANY_ABOVE", "BEHIND_S", "Spread", "Straggler", "NodeSummary", "Overview", "StragglerWatch",
           "StepBands", "spread", "overview"]

MANY_ABOVE = 16  # ranks: above this, the overview replaces a row per rank
BEHIND_S = 1.0  # a rank this many seconds (at the median's rate) behind the median is a straggler
MIN_BEHIND_STEPS = 2
SHOW_STRAGGLERS = 5
SHOW_NODES = 8
BAND_LAG_STEPS = 64  # a step's values are summarised once the newest step is this far ahead


@dataclass(frozen=True)
class Spread:
    lo: float
    mid: float
    hi: float


def spread(values: list) -> Optional[Spread]:
    """Min, median and max of ``values`` (None where it is empty)."""
    values = [v for v in values if v is not None]
    if not values:
        return None
    return Spread(min(values), statistics.median(values), max(values))


@dataclass(frozen=True)
class Straggler:
    rank: int  # global
    local: int  # the view's row
    host: Optional[str]
    behind_steps: float
    behind_s: float  # at the median rank's rate
    rate_ratio: Optional[float]  # its rate over the median's
    since: float  # monotonic: when it first fell behind (this time)


@dataclass(frozen=True)
class NodeSummary:
    host: str
    ranks: int
    failed: int
    progress: Spread  # of the fractions
    slowest: Optional[int]  # global rank furthest behind on this node


@dataclass
class Overview:
    counts: dict  # status -> ranks
    progress: Optional[Spread]  # fractions 0..1
    steps: Optional[Spread]  # the current bar's n
    rate: Optional[Spread]  # steps per second
    total: Optional[float]  # the median rank's bar total
    stragglers: list = field(default_factory=list)  # Straggler, furthest behind first
    more_behind: int = 0  # stragglers beyond those listed
    nodes: list = field(default_factory=list)  # NodeSummary, slowest first (cluster runs)
    more_nodes: int = 0


class StragglerWatch:
    """Since when each rank has been behind, and the worst it ever was."""

    def __init__(self):
        self.since: dict[int, float] = {}  # local rank -> when it fell behind
        self.worst: dict[int, Straggler] = {}  # local rank -> its furthest behind so far

    def update(self, now: float, behind: list[Straggler]) -> list[Straggler]:
        """``behind``: this moment's stragglers (``since`` unset); returns
        them with ``since`` filled in. A rank that caught up starts again."""
        current = {s.local for s in behind}
        for local in list(self.since):
            if local not in current:
                del self.since[local]
        out = []
        for s in behind:
            s = Straggler(s.rank, s.local, s.host, s.behind_steps, s.behind_s, s.rate_ratio,
                          self.since.setdefault(s.local, now))
            worst = self.worst.get(s.local)
            if worst is None or s.behind_s > worst.behind_s:
                self.worst[s.local] = s
            out.append(s)
        return out

    def held_back(self, most: int = 3) -> list[Straggler]:
        """The ranks that were furthest behind at their worst, worst first."""
        return sorted(self.worst.values(), key=lambda s: -s.behind_s)[:most]


def overview(ranks: list, now: float, *, label=lambda i: i, host=lambda i: None,
             watch: Optional[StragglerWatch] = None) -> Overview:
    """The overview of ``ranks`` (``RankState``; ``label``: a row's global
    rank, ``host``: its machine or None)."""
    counts: dict[str, int] = {}
    for r in ranks:
        key = r.status if not r.status.startswith(("paused:", "waiting:")) else r.status.split(":")[0]
        counts[key] = counts.get(key, 0) + 1
    bars = [r.current for r in ranks]
    fractions = [r.fraction for r in ranks]
    rates = [b.rate() if b is not None else None for b in bars]
    running = [i for i, r in enumerate(ranks) if r.status == "running" and bars[i] is not None]
    steps = spread([bars[i].n for i in running])
    rate = spread([rates[i] for i in running])
    totals = [bars[i].total for i in running if bars[i].total]
    behind: list[Straggler] = []
    if steps is not None and len(running) > 1:
        mid_rate = rate.mid if rate is not None and rate.mid > 0 else None
        for i in running:
            lag = steps.mid - bars[i].n
            lag_s = lag / mid_rate if mid_rate else 0.0
            if lag >= MIN_BEHIND_STEPS and lag_s >= BEHIND_S:
                ratio = rates[i] / mid_rate if rates[i] is not None and mid_rate else None
                behind.append(Straggler(label(i), i, host(i), lag, lag_s, ratio, now))
    behind.sort(key=lambda s: -s.behind_s)
    if watch is not None:
        behind = watch.update(now, behind)
    ov = Overview(counts, spread(fractions), steps, rate, statistics.median(totals) if totals else None,
                  behind[:SHOW_STRAGGLERS], max(0, len(behind) - SHOW_STRAGGLERS))
    ov.nodes, ov.more_nodes = _nodes(ranks, fractions, behind, host)
    return ov


def _nodes(ranks: list, fractions: list, behind: list, host) -> tuple[list, int]:
    hosts: dict[str, list[int]] = {}
    for i in range(len(ranks)):
        h = host(i)
        if h is not None:
            hosts.setdefault(h, []).append(i)
    if len(hosts) < 2:
        return [], 0
    worst = {}
    for s in behind:  # furthest behind first: the first seen per node is its slowest
        worst.setdefault(s.host, s.rank)
    nodes = [NodeSummary(h, len(rows), sum(ranks[i].status == "failed" for i in rows),
                         spread([fractions[i] for i in rows]), worst.get(h)) for h, rows in hosts.items()]
    nodes.sort(key=lambda n: (-n.failed, n.progress.mid, n.host))
    return nodes[:SHOW_NODES], max(0, len(nodes) - SHOW_NODES)


class StepBands:
    """One metric over many ranks: at each step, the lowest, median and
    highest value the ranks logged, in memory bounded by ``max_steps`` and
    ``BAND_LAG_STEPS`` x the ranks (not the run's length x the ranks).

    A step's values are kept until every rank (``expected``) has logged it,
    or the newest step is ``BAND_LAG_STEPS`` ahead; then only its summary.
    A value that comes later still widens the band (the median stays)."""

    def __init__(self, expected: int, max_steps: int = 2000):
        self.expected = expected
        self.max_steps = max_steps
        self._open: dict = {}  # step -> values
        self._done: dict = {}  # step -> [lo, mid, hi]
        self._newest = None

    def add(self, step, value: float) -> None:
        done = self._done.get(step)
        if done is not None:
            done[0], done[2] = min(done[0], value), max(done[2], value)
            return
        values = self._open.setdefault(step, [])
        values.append(value)
        if len(values) >= self.expected:
            self._close(step)
        if self._newest is None or step > self._newest:
            self._newest = step
            for old in [s for s in self._open if s <= step - BAND_LAG_STEPS]:
                self._close(old)
        if len(self._done) + len(self._open) > self.max_steps:
            for s in sorted(self._done)[::2]:  # keep the curve, halve its resolution
                del self._done[s]

    def _close(self, step) -> None:
        values = self._open.pop(step)
        self._done[step] = [min(values), statistics.median(values), max(values)]

    def rows(self) -> list[tuple]:
        """``(step, lo, median, hi)`` by step, the open steps included."""
        rows = [(s, *v) for s, v in self._done.items()]
        rows += [(s, min(v), statistics.median(v), max(v)) for s, v in self._open.items()]
        rows.sort(key=lambda r: r[0])
        return rows
