"""Jupyter's interrupt, sent the moment the zygote is forked
(tests/test_zygote.py): ``python group_interrupt.py LAUNCHES``, run as the
leader of its own process group, as a kernel is.

Each launch's SIGINT goes, as ``jupyter_client`` sends it, to the whole
group, right after the launch's one fork (the zygote, which is then still in
this group): the timing is made with the zygote's ``forked`` hook, the
signal and the processes are real. Prints one JSON line per launch: what the
launch raised, how long it took to return, the launch's processes still
running 1 s after it returned, whether the zygote was sent the signal
(still in the group when it went), whether it holds that signal unhandled,
and how the zygote ended (0: on its own,
once its ranks were reaped; -9: ended by the stop while still making them)
and how long its reaping took."""
from __future__ import annotations

import json
import os
import signal
import sys
import time

from conftest import launch_processes, wait_gone
from nblaunch import notebook_launcher
from nblaunch.engines import zygote


def sleeper():
    time.sleep(600)


HITS: list = []  # per launch: the zygote was still in this group when the signal went
HELD: list = []  # per launch: the zygote holds that SIGINT, unhandled
EXITS: list = []  # per launch: the zygote's exit code, once reaped
REAPS: list = []  # per launch: how long reaping it took (its timeout, 2 s, then a kill: it hung)


def _holds_a_pending_sigint(pid: int) -> bool:
    """SIGINT is pending for ``pid`` and held by it (/proc's masks): its
    handler has not run and will not."""
    masks = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name in ("ShdPnd", "SigBlk"):
                masks[name] = int(value, 16)
    bit = 1 << (signal.SIGINT - 1)
    return bool(masks["ShdPnd"] & bit and masks["SigBlk"] & bit)


def note_exit(reap):
    def reap_and_note(self, timeout=2.0):
        popen = self._proc._popen
        t0 = time.monotonic()
        reap(self, timeout)
        EXITS.append(None if popen is None else popen.returncode)
        REAPS.append(time.monotonic() - t0)
    return reap_and_note


def interrupt_at_fork(start):
    def start_then_interrupt(self, timeout=60.0, forked=lambda: None):
        def forked_then_interrupt():
            forked()
            os.killpg(os.getpgrp(), signal.SIGINT)
            try:  # it leaves the group once: still in it now, it was in it then
                HITS.append(os.getpgid(self._proc.pid) == os.getpgrp())
                HELD.append(_holds_a_pending_sigint(self._proc.pid))
            except (ProcessLookupError, FileNotFoundError):
                HITS.append(False)
                HELD.append(False)
        return start(self, timeout, forked_then_interrupt)
    return start_then_interrupt


def main(launches: int) -> None:
    assert os.getpgrp() == os.getpid(), "run me as a process group leader (start_new_session)"
    # Python's handler, as a kernel has it: a process started in the
    # background by a script inherits SIGINT ignored, and Python keeps that.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    notebook_launcher(lambda: 1, num_processes=2, display="none")  # warm, not interrupted
    zygote.Zygote.start = interrupt_at_fork(zygote.Zygote.start)
    zygote.Zygote.reap = note_exit(zygote.Zygote.reap)
    for _ in range(launches):
        t0 = time.monotonic()
        try:
            notebook_launcher(sleeper, num_processes=2, display="none", timeout=60)
            raised = None
        except BaseException as exc:  # noqa: BLE001 - reported
            raised = type(exc).__name__
        took = time.monotonic() - t0
        left = wait_gone(launch_processes(os.getpid()), timeout=1.0)
        deadline = time.monotonic() + 5.0
        while len(EXITS) < len(HITS) and time.monotonic() < deadline:  # reaped by nblaunch's own thread
            time.sleep(0.01)
        print(json.dumps({"raised": raised, "took": took, "left": left, "zygote_got_it": HITS[-1],
                          "zygote_held_it": HELD[-1],
                          "zygote_exit": EXITS[-1] if len(EXITS) == len(HITS) else "not reaped",
                          "zygote_reap_s": REAPS[-1] if len(REAPS) == len(HITS) else None}), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]))
