"""What a list of runs shows: one row per run (id, state, ranks and nodes,
progress, started, how long), as the notebook's table (``RunList``, what
``nblaunch.runs()`` returns) and the terminal's (``nblaunch runs``)."""
from __future__ import annotations

import html
import time
from typing import Optional

__all__ = ["RunList", "row", "progress", "duration", "COLUMNS", "text_table"]

COLUMNS = ("id", "state", "ranks", "progress", "started", "took")


class RunList(list):
    """A plain list of runs, oldest first, that a notebook shows as a table."""

    def _repr_html_(self) -> str:
        if not self:
            return "<i>nblaunch: no runs</i>"
        head = "".join(f"<th style='text-align:left'>{c}</th>" for c in COLUMNS)
        body = "".join("<tr>" + "".join(f"<td style='text-align:left'>{html.escape(str(r[c]))}</td>"
                                        for c in COLUMNS) + "</tr>" for r in map(row, self))
        return f"<table class='nblaunch-runs'><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def row(run, now: Optional[float] = None) -> dict:
    """One run as the tables show it (``--json`` prints these)."""
    now = time.time() if now is None else now
    state = run.view_state()
    status = run.status  # read first: a detached run reads its folder here
    world = getattr(state, "world_size", 0) or run.config.num_processes * (run.config.num_nodes or 1)
    nodes = getattr(state, "num_nodes", 1) if state is not None and state.hosts else (run.config.num_nodes or 1)
    ended = run.ended_at if run.ended_at else None
    return {"id": run.id, "state": status, "detached": run.detached,
            "ranks": f"{world}" + (f" on {nodes} nodes" if nodes > 1 else ""),
            "progress": progress(state), "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(run.started_at)),
            "took": duration((ended or now) - run.started_at), "log_dir": run.log_dir or ""}


def progress(state) -> str:
    """The slowest rank's bar (``train 412/1000 (41%)``), or the ranks' phase."""
    ranks = list(getattr(state, "ranks", None) or [])
    moving = [r for r in ranks if r.current is not None]
    if not moving:
        return ""
    slowest = min(moving, key=lambda r: r.fraction)
    desc = f"{slowest.desc} " if slowest.desc else ""
    if slowest.total:
        return f"{desc}{slowest.n:.0f}/{slowest.total:.0f} ({slowest.fraction:.0%})"
    return f"{desc}{slowest.n:.0f}"


def duration(seconds: float) -> str:
    """``42 s``, ``3 min 05 s``, ``2 h 07 min``."""
    seconds = max(0, int(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


def text_table(rows: list) -> str:
    """The rows as aligned columns under a header."""
    lines = [[c.upper() for c in COLUMNS]] + [[str(r[c]) for c in COLUMNS] for r in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in lines)
