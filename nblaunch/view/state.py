"""The view's model: what a launch or call looks like now, fed by the call
watch through the view (:class:`~nblaunch.view.base.View`); the renderers
read it."""
from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field
from typing import Optional

from .many import MANY_ABOVE, StepBands, StragglerWatch, overview

__all__ = ["BarState", "RankState", "LaunchState", "clip"]

MAX_RATE = 10.0
MAX_LINES_PER_S = 1000  # sustained, over all ranks; bursts up to a screenful more (below)
MAX_BYTES_PER_S = 256 << 10  # well under Jupyter's IOPub limit (1 MB/s averaged over 3 s)
STATUS_EVERY_S = 10.0
MAX_POINTS = 2000
LOG_TAIL = 40  # lines kept for the text summary and failure reports
PAGE_LINES = 100  # the widget's log pane: lines per page (only the newest page is re-sent)
MAX_PAGES = 50  # ... and pages kept (5,000 lines; the log files keep everything)
MAX_LINE_CHARS = 2000  # longer lines are shortened in the view, never in the log file
AGGREGATE_ABOVE = MANY_ABOVE
MANY_POINTS = 100  # per rank and metric above MANY_ABOVE ranks: the band holds the run (view/many.py)
STILL_AFTER_S = 10.0  # a running rank's row says how long since its last step after this long
TEXT_TAIL_LINES = 20  # of the ranks' output, what the final text/plain keeps
RANK_TAIL = 48  # each rank's last lines, for the view's pages by rank (view/by_rank.py) ...
RANK_TAIL_CHARS = 400  # ... each at most this long there (20 MB at most for 1,024 ranks)


@dataclass
class BarState:
    """One progress bar of a rank (a ``progress`` or a tqdm bar)."""

    desc: str = ""
    n: float = 0
    total: Optional[float] = None
    postfix: str = ""
    closed: bool = False
    first_seen: Optional[tuple[float, float]] = None  # (rank's time, n) the rate is measured from
    moved_at: float = 0.0  # the rank's time of the latest change
    last_change: float = 0.0  # the kernel's monotonic time of the latest change (stall warnings)
    reported_at: float = 0.0  # the rank's time of its latest report (closing included)

    def rate(self) -> Optional[float]:
        """Items per second from the first report to the latest change, on
        the rank's clock (the kernel receives reports in batches)."""
        if self.first_seen is None or self.moved_at <= self.first_seen[0]:
            return None
        return (self.n - self.first_seen[1]) / (self.moved_at - self.first_seen[0])

    def text(self) -> str:
        label = f"{self.desc} " if self.desc else ""
        return f"{label}{_count(self.n)}/{_count(self.total)}" if self.total else f"{label}{_count(self.n)}"


def _count(n: float) -> str:
    return str(int(n)) if float(n).is_integer() else f"{n:.4g}"


@dataclass
class RankState:
    status: str = "starting"
    bars: dict = field(default_factory=dict)  # key -> BarState, in the order the rank opened them
    metrics: dict = field(default_factory=dict)
    usage: Optional[object] = None  # resources.Usage, sampled about once a second while it runs
    peak_rss: int = 0  # the most memory a sample saw (kept for the final view)
    peak_gpu: Optional[tuple] = None  # (device, the most GPU memory a sample saw)
    phase: str = ""  # what a running rank is doing before its first step (channel.Phase)
    phase_at: float = 0.0  # since when (the kernel's monotonic clock)

    @property
    def current(self) -> Optional[BarState]:
        """The bar the row shows: the newest open one (the inner loop of
        epoch + batch bars), else the one that closed last (the outer loop,
        which closes after its inner one)."""
        for bar in reversed(self.bars.values()):
            if not bar.closed:
                return bar
        return max(self.bars.values(), key=lambda b: b.reported_at, default=None)

    @property
    def last_change(self) -> float:
        return max((b.last_change for b in self.bars.values()), default=0.0)

    @property
    def n(self) -> float:
        return self.current.n if self.current else 0

    @property
    def total(self) -> Optional[float]:
        return self.current.total if self.current else None

    @property
    def fraction(self) -> float:
        """How full its bar is, 0..1: ``n / total`` (clipped at 1); a rank
        with no total is empty until it finishes, then full."""
        bar = self.current
        if bar is not None and bar.total:
            return min(1.0, bar.n / bar.total)
        return 1.0 if self.status == "finished" else 0.0

    @property
    def desc(self) -> str:
        return self.current.desc if self.current else ""

    def detail(self, sep: str = " ") -> str:
        """Status, bars, rate, ETA (running rows only) and metrics: a row's
        text, its parts joined by ``sep``."""
        parts = [self.status]
        bar = self.current
        moving = bar is not None and (bar.total or bar.n)
        if self.status == "running" and self.phase and not moving:
            # No row sits silent at 0%: what the rank does before its first step.
            parts.append(f"\u00b7 {self.phase} {time.monotonic() - self.phase_at:.0f} s")
        elif self.status == "running" and moving and time.monotonic() - self.last_change >= STILL_AFTER_S:
            parts.append(f"\u00b7 {time.monotonic() - self.last_change:.0f} s since its last step")
        if moving:
            outer = [b.text() for b in self.bars.values() if not b.closed and b is not bar]
            parts.append(" \u00b7 ".join(outer + [bar.text()]))
            rate = bar.rate()
            if rate:
                parts.append(f"{rate:.3g} it/s" if rate < 100 else f"{rate:.0f} it/s")
                if self.status == "running" and bar.total and bar.n < bar.total and not bar.closed:
                    parts.append(f"ETA {(bar.total - bar.n) / rate:.0f} s")
            if bar.postfix:
                parts.append(bar.postfix)
        parts += [f"{k}={v:.4g}" for k, v in self.metrics.items()]
        if self.usage is not None and self.status == "running":
            parts.append(f"\u00b7 {self.usage.text()}")  # a middle dot: no line break after it, unlike "|"
        elif self.peak_rss:  # where people look for "how much memory did it take"
            gpu = f" gpu{self.peak_gpu[0]} {_size(self.peak_gpu[1])}" if self.peak_gpu else ""
            parts.append(f"\u00b7 peak mem {_size(self.peak_rss)}{gpu}")
        return sep.join(parts)

    def line(self, name: str, now: float = 0.0) -> str:
        """``name`` (``rank 3``, see ``LaunchState.row_name``) and what the rank is doing."""
        return f"{name} {self.detail()}"


class LaunchState:
    """Everything the view shows, fed by the call watch."""

    def __init__(self):
        self.state = "starting"
        self.world_size = 0
        self.call = 0  # a live session's call number (0: a launch)
        self.method = self.backend = ""
        self.log_dir = ""
        self.first_rank = 0  # global rank of this node's local rank 0
        self.node: Optional[int] = None  # this node, in a multi-node launch
        self.num_nodes = 1
        self.hosts: Optional[list] = None  # a cluster launch: each row's machine
        self.t0 = time.monotonic()
        self.ranks: list[RankState] = []
        self.series: dict[str, dict[int, list]] = collections.defaultdict(dict)
        self.bands: dict[str, StepBands] = {}  # above MANY_ABOVE ranks: each metric's median and band
        self.stragglers = StragglerWatch()
        self.tail: collections.deque = collections.deque(maxlen=LOG_TAIL)
        self.rank_tail: dict[int, collections.deque] = {}  # rank (in the job) -> its last lines
        self.notices: list[str] = []
        self.changed = True

    def begin(self, world_size: int, method: str, backend: str, log_dir: str, call: int = 0) -> None:
        self.world_size, self.method, self.backend, self.log_dir = world_size, method, backend, log_dir
        self.call = call
        self.ranks = [RankState() for _ in range(world_size)]

    def place(self, first_rank: int, world_size: int, node: Optional[int], num_nodes: int,
              hosts: Optional[list] = None) -> None:
        """Once the nodes have met: this node's ranks are ``first_rank`` on
        (``hosts``: a cluster launch's rows, each rank's machine)."""
        self.first_rank, self.world_size, self.node, self.num_nodes = first_rank, world_size, node, num_nodes
        self.hosts = hosts
        self.changed = True

    def row_name(self, local: int) -> str:
        """``rank 3``, or ``rank 3 · n2`` when ranks run on several machines."""
        host = self.hosts[local] if self.hosts and local < len(self.hosts) else None
        return f"rank {self.label(local)}" + (f" · {host}" if host else "")

    @property
    def title(self) -> str:
        """``nblaunch``, or ``nblaunch call 3`` on live ranks."""
        return f"nblaunch call {self.call}" if self.call else "nblaunch"

    def label(self, local: int) -> int:
        return self.first_rank + local

    @property
    def where(self) -> str:
        """``4 ranks`` or ``4 ranks, node 1 of 2``."""
        if self.hosts:
            return f"{self.world_size} ranks on {self.num_nodes} nodes"
        return f"{self.world_size} ranks" + (f", node {self.node} of {self.num_nodes}" if self.node is not None else "")

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def end(self, state: str) -> None:
        """The launch is over: ``state`` is its outcome, and a row still
        running says how it ended (no row is left "running")."""
        self.state = state
        ended = {"timed out": "timed out", "interrupted": "interrupted"}.get(state, "stopped")
        for r in self.ranks:
            if r.status in ("starting", "running") or r.status.startswith(("paused:", "waiting:")):
                r.status = ended
        self.changed = True

    def rank_output(self, rank: int, lines: list[str]) -> None:
        """Lines rank ``rank`` (its number in the job) wrote, all of them,
        whatever the view shows at once: each rank keeps its last ``RANK_TAIL``."""
        tail = self.rank_tail.get(rank)
        if tail is None:
            tail = self.rank_tail[rank] = collections.deque(maxlen=RANK_TAIL)
        tail.extend(line if len(line) <= RANK_TAIL_CHARS else f"{line[:RANK_TAIL_CHARS]} ... (the rest in its log file)"
                    for line in lines[-RANK_TAIL:])

    def resources(self, usage: dict) -> None:
        """``local rank -> resources.Usage``, from the call watch's sampler."""
        for rank, u in usage.items():
            r = self.ranks[rank]
            r.usage = u
            r.peak_rss = max(r.peak_rss, u.rss)
            if u.gpu is not None and (r.peak_gpu is None or u.gpu[1] > r.peak_gpu[1]):
                r.peak_gpu = (u.gpu[0], u.gpu[1])
        self.changed = True

    def set_phase(self, rank: int, phase: str) -> None:
        self.ranks[rank].phase, self.ranks[rank].phase_at = phase, time.monotonic()
        self.changed = True

    def set_rank(self, rank: int, status: str) -> None:
        self.ranks[rank].status = status
        if status == "running" and self.state == "starting":
            self.state = "running"
        self.changed = True

    def progress(self, event) -> None:
        bar = self.ranks[event.rank].bars.setdefault(event.key, BarState())
        now = time.monotonic()
        if bar.first_seen is None or event.desc != bar.desc or event.n < bar.n:
            bar.first_seen = (event.time, event.n)  # a new bar, or one reset for the next epoch
        if event.n != bar.n or event.total != bar.total:
            bar.last_change, bar.moved_at = now, event.time
        bar.desc, bar.n, bar.total, bar.closed = event.desc, event.n, event.total, event.closed
        bar.reported_at = event.time
        bar.postfix = getattr(event, "postfix", "")
        self.changed = True

    @property
    def many(self) -> bool:
        """Too many ranks for a row each: the view shows an overview (view/many.py)."""
        return len(self.ranks) > MANY_ABOVE

    def metrics(self, event) -> None:
        r = self.ranks[event.rank]
        most = MANY_POINTS if self.many else MAX_POINTS
        for step, _, values in event.points:
            r.metrics.update(values)
            for name, value in values.items():
                points = self.series[name].setdefault(self.label(event.rank), [])
                points.append((step, value))
                if len(points) > most:  # keep the curve, halve its resolution
                    del points[::2]
                if self.many:
                    band = self.bands.get(name)
                    if band is None:
                        band = self.bands[name] = StepBands(len(self.ranks), MAX_POINTS)
                    band.add(step, value)
        self.changed = True

    def overview(self, now: Optional[float] = None):
        """The many-rank overview now (``view.many.Overview``); updates the stragglers' record."""
        hosts = self.hosts or []
        return overview(self.ranks, time.monotonic() if now is None else now, label=self.label,
                        host=lambda i: hosts[i] if i < len(hosts) else None, watch=self.stragglers)

    def summary(self) -> str:
        now = time.monotonic()
        if self.many:
            return _overview_text(self.overview(now), len(self.ranks))
        return " | ".join(r.line(self.row_name(i), now) for i, r in enumerate(self.ranks))

    @property
    def has_progress(self) -> bool:
        return any(r.total or r.n or r.metrics for r in self.ranks)


def _overview_text(ov, world: int) -> str:
    """A status line for many ranks: counts, the median, the slowest."""
    parts = [", ".join(f"{n} {k}" for k, n in ov.counts.items())]
    if ov.steps is not None:
        total = f"/{ov.total:.0f}" if ov.total else ""
        parts.append(f"steps min {ov.steps.lo:.0f} median {ov.steps.mid:.0f} max {ov.steps.hi:.0f}{total}")
    if ov.rate is not None:
        parts.append(f"median {ov.rate.mid:.3g} it/s")
    if ov.stragglers:
        parts.append("slowest: " + ", ".join(f"rank {s.rank} {s.behind_s:.1f} s behind" for s in ov.stragglers[:3]))
    return " | ".join(parts)


def clip(line: str) -> str:
    """A line as the view shows it: at most ``MAX_LINE_CHARS`` characters."""
    if len(line) <= MAX_LINE_CHARS:
        return line
    return f"{line[:MAX_LINE_CHARS]} ... [{len(line) - MAX_LINE_CHARS:,} more characters in the log file]"


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"
