"""Stopping many ranks: each named by its pidfd, and a failure named before
the others are stopped (the error itself waits until they are gone)."""
from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from nblaunch.system import pidfds
from nblaunch.engines.pool import Message
from nblaunch.watch.call import NAME_AT_ONCE_ABOVE, CallWatch
from nblaunch.wire.channel import Failure

needs_pidfd = pytest.mark.skipif(not hasattr(__import__("os"), "pidfd_open"), reason="no pidfds here")


@needs_pidfd
def test_a_pidfd_names_the_process_until_it_ends_and_never_another():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        fd = pidfds.open_pidfd(proc.pid, lambda: proc.poll() is None)
        assert fd is not None and pidfds.ended([fd]) == set() and not pidfds.exiting(proc.pid)
        assert not pidfds.wait([fd], 0.05)
        pidfds.send(fd, signal.SIGTERM)
        assert pidfds.wait([fd], 10) and pidfds.ended([fd]) == {fd}  # a zombie has ended: not yet reaped
        assert proc.wait(10) == -signal.SIGTERM
        pidfds.send(fd, signal.SIGKILL)  # reaped: nothing happens, to it or to whoever takes its pid
        import os

        os.close(fd)
        # Its parent has reported it ended: the pid may name another process by now.
        assert pidfds.open_pidfd(proc.pid, lambda: proc.poll() is None) is None
    finally:
        proc.kill()
        proc.wait()


class _Pool:
    """What the call watch asks of a pool when a rank fails."""

    def __init__(self, size):
        self.size, self.log_dir, self.placement, self.calls = size, "/tmp/x", None, []

    def global_rank(self, rank):
        return rank

    def node(self, rank):
        return None

    def node_name(self, rank):
        return None

    def ended_now(self, rank):
        return False

    def exit_seen(self, rank):
        return False

    def signal(self, sig, ranks):
        self.calls.append(("signal", sig))

    def publish(self, failure):
        pass

    def send(self, rank, message):
        return True


class _View:
    def __init__(self, pool):
        self.pool = pool

    def rank_status(self, rank, status):
        pass

    def notice(self, text):
        self.pool.calls.append(("notice", text))


@pytest.mark.parametrize("size", [8, 64])
def test_a_failure_among_many_ranks_is_named_before_they_are_stopped(size):
    pool = _Pool(size)
    watch = CallWatch(pool, _View(pool), 0)
    watch._apply([Message(5, Failure(5, time.time(), "RuntimeError", "boom", "Traceback ...", None, "fn"))])
    if size > NAME_AT_ONCE_ABOVE:
        assert pool.calls[0] == ("notice", "rank 5 raised RuntimeError: boom; stopping the other ranks "
                                           "(the error follows once they are gone)")
    assert pool.calls[-1] == ("signal", signal.SIGTERM)
    assert len(pool.calls) == (2 if size > NAME_AT_ONCE_ABOVE else 1)
