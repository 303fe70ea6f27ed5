"""SLURM's preemption notice (SIGTERM to the kernel) the moment the launch's
zygote is forked, before any rank is in ``fn`` (tests/test_resilience.py):
``python notice_at_fork.py LAUNCHES``.

The timing is made with the zygote's ``forked`` hook; the signal and the
processes are real. Prints one JSON line per launch: its results, or the
name of what it raised."""
from __future__ import annotations

import json
import os
import signal
import sys

from nblaunch import notebook_launcher
from nblaunch.engines import zygote


def until_preempted():
    import time

    import nblaunch

    while not nblaunch.preempted(agree=True):
        time.sleep(0.01)
    return "saved"


def notice_at_fork(start):
    def start_then_notice(self, timeout=60.0, forked=lambda: None):
        def forked_then_notice():
            forked()
            os.kill(os.getpid(), signal.SIGTERM)
        return start(self, timeout, forked_then_notice)
    return start_then_notice


def main(launches: int) -> None:
    notebook_launcher(lambda: 1, num_processes=2, display="none")  # warm, no notice
    zygote.Zygote.start = notice_at_fork(zygote.Zygote.start)
    for _ in range(launches):
        try:
            out = {"results": list(notebook_launcher(until_preempted, num_processes=2, display="none",
                                                     preempt_grace=60, timeout=120))}
        except BaseException as exc:  # noqa: BLE001 - reported
            out = {"raised": type(exc).__name__}
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]))
