"""The core's rules without a process: a fake rank pool feeds a real
:class:`~nblaunch.watch.call.CallWatch` scripted events, and the tests check what
the user would see (the error, its root cause, the ranks stopped or kept).
Each runs in milliseconds; the same rules are checked with real ranks in
test_failures.py, test_session.py and test_real_code_traps.py."""
from __future__ import annotations

import pickle
import signal
import sys
import time
import weakref
from pathlib import Path
from typing import Optional

import pytest

from nblaunch.wire.channel import Failure, Progress, Result, Started, Stopping
from nblaunch.view import TextDisplay
from nblaunch.errors import LaunchTimeout, WorkerError
from nblaunch.engines.nodes import Placement
from nblaunch.engines.pool import Exited, Lines, Message, RankPool
from nblaunch.watch import rules
from nblaunch.watch.rules import Stalls
from nblaunch.watch import live as live_watch
from nblaunch.watch.live import LiveCallWatch
from nblaunch.watch.call import CallWatch
from nblaunch.watch.stop_button import StopButton

PEER_LOST = "RuntimeError", "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1234"


class FakePool(RankPool):
    """``script``: one list of pool events per poll (then nothing). A rank
    that is signalled SIGTERM/SIGKILL exits with that signal at the next
    poll, unless it is ``deaf`` to SIGTERM; an interrupted live rank answers
    with the given event (``answers``), or never."""

    def __init__(self, size: int, script=(), answers: Optional[dict] = None, deaf=(), waits_in=None,
                 keyboard_interrupt_at: Optional[int] = None, lost_interrupt_at: Optional[int] = None):
        self.size = size
        self.log_dir = Path("/tmp/nblaunch-fake")
        self.placement = None
        self._script = [list(batch) for batch in script]
        self._exited: set[int] = set()  # as the watch has been told
        self._dying: set[int] = set()  # signalled: its exit comes at the next poll
        self._queued: list = []
        self.signals: list[tuple[int, int]] = []
        self.interrupts: list[tuple[int, str]] = []
        self._answers = answers or {}
        self._deaf = set(deaf)
        self._waits_in = waits_in or {}
        self._kbi_at = keyboard_interrupt_at
        self._lost_at = lost_interrupt_at
        self.polls = 0
        self.stopped = False
        self.sent: list = []

    def start(self, tick=lambda: None) -> Placement:
        self.placement = Placement(0, 1, self.size, "127.0.0.1", 1)
        return self.placement

    def poll(self, timeout: float) -> list:
        self.polls += 1
        if self._kbi_at is not None and self.polls == self._kbi_at:
            raise KeyboardInterrupt
        if self._lost_at is not None and self.polls == self._lost_at:
            lose_an_interrupt()
        out, self._queued = self._queued, []
        if self._script:
            out += self._script.pop(0)
        for item in out:
            if isinstance(item, Exited):
                self._exited.add(item.rank)
        if not out:
            time.sleep(min(timeout, 0.002))
        return out

    def send(self, rank: int, message) -> bool:
        self.sent.append((rank, message))
        return rank not in self._exited

    def signal(self, sig: int, ranks: list[int]) -> None:
        for rank in ranks:
            if rank in self._exited or rank in self._dying:
                continue
            self.signals.append((rank, sig))
            if sig == signal.SIGKILL or rank not in self._deaf:
                self._dying.add(rank)
                self._queued.append(Exited(rank, -sig))

    def interrupt(self, rank: int, how: str) -> None:
        self.interrupts.append((rank, how))
        if rank in self._answers:
            self._queued.append(Message(rank, self._answers[rank]))

    def stacks(self, ranks=None) -> str:
        return "\n".join(f"  rank {r}: in fake_loop (cell.py:3)" for r in (range(self.size) if ranks is None else ranks))

    def collectives(self, ranks):
        return {r: self._waits_in.get(r) for r in ranks}

    def stop(self, grace: float, order=None) -> None:
        self.stopped = True
        self.signal(signal.SIGTERM, order or list(range(self.size)))
        self.signal(signal.SIGKILL, order or list(range(self.size)))

    def wait(self, timeout: float) -> bool:
        return True

    def drain(self) -> list:
        return []

    def _ask(self, what: str, ranks):
        return self.stacks(ranks) if what == "stacks" else self.collectives(ranks)

    def _release(self) -> None:
        pass

    def close(self) -> None:
        pass

    def global_rank(self, rank: int) -> int:
        return rank

    def node(self, rank: int):
        return None

    def exit_seen(self, rank: int) -> bool:
        return rank in self._exited

    def ended_now(self, rank: int) -> bool:
        return rank in self._exited or rank in self._dying

    def started(self, rank: int) -> bool:
        return True

    def running_pids(self) -> dict:
        return {}

    def tail(self, rank: int) -> tuple:
        return (f"last words of rank {rank}",)


def started(rank):
    return Message(rank, Started(rank, 1000 + rank, time.time()))


def result(rank, value, call=0, seq=-1):
    return Message(rank, Result(rank, pickle.dumps(value), call=call, seq=seq, time=time.time()))


def failure(rank, exc_type, message, call=0, when=None, seq=-1):
    tb = f'Traceback (most recent call last):\n  File "cell.py", line 3, in train\n{exc_type}: {message}\n'
    return Message(rank, Failure(rank, when or time.time(), exc_type, message, tb, None, "fn", call, seq))


def quiet_view(size=2):
    import io

    view = TextDisplay(stream=io.StringIO())
    view.begin(size, "fork", "gloo", "/tmp/nblaunch-fake")
    return view


LOST: list = []  # the interrupts raised where Python could only report them


def lose_an_interrupt() -> None:
    """A real SIGINT whose ``KeyboardInterrupt`` is raised in a weakref
    callback, which Python can only report (``sys.unraisablehook``): what a
    stop pressed while the garbage collector ran one did."""
    class Dropped:
        pass

    def dropped_now(_):
        try:
            signal.raise_signal(signal.SIGINT)
        except KeyboardInterrupt:
            LOST.append(KeyboardInterrupt)
            raise

    dropped = Dropped()
    ref = weakref.ref(dropped, dropped_now)  # noqa: F841 - alive till dropped is
    del dropped


@pytest.fixture
def stop_button(monkeypatch):
    """SIGINT as a cell's thread has it (a test worker may ignore it), and
    the interrupts Python could only report."""
    lost = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: lost.append(u.exc_type))
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield lost
    signal.signal(signal.SIGINT, previous)


def launch(pool, **kw):
    watch = CallWatch(pool, quiet_view(pool.size), 0, **kw)
    return watch, watch.run(pool.start)


# -- a launch ----------------------------------------------------------------------------

def test_results_come_back_in_rank_order():
    pool = FakePool(2, [[started(0), started(1)], [result(1, "b"), result(0, "a")], [Exited(0, 0), Exited(1, 0)]])
    _, results = launch(pool)
    assert results == ["a", "b"]
    assert pool.signals == []


def test_the_cause_is_named_even_when_its_consequence_arrives_first():
    t = time.time()
    pool = FakePool(2, [[started(0), started(1)],
                        [failure(1, *PEER_LOST, when=t + 0.01)],  # the peer's error comes in first ...
                        [Exited(0, -signal.SIGSEGV)]])           # ... its cause a poll later
    with pytest.raises(WorkerError) as info:
        launch(pool)
    err = info.value
    assert err.rank == 0 and err.root.kind == "signal" and "SIGSEGV" in str(err).splitlines()[0]
    assert "last words of rank 0" in str(err)
    assert [f.rank for f in err.failures] == [0, 1]


def test_a_failure_stops_the_others_and_they_are_not_blamed():
    pool = FakePool(3, [[started(0), started(1), started(2)], [failure(2, "ValueError", "bad batch")]])
    with pytest.raises(WorkerError) as info:
        launch(pool)
    err = info.value
    assert err.rank == 2 and "ValueError: bad batch" in str(err)
    assert {f.kind for f in err.failures[1:]} == {"stopped"}
    assert (0, signal.SIGTERM) in pool.signals and (1, signal.SIGTERM) in pool.signals
    # healthy ranks are stopped before the failed one, whose sockets would otherwise close under them
    assert [r for r, s in pool.signals if s == signal.SIGTERM][-1] == 2


def test_a_rank_deaf_to_sigterm_gets_sigkill_after_the_grace():
    pool = FakePool(2, [[started(0), started(1)], [failure(0, "ValueError", "x")]], deaf=[1])
    with pytest.raises(WorkerError):
        launch(pool)
    assert (1, signal.SIGTERM) in pool.signals and (1, signal.SIGKILL) in pool.signals


def test_a_launch_timeout_shows_every_rank_and_stops_them():
    pool = FakePool(2, [[started(0), started(1)]])
    t0 = time.monotonic()
    with pytest.raises(LaunchTimeout) as info:
        launch(pool, timeout=0.05)
    assert time.monotonic() - t0 < 2
    assert "did not finish within 0.05 s" in str(info.value) and "rank 1: in fake_loop" in str(info.value)
    assert pool.stopped


def test_the_stop_button_stops_a_launch_and_shows_where_ranks_were():
    pool = FakePool(2, [[started(0), started(1)]], keyboard_interrupt_at=3)
    with pytest.raises(KeyboardInterrupt) as info:
        launch(pool)
    shown = "\n".join(info.value._render_traceback_())
    assert "every rank was stopped" in shown and "rank 0: in fake_loop" in shown
    assert pool.stopped


def test_a_stop_python_lost_in_a_weakref_callback_still_stops_the_launch(stop_button):
    pool = FakePool(2, [[started(0), started(1)]], lost_interrupt_at=3)
    with pytest.raises(KeyboardInterrupt) as info:
        launch(pool)
    assert LOST == [KeyboardInterrupt]  # it was lost ...
    assert pool.polls == 3 and pool.stopped  # ... and raised again at the watch's next pass
    assert stop_button == []  # Python's report of it ("Exception ignored in ...") is not shown
    assert "every rank was stopped" in "\n".join(info.value._render_traceback_())
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_sigint_handler_that_raises_nothing_is_left_so(stop_button):
    noted = []
    signal.signal(signal.SIGINT, lambda signum, frame: noted.append(signum))
    with StopButton() as stop:
        signal.raise_signal(signal.SIGINT)
        stop.check()
    assert noted == [signal.SIGINT] and stop_button == []


def test_a_rank_that_returned_while_its_peer_waits_in_a_collective_is_the_failure(monkeypatch):
    monkeypatch.setattr(rules, "LEFT_GRACE_S", 0.02)
    pool = FakePool(2, [[started(0), started(1)], [result(0, None)]], waits_in={1: "all_reduce"})
    with pytest.raises(WorkerError) as info:
        launch(pool)
    err = info.value
    assert err.rank == 0 and err.root.kind == "left"
    assert "returned while rank 1 was in all_reduce" in str(err)


# -- live ranks --------------------------------------------------------------------------

def live_call(pool, call=1, **kw):
    pool.start()
    watch = LiveCallWatch(pool, quiet_view(), call, **kw)
    try:
        return watch, watch.run(lambda: None), None
    except BaseException as exc:  # noqa: BLE001 - the test looks at it
        return watch, None, exc


def test_a_live_failure_interrupts_the_others_and_keeps_the_ranks():
    interrupted = failure(1, "KeyboardInterrupt", "", call=1, seq=3)
    pool = FakePool(2, [[failure(0, "ValueError", "bad", call=1, seq=3)]], answers={1: interrupted.event})
    watch, _, exc = live_call(pool)
    assert isinstance(exc, WorkerError) and exc.rank == 0
    assert [f.kind for f in exc.failures] == ["exception", "interrupted"]
    assert pool.interrupts == [(1, "1")] and pool.signals == []
    assert watch.broken is None


def test_a_live_rank_that_does_not_answer_the_interrupt_breaks_the_ranks(monkeypatch):
    monkeypatch.setattr(live_watch, "INTERRUPT_GRACE_S", 0.05)
    pool = FakePool(2, [[failure(0, "ValueError", "bad", call=1)]])  # rank 1 never answers
    watch, _, exc = live_call(pool)
    assert isinstance(exc, WorkerError) and exc.rank == 0
    assert "rank 1 did not stop within" in watch.broken
    assert watch.broken.endswith("where it was:\n  rank 1: in fake_loop (cell.py:3)"), watch.broken
    assert (1, signal.SIGTERM) in pool.signals


def test_a_live_timeout_shows_the_stacks_and_keeps_ranks_that_answer():
    answers = {r: failure(r, "KeyboardInterrupt", "", call=1, seq=2).event for r in (0, 1)}
    pool = FakePool(2, [], answers=answers)
    watch, _, exc = live_call(pool, timeout=0.05)
    assert isinstance(exc, LaunchTimeout)
    assert "call 1 did not finish within 0.05 s" in str(exc) and "rank 0: in fake_loop" in str(exc)
    assert "keep their state" in str(exc) and watch.broken is None


def test_a_live_timeout_in_a_collective_gives_the_ranks_up(monkeypatch):
    monkeypatch.setattr(live_watch, "INTERRUPT_GRACE_S", 0.05)
    pool = FakePool(2, [])  # neither rank answers: both wait in a collective
    watch, _, exc = live_call(pool, timeout=0.05)
    assert isinstance(exc, LaunchTimeout) and "could not be kept" in str(exc)
    assert watch.broken and (0, signal.SIGTERM) in pool.signals


def test_live_ranks_out_of_step_are_given_up():
    pool = FakePool(2, [[result(0, 1, call=1, seq=4), result(1, 1, call=1, seq=3)]])
    watch, results, exc = live_call(pool)
    assert exc is None and results == [1, 1]
    assert "out of step (collectives issued: rank 0: 4, rank 1: 3)" in watch.broken


def test_the_stop_button_on_live_ranks_waits_for_the_agreed_step():
    answers = {r: Stopping(r, 7, call=1) for r in (0, 1)}
    done = [failure(r, "KeyboardInterrupt", "", call=1) for r in (0, 1)]
    pool = FakePool(2, [[], [], [], [], [], done], answers=answers, keyboard_interrupt_at=2)
    watch, _, exc = live_call(pool)
    assert isinstance(exc, KeyboardInterrupt)
    assert pool.interrupts == [(0, "1 at a step"), (1, "1 at a step")]
    assert "keep their state" in "\n".join(exc._render_traceback_()) and watch.broken is None


def test_events_of_another_call_are_ignored():
    pool = FakePool(2, [[result(0, "old", call=1), result(1, "old", call=1)],
                        [result(0, "new", call=2), result(1, "new", call=2)]])
    _, results, exc = live_call(pool, call=2)
    assert exc is None and results == ["new", "new"]


def test_a_live_rank_that_dies_in_a_call_breaks_the_ranks():
    pool = FakePool(2, [[Exited(1, -signal.SIGKILL)]],
                    answers={0: failure(0, "KeyboardInterrupt", "", call=1).event})
    watch, _, exc = live_call(pool)
    assert isinstance(exc, WorkerError) and exc.rank == 1 and exc.root.kind == "signal"
    assert "SIGKILL" in watch.broken


# -- stalls: a rule on times ------------------------------------------------------------------

def test_a_stall_is_named_once_and_only_while_others_move():
    stalls = Stalls(after_s=10)
    stalls.moved(0, "k", 5, 100, "train", now=0.0)
    stalls.moved(1, "k", 5, 100, "train", now=0.0)
    stalls.moved(0, "k", 50, 100, "train", now=12.0)
    notices = stalls.check(now=12.5, running={0, 1})
    assert notices == ["rank 1 has made no progress for 12 s (last at train 5/100) while ranks 0 moved on"]
    assert stalls.check(now=13.0, running={0, 1}) == []  # once
    assert stalls.check(now=30.0, running={0, 1}) == []  # nobody moves: not a stall of one rank
    assert Stalls(after_s=None).check(now=99.0, running={0, 1}) == []


def test_a_stopped_rank_is_named_as_stopped_for_as_long_as_it_was_seen_so():
    from nblaunch.system.resources import Usage

    stalls = Stalls(after_s=10)
    for rank in (0, 1, 2):
        stalls.moved(rank, "k", 5, 100, "train", now=0.0)
    stopped, running = Usage(0.0, 1, False, state="stopped (SIGSTOP)"), Usage(0.0, 1, False)
    stalls.sampled({1: stopped}, now=1.0)
    stalls.sampled({1: stopped, 2: running}, now=2.0)  # the same state: still since 1.0
    stalls.moved(0, "k", 50, 100, "train", now=12.0)
    assert stalls.check(now=13.0, running={0, 1, 2}) == [
        "rank 1 is stopped (SIGSTOP) for 12 s (last at train 5/100) while ranks 0 moved on",
        "rank 2 has made no progress for 13 s (last at train 5/100) while ranks 0 moved on"]


def test_a_stall_warning_reaches_the_view():
    p = [Message(0, Progress(0, 1, "epoch", n, 10, False, time.time())) for n in range(3)]
    pool = FakePool(2, [[started(0), started(1), Message(1, Progress(1, 1, "epoch", 0, 10, False, time.time()))]]
                    + [[item] for item in p] + [[]] * 30 + [[result(0, 0), result(1, 1)], [Exited(0, 0), Exited(1, 0)]])
    view = quiet_view()
    stalls_at = 0.05
    watch = CallWatch(pool, view, 0, stall_warning=stalls_at)
    orig = pool.poll

    def slow_poll(timeout):
        time.sleep(0.005)
        return orig(timeout)

    pool.poll = slow_poll
    assert watch.run(pool.start) == [0, 1]
    assert any(n.startswith("rank 1 has made no progress") and "ranks 0 moved on" in n for n in view.state.notices)


def test_lines_reach_the_view():
    pool = FakePool(2, [[started(0), started(1), Lines(0, ["hello"])], [result(0, 0), result(1, 1)],
                        [Exited(0, 0), Exited(1, 0)]])
    view = quiet_view()
    CallWatch(pool, view, 0).run(pool.start)
    assert "[rank 0] hello" in list(view.state.tail)


def test_a_plain_result_is_pickled_plainly_and_a_tensor_goes_through_shared_memory():
    import torch

    from nblaunch.rank.results import dump_result

    plain = {"loss": 0.25, "steps": [1, 2, 3], "name": "run", "done": None, "pair": (1j, b"x")}
    payload, shared = dump_result(0, plain)
    assert (payload, shared) == (pickle.dumps(plain, pickle.HIGHEST_PROTOCOL), 0)
    deep = [[0.0] * 100 for _ in range(200)]  # 20,000 floats: too big to check item by item
    payload, shared = dump_result(0, deep)
    assert pickle.loads(payload) == deep and shared == 0
    nested = []
    for _ in range(5000):  # plain, but deeper than pickle recurses: the general path names the rank
        nested = [nested]
    with pytest.raises(TypeError, match="the result of rank 0 .* cannot be pickled"):
        dump_result(0, nested)
    with_tensor = {"loss": 0.25, "weights": torch.ones(256)}
    payload, shared = dump_result(0, with_tensor)
    assert shared == 256 * 4
    back = pickle.loads(payload)
    assert back["loss"] == 0.25 and torch.equal(back["weights"], torch.ones(256))
