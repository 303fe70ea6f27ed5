"""The kernel is left as found, nothing listens beyond loopback, and no input
breaks the launcher (property-based)."""
from __future__ import annotations

import functools
import ipaddress
import multiprocessing
import os
import re
import signal
import sys
import tempfile
import time

import psutil
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from conftest import matrix
import nblaunch
from nblaunch import LaunchError, LaunchTimeout, WorkerError, notebook_launcher


def _kernel_state():
    return {
        "environ": dict(os.environ),
        "sys.path": list(sys.path),
        "signals": {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD,
                                                      signal.SIGUSR1, signal.SIGPIPE)},
        "start method": multiprocessing.get_start_method(allow_none=True),
        "threads": (torch.get_num_threads(), torch.get_num_interop_threads()),
        "shm": {name for name in os.listdir("/dev/shm") if not _another_process(name)},
    }


def _another_process(segment: str) -> bool:
    """A torch segment (``torch_<pid>_...``) made by a live process that is
    not this one or one of its own: the other pytest worker's, never this
    launch's (its ranks are gone by the time the state is read again, so a
    segment one of them left is still counted)."""
    found = re.match(r"torch_(\d+)_", segment)
    if found is None:
        return False
    pid = int(found.group(1))
    ours = {os.getpid()} | {p.pid for p in psutil.Process().children(recursive=True)}
    return pid not in ours and psutil.pid_exists(pid)


def ok():
    return 1


def boom():
    raise RuntimeError("boom")


def nap():
    time.sleep(60)


@pytest.mark.parametrize("fn,expect", [(ok, None), (boom, WorkerError), (nap, LaunchTimeout)],
                         ids=["success", "failure", "timeout"])
@pytest.mark.parametrize("method", ["fork", "forkserver"])
def test_the_kernel_is_left_as_found(fn, expect, method):
    before = _kernel_state()
    if expect is None:
        assert notebook_launcher(fn, num_processes=2, start_method=method) == [1, 1]
    else:
        with pytest.raises(expect):  # 3 s only where the timeout is the case: a loaded machine's forkserver takes longer to start
            notebook_launcher(fn, num_processes=2, start_method=method, timeout=3 if expect is LaunchTimeout else 120)
    assert _kernel_state() == before


def listening_and_wait():
    import time as _time

    print("listening", flush=True)
    _time.sleep(2)
    return os.getpid()


def test_nothing_listens_beyond_loopback_during_a_launch():
    import threading

    seen = []
    done = threading.Event()

    def sample():
        me = psutil.Process()
        while not done.is_set():
            for proc in [me, *me.children(recursive=True)]:
                try:
                    conns = proc.net_connections(kind="inet")
                except psutil.Error:
                    continue
                seen.extend((proc.pid, c.laddr) for c in conns if c.status == psutil.CONN_LISTEN)
            time.sleep(0.05)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        pids = notebook_launcher(listening_and_wait, num_processes=2)
    finally:
        done.set()
        sampler.join()
    rank_listeners = [addr for pid, addr in seen if pid in pids]
    assert rank_listeners, "expected gloo to listen while the ranks ran"
    assert any(pid == os.getpid() for pid, _ in seen), "expected the kernel's store to listen"
    for pid, addr in seen:
        assert ipaddress.ip_address(addr.ip).is_loopback, f"pid {pid} listens on {addr}"


# --- any input: a clear TypeError/ValueError before any process, or a correct run ---


class Model:
    def __init__(self):
        self.k = 2

    def method(self, x=0):
        return self.k + x


async def coroutine_fn():
    return 1


FNS = st.sampled_from([
    ok, lambda: 1, lambda x=0: x, Model, Model().method, functools.partial(Model().method, 1),
    coroutine_fn, functools.partial(coroutine_fn), len, print, 42, None, "ok",
])
NUMS = st.one_of(st.integers(min_value=-5, max_value=2), st.integers(min_value=257, max_value=10**9),
                 st.sampled_from([10**6, 2.0, True, None, "2", [2]]))
ARGS = st.one_of(st.just(()), st.tuples(st.integers()), st.lists(st.integers(), max_size=2),
                 st.sampled_from([5, "ab", None, {"a": 1}, b"x"]), st.builds(lambda: (x for x in [1])))
TIMEOUTS = st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True),
                     st.sampled_from([-1, 0, 30, "5", True]))
METHODS = st.one_of(st.sampled_from(["auto", "fork", "forkserver"]), st.text(max_size=8))
BACKENDS = st.one_of(st.sampled_from(["auto", "gloo"]), st.text(max_size=8))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fn=FNS, n=NUMS, args=ARGS, timeout=TIMEOUTS, method=METHODS, backend=BACKENDS)
@example(fn=ok, n=1, args=(), timeout=1.09e11, method="auto", backend="auto")  # overflowed torch's deadlines
def test_any_input_gives_a_clear_error_or_a_correct_run(fn, n, args, timeout, method, backend):
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    start = time.monotonic()
    try:
        out = notebook_launcher(fn, args=args, num_processes=n, timeout=timeout,
                                start_method=method, backend=backend)
    except (TypeError, ValueError) as exc:
        assert time.monotonic() - start < 1.0
        assert str(exc)  # says what was given and what is allowed
        assert {p.pid for p in psutil.Process().children(recursive=True)} <= before
        return
    except WorkerError as exc:
        # The arguments were valid, fn itself failed in the ranks (e.g. len()).
        assert exc.failures
        return
    except LaunchTimeout as exc:
        # A valid timeout shorter than a launch takes here (0.0625 s drawn,
        # on a loaded machine): the documented outcome, saying which timeout.
        assert 0 < timeout < 5 and f"within {timeout:g} s" in str(exc)
        return
    assert isinstance(out, list) and len(out) == n


def big_result(n):
    return b"x" * n


def test_a_result_over_the_limit_fails_that_rank_clearly(monkeypatch):
    monkeypatch.setenv("NBLAUNCH_MAX_RESULT_BYTES", "1000000")  # inherited by the ranks
    assert notebook_launcher(big_result, args=(1000,), num_processes=2) == [b"x" * 1000] * 2
    with pytest.raises(WorkerError) as info:
        notebook_launcher(big_result, args=(2_000_000,), num_processes=2)
    assert "over the 1,000,000-byte limit (NBLAUNCH_MAX_RESULT_BYTES)" in str(info.value)
    assert info.value.rank in (0, 1)


def tensor_result(mb):
    import torch
    import torch.distributed as dist

    torch.manual_seed(dist.get_rank())
    return {"rank": dist.get_rank(), "w": torch.randn(mb << 18)}  # mb MiB of float32


@pytest.mark.parametrize("method", ["fork", "forkserver", *matrix("spawn")])
def test_tensors_in_results_arrive_whole_through_shared_memory(method):
    import torch

    shm_before = set(os.listdir("/dev/shm"))
    out = notebook_launcher(tensor_result, args=(16,), num_processes=2, start_method=method, display="none")
    for rank, got in enumerate(out):
        torch.manual_seed(rank)
        assert got["rank"] == rank and torch.equal(got["w"], torch.randn(16 << 18))
    assert out[0]["w"].untyped_storage().is_shared()  # not unpickled from bytes
    out[0]["w"] += 1  # usable (and writable) after the ranks are gone
    assert set(os.listdir("/dev/shm")) <= shm_before  # fd-backed: nothing named is left behind


def test_the_result_limit_is_for_all_ranks_together(monkeypatch):
    monkeypatch.setenv("NBLAUNCH_MAX_RESULT_BYTES", str(6 << 20))  # read at launch time, as the ranks do
    notebook_launcher(tensor_result, args=(2,), num_processes=2, display="none")  # 2 x 2 MiB: fine
    with pytest.raises(WorkerError) as info:
        notebook_launcher(tensor_result, args=(4,), num_processes=2, display="none")
    assert "for all ranks together (NBLAUNCH_MAX_RESULT_BYTES)" in str(info.value)


class _Mark:
    """A pickle whose loading would leave a file behind."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def wait_a_little():
    time.sleep(1.5)
    return "done"


ATTACKER = """
import socket, sys, ast
payload = bytes.fromhex(sys.argv[1])
for host, port in ast.literal_eval(sys.argv[2]):
    try:
        with socket.create_connection((host, port), timeout=0.5) as s:
            s.sendall(payload)
            print(port)
    except OSError:
        pass
"""


def test_a_foreign_process_cannot_get_a_pickle_unpickled(tmp_path):
    import pickle
    import subprocess
    import threading

    mark = tmp_path / "unpickled"
    payload = pickle.dumps(_Mark(str(mark)))
    sent = []

    def attack():
        # Everything this process and its ranks listen on during the launch.
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline and not sent:
            me = psutil.Process()
            for proc in [me, *me.children(recursive=True)]:
                try:
                    conns = proc.net_connections(kind="inet")
                except psutil.Error:
                    continue
                targets = [(c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN]
                if targets:
                    # Sent by a separate process, as another user's program would.
                    out = subprocess.run([sys.executable, "-c", ATTACKER, payload.hex(), repr(targets)],
                                         capture_output=True, text=True, timeout=30)
                    sent.extend(int(p) for p in out.stdout.split())
            time.sleep(0.05)

    attacker = threading.Thread(target=attack)
    attacker.start()
    try:
        assert notebook_launcher(wait_a_little, num_processes=2) == ["done", "done"]
    finally:
        attacker.join()
    assert sent, "expected listening sockets to try"
    assert not mark.exists(), "a foreign pickle was unpickled"


def test_an_unwritable_log_folder_means_a_temporary_one_and_a_notice(tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("NBLAUNCH_LOG_DIR", str(blocker / "logs"))  # mkdir fails, even as root
    for _ in range(2):  # and so does every next launch, were it not handled
        out = notebook_launcher(wait_a_little_less, num_processes=1, display="text")
        assert out == ["done"]
        assert out.log_dir.startswith(tempfile.gettempdir()) and os.path.exists(out.log_files[0])
    printed = capsys.readouterr().out
    assert printed.count(f"[nblaunch] cannot write logs under {blocker / 'logs'}") == 2


def test_pruning_never_removes_a_folder_in_use(tmp_path, monkeypatch):
    from nblaunch.engines import logs

    monkeypatch.setenv("NBLAUNCH_LOG_DIR", str(tmp_path))
    first, _ = logs.new_launch_dir()
    later = [logs.new_launch_dir()[0] for _ in range(logs.KEEP + 5)]
    assert first.exists()  # the oldest, but still running
    for path in later:
        logs.release_launch_dir(path)
    logs.release_launch_dir(first)
    logs.new_launch_dir()
    assert not first.exists() and len(list(tmp_path.iterdir())) == logs.KEEP


def wait_a_little_less():
    time.sleep(0.2)
    return "done"


def test_a_second_launch_at_the_same_time_is_refused_at_once():
    import threading

    started = threading.Event()
    box = {}

    def first():
        started.set()
        box["first"] = notebook_launcher(wait_a_little, num_processes=2, display="none")

    from nblaunch import registry

    thread = threading.Thread(target=first)
    thread.start()
    started.wait()
    deadline = time.monotonic() + 60
    while not registry.foreground.locked() and time.monotonic() < deadline:  # the first one is under way
        time.sleep(0.01)
    t = time.monotonic()
    with pytest.raises(LaunchError, match="another launch is running in this kernel"):
        notebook_launcher(wait_a_little, num_processes=2, display="none")
    assert time.monotonic() - t < 1.0
    thread.join(60)
    assert box["first"] == ["done", "done"]
    assert notebook_launcher(wait_a_little_less, num_processes=1, display="none") == ["done"]  # free again


def test_the_stop_button_at_any_line_of_taking_the_launch_slot_leaves_it_free():
    """A press just after a lock was taken, before the with block held it,
    kept the kernel's one launch slot for good: every later launch was
    refused as "another launch is running" (found by pressing at each line
    of a launch in turn: tests/press_scan.py)."""
    from nblaunch.session import one_at_a_time
    from press_scan import PressAtLine

    n = interrupted = 0
    while True:
        n += 1
        with PressAtLine(n) as press:
            try:
                with one_at_a_time():
                    pass
            except KeyboardInterrupt:
                interrupted += 1
        if not press.pressed:
            break
        with one_at_a_time():  # free again (LaunchError if not)
            pass
    assert interrupted == n - 1 > 1  # each line of taking the slot was pressed at, and each press landed


class _RanksWouldStart(Exception):
    pass


@pytest.mark.parametrize("make", ["launch", "live"])
def test_the_stop_button_anywhere_before_the_ranks_start_leaves_no_launch_in_flight(make, monkeypatch, tmp_path):
    """Pressed at each line of a launch up to the start of its ranks (stopped
    there: no process made): each press leaves no launch counted in flight (a
    press as the session handed its engine back left one, and every later
    launch of the kernel started from the forkserver), the slot free, and no
    file open (a press while the zygote's pipes were made leaked them)."""
    from nblaunch.engines import logs
    from nblaunch import registry
    from nblaunch.engines.local_pool import LocalPool
    from press_scan import PressAtLine

    reached: list = []  # per launch: the ranks' start came before the press

    def start(self, tick=None):
        reached.append(not press.pressed)
        raise _RanksWouldStart

    monkeypatch.setattr(LocalPool, "start", start)
    if make == "launch":
        launch = lambda: notebook_launcher(wait_a_little, num_processes=2, display="none")  # noqa: E731
    else:
        launch = lambda: nblaunch.start(num_processes=2, display="none")  # noqa: E731
    monkeypatch.setenv("NBLAUNCH_LOG_DIR", str(tmp_path))
    monkeypatch.setattr(logs, "_prune", lambda root: None)  # as many lines each time, whatever is on disk
    with pytest.raises(_RanksWouldStart):  # warm: what the process keeps open from its first launch
        with PressAtLine(10**9) as press:
            launch()
    reached.clear()
    before = set(os.listdir("/proc/self/fd"))
    n = interrupted = 0
    while not any(reached):
        n += 1
        with PressAtLine(n) as press:
            try:
                launch()
            except KeyboardInterrupt:
                interrupted += 1
            except _RanksWouldStart:
                pass
        assert (registry.in_flight(), registry.foreground.locked()) == (0, False), (n, press.where)
        assert set(os.listdir("/proc/self/fd")) <= before, (n, press.where)
    assert interrupted >= n - 1 > 100  # a press at every line before the ranks' start, and each landed


@pytest.mark.parametrize("setting,env,error", [
    ({"master_addr": "256.1.1.1"}, {}, "master_addr '256.1.1.1' is not an address"),
    ({}, {"NBLAUNCH_MAX_RESULT_BYTES": "2GB"}, "NBLAUNCH_MAX_RESULT_BYTES must be a whole number"),
])
def test_settings_are_checked_before_any_rank_starts(monkeypatch, setting, env, error):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(ValueError, match=error):
        notebook_launcher(wait_a_little, num_processes=2, display="none", **setting)
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before
