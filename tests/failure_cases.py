"""One table of real ways a rank fails while its peer waits in a collective,
and what the error must say; shared by tests/test_failures.py and
bench/failures.py (an importable module, so spawned ranks can load it)."""
from __future__ import annotations

import signal

# case -> (kind, exc_type, exitcode or signal) of the root cause the error must name: rank 1.
EXPECTED = {
    "sigkill": ("signal", "", signal.SIGKILL),
    "segfault": ("signal", "", signal.SIGSEGV),
    "sys.exit(1)": ("exception", "SystemExit", None),
    # A rank that leaves early without an error is the cause, not the peer
    # that lost it: "rank 1 exited (code 0) while rank 0 was in all_reduce".
    "os._exit(0)": ("left", "", 0),
    "sys.exit(0)": ("left", "", 0),
    "return": ("left", "", None),
    "raise": ("exception", "ValueError", None),
    "raise, __str__ raises": ("exception", "BadStr", None),
}


class BadStr(Exception):
    def __str__(self):
        raise RuntimeError("no str for you")


def fail(case: str, stamp: str = ""):
    """Rank 0 waits in all_reduce; rank 1 fails as ``case`` says, first
    writing the time it fails to ``stamp`` when given."""
    import ctypes
    import os
    import sys
    import time

    import torch
    import torch.distributed as dist

    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1))  # never completes: rank 1 does not join
        return "rank 0 should not get here"
    time.sleep(0.05)  # rank 0 is in the collective by now
    if stamp:
        with open(stamp, "w") as f:
            f.write(repr(time.time()))
    if case == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif case == "segfault":
        ctypes.string_at(0)
    elif case == "sys.exit(1)":
        sys.exit(1)
    elif case == "os._exit(0)":
        os._exit(0)
    elif case == "sys.exit(0)":
        sys.exit(0)
    elif case == "return":
        return "rank 1 is done early"
    elif case == "raise":
        raise ValueError("rank 1 gives up")
    elif case == "raise, __str__ raises":
        raise BadStr()
    raise AssertionError(f"unknown case {case}")


def verdict(case: str, method: str, stamp: str = "", display: str = "none") -> tuple:
    """Run one launch; return (rank blamed, matches EXPECTED, summary line)."""
    from nblaunch import WorkerError, notebook_launcher

    try:
        notebook_launcher(fail, args=(case, stamp), num_processes=2, start_method=method, display=display,
                          timeout=60)
    except WorkerError as exc:
        kind, exc_type, code = EXPECTED[case]
        root = exc.root
        got_code = root.signal if kind == "signal" else root.exitcode
        ok = (exc.rank == 1 and root.kind == kind and root.exc_type == exc_type
              and (code is None or got_code == code)
              and (kind != "left" or root.summary().endswith("while rank 0 was in all_reduce")))
        return exc.rank, ok, root.summary()
    return None, False, "no error raised"
