"""The rank-side progress reporter, without a process (a thread and a fake
sender stand in for the rank and its pipe to the kernel)."""
from __future__ import annotations

import importlib
import queue
import sys
import types

import pytest

from nblaunch.wire.channel import Progress

progress = importlib.import_module("nblaunch.rank.progress")


class FakeSender:
    """Collects what the reporter sends; once closed it fails as a broken
    pipe does, which ends the reporter's thread."""

    def __init__(self):
        self.events: queue.Queue = queue.Queue()
        self.closed = False

    def send(self, event) -> None:
        if self.closed:
            raise BrokenPipeError
        self.events.put(event)


class Bar:
    def __init__(self):
        self.n = 0

    def state(self):
        return "batch", self.n, 10, False, "", None


def _progress_with(sender: FakeSender, n: int, timeout: float = 30.0) -> Progress:
    while True:
        event = sender.events.get(timeout=timeout)
        if isinstance(event, Progress) and event.n == n:
            return event


@pytest.fixture
def sender():
    s = FakeSender()
    yield s
    s.closed = True


def test_rows_keep_moving_while_torch_is_half_imported(sender, monkeypatch):
    """A spawned rank imports torch in its main thread while the reporter's
    first GPU reading comes due: the half-initialised module has no ``cuda``
    yet. The reporter used to die on that, silently, and the rank's row
    never moved again (issue 23)."""
    monkeypatch.setattr(progress, "GPU_EVERY_S", 0.0)
    monkeypatch.setattr(progress, "_torch_ready", False, raising=False)
    monkeypatch.setitem(sys.modules, "torch", types.ModuleType("torch"))  # as sys.modules holds it mid-import
    reporter = progress.Reporter(sender, rank=0)
    bar = Bar()
    reporter.add(bar)
    _progress_with(sender, 0)
    for n in (3, 7):  # several GPU readings came due in between
        bar.n = n
        _progress_with(sender, n)


def test_a_failing_read_does_not_stop_the_rows(sender, capfd):
    class Flaky(Bar):
        calls = 0

        def state(self):
            Flaky.calls += 1
            if Flaky.calls == 1:
                raise RuntimeError("read while the bar was being rebuilt")
            return super().state()

    reporter = progress.Reporter(sender, rank=0)
    bar = Flaky()
    reporter.add(bar)
    bar.n = 4
    _progress_with(sender, 4)
    assert "progress report failed once" in capfd.readouterr().err


@pytest.fixture
def thread_starts(monkeypatch):
    """The reporter's thread starts, recorded instead of made."""
    started: list = []
    monkeypatch.setattr(progress, "start_thread", lambda target, name: started.append(name))
    return started


def test_a_rank_with_nothing_to_report_has_no_reporter_thread(sender, thread_starts, monkeypatch):
    monkeypatch.setattr(progress, "_reporter", None)
    progress.begin_rank(sender, 0)
    progress.new_call(0)
    progress.finish_call()
    assert thread_starts == []


@pytest.mark.parametrize("first", ["a bar", "a metric", "a second bar"])
def test_the_reporter_thread_starts_once_with_the_first_thing_to_send(sender, thread_starts, monkeypatch, first):
    monkeypatch.setattr(progress, "_reporter", None)
    progress.begin_rank(sender, 0)
    if first == "a metric":
        progress.log(loss=1.0)
        progress.log(loss=0.5)
    else:
        progress.progress(total=3)
        if first == "a second bar":
            progress.progress(total=5)
    assert thread_starts == ["nblaunch-progress"]


def test_the_reporter_thread_starts_once_the_rank_uses_its_gpu(sender, thread_starts, monkeypatch):
    """Its GPU memory is shown whether or not the rank reports (torch.cuda faked: no GPU here)."""
    cuda = types.SimpleNamespace(is_initialized=lambda: False)
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))
    monkeypatch.setattr(progress, "_torch_ready", True)
    monkeypatch.setattr(progress, "_reporter", None)
    progress.begin_rank(sender, 0)
    progress.start_if_gpu()
    assert thread_starts == []
    cuda.is_initialized = lambda: True
    progress.start_if_gpu()
    progress.start_if_gpu()
    assert thread_starts == ["nblaunch-progress"]
