"""Ends what a rank started when the rank is killed with its kernel.

A rank ends its own process tree when it leaves, and the kernel ends it when
it stops a rank. Neither can when the kernel itself is killed (the OOM
killer, a restart): the rank dies at once by its parent-death signal and
its children are handed to init. So each rank starts one of these: a small
separate process (a fresh interpreter, in its own session so no signal meant
for the rank's group reaches it) that notes the rank's process tree once a
second and, when the rank is gone, kills the rank's process group and every
process it noted. The rank holds the write end of a pipe whose read end is
the janitor's: end of file means the rank is gone.

    python -m nblaunch.rank.janitor <rank pid> <pipe fd>
"""
from __future__ import annotations

import os
import select
import signal
import sys

import psutil

POLL_S = 1.0


def main(rank_pid: int, fd: int) -> None:
    me = os.getpid()
    try:
        rank = psutil.Process(rank_pid)
    except psutil.Error:
        return
    seen: dict[int, psutil.Process] = {}
    while True:
        try:
            for proc in rank.children(recursive=True):
                if proc.pid != me:
                    seen.setdefault(proc.pid, proc)
        except psutil.Error:
            break
        ready, _, _ = select.select([fd], [], [], POLL_S)
        if ready and not os.read(fd, 1):
            break  # end of file: the rank is gone
    try:
        os.killpg(rank_pid, signal.SIGKILL)  # the rank made itself a process group leader
    except OSError:
        pass
    for proc in seen.values():
        try:
            proc.kill()  # psutil checks the pid still names the process it saw
        except psutil.Error:
            pass


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
