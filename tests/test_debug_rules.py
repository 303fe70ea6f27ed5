"""The debugger's rules without processes: which rank the desk serves, what
a paused rank holds, and the post-mortem snapshot's round trip and bounds."""
from __future__ import annotations

import pickle
import resource
import sys
import threading
import time

import pytest
import torch

from nblaunch.watch import debug_desk, postmortem
from nblaunch.watch.debug_desk import DebugDesk
from nblaunch.errors import RankFailure
from nblaunch.rank import postmortem as rank_postmortem
from nblaunch.wire.channel import Answer, Paused, Prompt


class _Pool:
    def __init__(self):
        self.sent = []

    def send(self, rank, message):
        self.sent.append((rank, message))
        return True

    def host(self, rank):
        return "n2" if rank == 1 else None

    def global_rank(self, rank):
        return rank


class _View:
    def __init__(self):
        self.rows, self.notices = {}, []

    def rank_status(self, rank, status):
        self.rows[rank] = status

    def notice(self, text):
        self.notices.append(text)

    def tick(self, force=False):
        pass


def _desk(monkeypatch, answers):
    asked = []

    def ask(prompt):
        asked.append(prompt)
        return answers.pop(0)
    monkeypatch.setattr(debug_desk, "can_answer", lambda: ask)
    pool, view = _Pool(), _View()
    return DebugDesk(pool, view, lambda: [0, 1, 2]), pool, view, asked


def test_one_rank_is_served_until_it_runs_on(monkeypatch, capsys):
    desk, pool, view, asked = _desk(monkeypatch, ["p x", "n", "c", "c"])
    desk.on_event(2, Paused(2, True))
    desk.on_event(2, Prompt(2, "> cell(3)\n", "(Pdb) "))
    desk.on_event(1, Paused(1, True))
    desk.on_event(1, Prompt(1, "", "(Pdb) "))
    assert view.rows == {2: "paused: in the debugger", 1: "paused: in the debugger",
                         0: "waiting: rank 2 is in the debugger"}
    desk.serve()
    assert asked == ["rank 2 (Pdb) "] and pool.sent == [(2, Answer("p x"))]
    desk.serve()  # rank 2 was just answered: it may prompt again (n, s), rank 1 waits
    assert len(asked) == 1
    desk.on_event(2, Prompt(2, "42\n", "(Pdb) "))
    desk.serve()
    desk.on_event(2, Prompt(2, "", "(Pdb) "))
    desk.serve()
    assert asked == ["rank 2 (Pdb) "] * 3
    desk.on_event(2, Paused(2, False))  # c
    desk.serve()
    assert asked[-1] == "rank 1 on n2 (Pdb) "
    out = capsys.readouterr().out
    assert "--- rank 2 is in the debugger (the other ranks wait); rank 1 on n2 will be next ---" in out
    assert "--- rank 1 on n2 is in the debugger" in out


def test_a_rank_that_steps_into_a_collective_hands_the_desk_on(monkeypatch):
    desk, pool, view, asked = _desk(monkeypatch, ["n", "c"])
    for r in (0, 1):
        desk.on_event(r, Paused(r, True))
        desk.on_event(r, Prompt(r, "", "(Pdb) "))
    desk.serve()
    desk.serve()
    assert len(asked) == 1  # rank 0 may prompt again at once
    time.sleep(debug_desk.SWITCH_S + 0.1)  # it did not: it waits for rank 1 in a collective
    desk.serve()
    assert asked == ["rank 0 (Pdb) ", "rank 1 on n2 (Pdb) "]


def test_time_paused_is_held_and_rows_come_back(monkeypatch):
    desk, pool, view, asked = _desk(monkeypatch, [])
    assert desk.held() == 0.0
    desk.on_event(1, Paused(1, True))
    time.sleep(0.2)
    desk.on_event(1, Paused(1, False))
    held = desk.held()
    assert 0.2 <= held < 1.0
    time.sleep(0.1)
    assert desk.held() == held
    assert set(view.rows.values()) == {"running"}
    desk.on_event(0, Paused(0, True))
    desk.gone(0)  # it failed while paused
    assert not desk.paused


def test_no_front_end_answers_none_and_says_so_once(monkeypatch):
    monkeypatch.setattr(debug_desk, "can_answer", lambda: None)
    pool, view = _Pool(), _View()
    desk = DebugDesk(pool, view, lambda: [0, 1])
    for r in (0, 1):
        desk.on_event(r, Prompt(r, "", "(Pdb) "))
    desk.serve()
    time.sleep(debug_desk.SWITCH_S + 0.1)
    desk.serve()
    assert pool.sent == [(0, Answer(None)), (1, Answer(None))]
    assert len(view.notices) == 1 and "no one can answer a debugger here" in view.notices[0]


def test_a_script_without_a_terminal_never_reads_stdin(monkeypatch):
    class Pipe:
        def isatty(self):
            return False
    monkeypatch.setattr(sys, "stdin", Pipe())
    assert debug_desk.can_answer() is None


class Batch:
    def __init__(self, n):
        self.n = n


def _fail_inside():
    def inner(v):
        batch, small, big = Batch(v), torch.arange(3), torch.zeros(1 << 20)
        unpicklable = threading.Lock()  # a local that cannot travel
        raise ValueError(v)

    def outer():
        secret = 41
        inner(secret * 2)
    try:
        outer()
    except ValueError as exc:
        return exc


def test_a_snapshot_becomes_real_frames_inside_an_except_block_too():
    """Made where an exception is being handled (a live call's failure is
    noted in an ``except`` block): the frames came from re-raising that
    exception, and linking them failed with "traceback loop detected"."""
    failure = RankFailure(1, "exception", 0.0, frames=rank_postmortem.snapshot(_fail_inside()))
    try:
        raise KeyError("being handled")
    except KeyError:
        tb = postmortem.rank_traceback(failure)
    names = []
    while tb is not None:
        names.append(tb.tb_frame.f_code.co_name)
        tb = tb.tb_next
    assert names[-2:] == ["outer", "inner"], names


def test_a_snapshot_becomes_real_frames_with_the_ranks_locals():
    exc = _fail_inside()
    frames = rank_postmortem.snapshot(exc)
    assert len(frames) < rank_postmortem.TOTAL_BYTES
    failure = RankFailure(1, "exception", 0.0, frames=frames)
    tb = postmortem.rank_traceback(failure)
    stack = []
    while tb is not None:
        stack.append(tb)
        tb = tb.tb_next
    names = [t.tb_frame.f_code.co_name for t in stack]
    assert names[-2:] == ["outer", "inner"]
    inner, outer = stack[-1].tb_frame, stack[-2].tb_frame
    assert outer.f_locals["secret"] == 41 and inner.f_locals["v"] == 82
    assert inner.f_locals["batch"].n == 82 and inner.f_locals["small"].tolist() == [0, 1, 2]
    assert stack[-1].tb_lineno == inner.f_lineno and inner.f_code.co_filename == __file__
    big = inner.f_locals["big"]
    assert isinstance(big, rank_postmortem.Unshown) and "4,194,304 bytes" in big.why and repr(big).startswith("tensor(")
    assert isinstance(inner.f_locals["unpicklable"], rank_postmortem.Unshown)
    exc.__traceback__.tb_frame.f_locals  # the snapshot did not consume the real traceback


def test_the_snapshot_stays_within_its_budget(monkeypatch):
    monkeypatch.setattr(rank_postmortem, "TOTAL_BYTES", 300_000)

    def many():
        blobs = [bytes(200_000) for _ in range(1)]
        a, b, c = bytes(200_000), bytes(200_000), bytes(200_000)
        raise RuntimeError("x")
    try:
        many()
    except RuntimeError as exc:
        frames = rank_postmortem.snapshot(exc)
    records = pickle.loads(frames)
    shown = [v for r in records for v in r.values.values() if isinstance(v, rank_postmortem.Unshown)]
    assert len(frames) < 400_000 and len(shown) >= 2


def test_debug_says_what_there_is_to_debug():
    with pytest.raises(ValueError, match="no WorkerError to debug"):
        postmortem.debug(KeyError("x"))


def test_a_large_tensor_inside_a_local_is_refused_before_it_is_copied():
    def fails():
        optimizer_state = {"exp_avg": torch.zeros(50_000_000), "step": 3}  # 200 MB, as an optimizer holds
        raise RuntimeError("x")
    try:
        fails()
    except RuntimeError as exc:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        frames = rank_postmortem.snapshot(exc)
        grew = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak) / 1024  # MiB
    state = pickle.loads(frames)[-1].values["optimizer_state"]
    assert isinstance(state, rank_postmortem.Unshown) and "over" in state.why
    assert grew < 100, f"the snapshot's peak memory grew {grew:.0f} MiB: the tensor was copied before it was refused"
