"""A launch from a process that whatever started it has left behind
(tests/test_detached.py): ``python detached_launch.py OUT TOKEN STARTER``.

It first waits until STARTER (the pid of what started it, or 0 for none to
wait on) has ended, so the launches below run only once this process has
been handed to another parent. Then it writes to OUT, as JSON, the facts of
its ancestry (for the test to check the case it meant to make) and the
result of a 2-rank launch with each start method. TOKEN only names this
process on the command line, for the test to find it in any pid namespace."""
from __future__ import annotations

import json
import os
import sys
import time

from nblaunch import notebook_launcher
from nblaunch.system import procid


def rank_and_sum():
    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    return dist.get_rank(), t.item()


def main(out: str, starter: int) -> None:
    deadline = time.monotonic() + 60
    while starter and not procid.gone(starter) and time.monotonic() < deadline:
        time.sleep(0.01)
    pgid = os.getpgid(0)
    facts = {"starter_gone": not starter or procid.gone(starter), "parent": os.getppid(),
             "pid": os.getpid(), "leads_group": pgid == os.getpid(),
             "group_leader_gone": pgid != os.getpid() and (pgid == 0 or procid.gone(pgid)),
             "stdin_tty": os.isatty(0), "env": sorted(os.environ)}
    results = {}
    for method in ("fork", "forkserver", "spawn"):
        try:
            results[method] = notebook_launcher(rank_and_sum, num_processes=2, start_method=method,
                                                display="none", timeout=120)
        except Exception as e:  # the test shows what the user would have seen
            results[method] = f"{type(e).__name__}: {e}"
    tmp = out + ".part"
    with open(tmp, "w") as f:
        json.dump({"facts": facts, "results": results}, f)
    os.replace(tmp, out)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[3]))
