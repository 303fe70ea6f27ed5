"""The heartbeats between the kernel and a node's agent (issue 47), on their own: the rule (wall time
since the last message received), a silent peer told it was dropped, a peer frozen by SIGSTOP,
and no false alarm from a peer whose main thread holds the GIL in a pure-Python loop."""
from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time

import pytest

from nblaunch.config import LaunchConfig
from nblaunch.wire import agent_messages as msg
from nblaunch.wire.beats import Beats, interval_for

LOST_AFTER_S = 1.0


def _until(what: str, found, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if found():
            return
        time.sleep(0.02)
    raise AssertionError(f"not {what} within {timeout:.0f} s")


def test_a_silent_peer_is_found_after_the_lost_after_time_and_told_it_was_dropped():
    mine, theirs = multiprocessing.Pipe()
    found = threading.Event()
    beats = Beats(LOST_AFTER_S, on_silent=lambda key, s: (found.set(), msg.Dropped(f"no heartbeat for {s:.0f} s"))[1])
    t0 = time.monotonic()
    beats.add("n2", mine)
    try:
        assert found.wait(10)
        took = time.monotonic() - t0
        assert LOST_AFTER_S < took < LOST_AFTER_S + interval_for(LOST_AFTER_S) + 1.0
        assert beats.silent["n2"] > LOST_AFTER_S
        got = []
        while True:  # what the peer reads once it comes back: beats, then the word, then the end
            try:
                got.append(theirs.recv())
            except EOFError:
                break
        assert isinstance(got[0], msg.Heartbeat) and got[-1] == msg.Dropped("no heartbeat for 1 s")
    finally:
        beats.stop()


def test_any_message_received_on_the_other_link_counts_as_a_beat():
    mine, theirs = multiprocessing.Pipe()
    beats = Beats(LOST_AFTER_S)
    beats.add("n2", mine)
    try:
        for _ in range(int(4 * LOST_AFTER_S / 0.1)):  # a large message in flight elsewhere: its pieces arrive
            beats.heard("n2")
            time.sleep(0.1)
        assert beats.silent == {}
    finally:
        beats.stop()


def _beat_forever(link, busy_s: float) -> None:
    beats = Beats(LOST_AFTER_S)
    beats.add("kernel", link)
    t = time.monotonic()
    while time.monotonic() - t < busy_s:  # the main thread holds the GIL, but for its switches
        pass
    time.sleep(3600)


@pytest.mark.parametrize("busy", [False, True])
def test_a_frozen_peer_is_silent_and_a_busy_one_is_not(busy):
    mine, theirs = multiprocessing.Pipe()
    peer = multiprocessing.get_context("fork").Process(target=_beat_forever, args=(theirs, 3600 if busy else 0))
    peer.start()
    words = []
    beats = Beats(LOST_AFTER_S, on_word=lambda key, word: words.append(word))
    beats.add("peer", mine)
    try:
        time.sleep(4 * LOST_AFTER_S)
        assert beats.silent == {} and words == []
        if not busy:
            os.kill(peer.pid, signal.SIGSTOP)
            t0 = time.monotonic()
            _until("found silent", lambda: "peer" in beats.silent)
            assert time.monotonic() - t0 < LOST_AFTER_S + 1.0
    finally:
        beats.stop()
        os.kill(peer.pid, signal.SIGKILL)
        peer.join(10)


@pytest.mark.parametrize("value", [0, 0.1, -3, "10", True, float("nan")])
def test_node_lost_after_is_refused_before_anything_starts(value):
    with pytest.raises(ValueError, match="node_lost_after must be a number of seconds >= 0.5"):
        LaunchConfig(1, cluster="slurm", node_lost_after=value)


def test_node_lost_after_overrides_the_variable(monkeypatch):
    monkeypatch.setenv("NBLAUNCH_NODE_LOST_AFTER", "30")
    assert LaunchConfig(1, cluster="slurm").lost_after == 30.0
    assert LaunchConfig(1, cluster="slurm", node_lost_after=4).lost_after == 4.0
    monkeypatch.delenv("NBLAUNCH_NODE_LOST_AFTER")
    assert LaunchConfig(1, cluster="slurm").lost_after == 10.0
