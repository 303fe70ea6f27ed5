"""``nblaunch`` (and ``python -m nblaunch``): detached runs from a terminal.

``runs [--json]`` lists them (those under ``$NBLAUNCH_RUNS_DIR``), ``logs
ID [--rank N] [-f]`` prints the ranks' output, ``attach ID`` follows the
run's text view to its end, ``stop ID`` stops it, ``forget ID`` removes it.
Every run is read through the library's own code (:mod:`.detached`,
:mod:`.folder`), and nothing here imports torch or ipywidgets: a command
answers in well under a second.

Exit status: 0 done; ``attach``: 1 when the run failed, was stopped, timed
out or was preempted, 130 when Ctrl-C left it (the run goes on); 2 for an
unknown or malformed id (one line on stderr, no traceback).
"""
from __future__ import annotations

import argparse
import json
import re
import signal
import sys
import time
from pathlib import Path
from typing import Optional

from .detached import FOLLOW_EVERY_S, DetachedRun, detached_run, detached_runs, runs_root
from .listing import row, text_table

__all__ = ["main"]

LEFT = 130  # what a shell reports for a command ended by Ctrl-C


class Refused(Exception):
    """What the user asked cannot be done: said in one line, exit status 2."""


def main(argv: Optional[list] = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return args.command(args)
    except Refused as exc:
        print(f"nblaunch: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return LEFT
    except BrokenPipeError:  # `nblaunch logs ID | head`
        sys.stderr.close()
        return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nblaunch", description="Detached nblaunch runs "
                                     f"(nblaunch.submit(..., detach=True)) under {runs_root()}.")
    sub = parser.add_subparsers(required=True, metavar="COMMAND")
    listing = sub.add_parser("runs", help="list the detached runs")
    listing.add_argument("--json", action="store_true", help="one JSON list of the runs")
    listing.set_defaults(command=runs)
    logs_ = sub.add_parser("logs", help="print what the ranks printed")
    logs_.add_argument("id")
    logs_.add_argument("--rank", type=int, help="this rank's output only (default: every rank's, tagged)")
    logs_.add_argument("-f", "--follow", action="store_true", help="keep printing until the run ends")
    logs_.set_defaults(command=logs)
    for name, fn, text in (("attach", attach, "follow the run's view until it ends (Ctrl-C leaves it running)"),
                           ("stop", stop, "stop the run's ranks"),
                           ("forget", forget, "remove the run's folder, stopping it first if it runs")):
        one = sub.add_parser(name, help=text)
        one.add_argument("id")
        one.set_defaults(command=fn)
    return parser


def runs(args) -> int:
    rows = [row(run) for run in detached_runs()]
    if args.json:
        print(json.dumps(rows, indent=1))
    elif rows:
        print(text_table(rows))
    else:
        print(f"no detached runs under {runs_root()}")
    return 0


def attach(args) -> int:
    run = _run(args.id)
    # SIGINT leaves the view, even where it came ignored (a script's background job, a detached
    # test run: a shell without job control starts those so): `kill -INT` from a script that
    # started this follower is how it leaves, as Ctrl-C is at a terminal.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        run.follow(display="text", wait=True)
    except KeyboardInterrupt:
        print(f"\nleft run {run.id}, still {run.status}: `nblaunch attach {run.id}` follows it again",
              file=sys.stderr)
        return LEFT
    error = run.exception()
    if error is not None:
        print(f"run {run.id} {run.status}: {error}", file=sys.stderr)
    return 0 if run.status == "finished" else 1


def stop(args) -> int:
    run = _run(args.id)
    if run.done():
        print(f"run {run.id} had already ended: {run.status}")
        return 0
    run.stop()
    print(f"run {run.id}: {run.status}")
    return 0


def forget(args) -> int:
    run = _run(args.id)
    run.forget()
    print(f"run {run.id} forgotten: its folder is removed")
    return 0


def logs(args) -> int:
    run = _run(args.id)
    printed: dict = {}  # log file -> bytes printed from it
    while True:
        ended = run.done()  # read before the files: what it wrote until then is in them
        _print_new(run, args.rank, printed, whole_lines=args.follow and not ended)
        if not args.follow or ended:
            return 0
        time.sleep(FOLLOW_EVERY_S)


def _print_new(run: DetachedRun, rank: Optional[int], printed: dict, whole_lines: bool) -> None:
    """What the ranks wrote since ``printed``, each line tagged ``[rank N]``
    unless one rank was asked for (its file as it is)."""
    files = _log_files(run)
    if rank is not None:
        if files and rank not in files:
            raise Refused(f"run {run.id} has no rank {rank} (ranks: {', '.join(map(str, sorted(files)))})")
        files = {rank: files[rank]} if rank in files else {}
    for r, path in sorted(files.items()):
        with open(path, "rb") as f:
            f.seek(printed.get(path, 0))
            data = f.read()
        if whole_lines:  # a line still being written is printed once whole
            data = data[:data.rfind(b"\n") + 1]
        printed[path] = printed.get(path, 0) + len(data)
        text = data.decode("utf-8", "replace")
        if rank is None:
            text = "".join(f"[rank {r}] {line}" for line in text.splitlines(keepends=True))
        sys.stdout.write(text)
    sys.stdout.flush()


def _log_files(run: DetachedRun) -> dict:
    folder = Path(run.log_dir) if run.log_dir else None
    if folder is None or not folder.is_dir():
        return {}
    found = (re.fullmatch(r"rank(\d+)\.log", p.name) for p in folder.iterdir())
    return {int(m.group(1)): folder / m.group(0) for m in found if m}


def _run(run_id: str) -> DetachedRun:
    try:
        run = detached_run(run_id)
    except ValueError as exc:
        raise Refused(str(exc)) from None
    if run is None:
        known = ", ".join(r.id for r in detached_runs()) or "none"
        raise Refused(f"no detached run {run_id!r} under {runs_root()} (runs: {known})")
    return run
