"""Shared fixtures: real Jupyter kernels, and a guard that no test leaves a process behind."""
from __future__ import annotations

import html
import os
import queue
import re
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field

import psutil
import pytest
from jupyter_client.manager import KernelManager

START_METHODS = ["fork", "forkserver", "spawn"]


def matrix(*values) -> list:
    """Parameters that repeat a test under another start method (or moment,
    or theme) where what it checks does not depend on it: marked ``matrix``, left out
    of the README's ten-minute command and run by CI's own step
    (``pytest -m matrix``). A tuple is one parameter set."""
    return [pytest.param(*(v if isinstance(v, tuple) else (v,)), marks=pytest.mark.matrix) for v in values]


def _descendants() -> dict[int, psutil.Process]:
    me = psutil.Process()
    return {p.pid: p for p in me.children(recursive=True) if _is_ours(p)}


def _is_ours(p: psutil.Process) -> bool:
    try:
        # multiprocessing's forkserver and resource tracker live as long as
        # the test process, by design; they are not rank processes.
        cmd = " ".join(p.cmdline())
        return not ("forkserver" in cmd or "resource_tracker" in cmd) and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def cmdline(p: psutil.Process) -> str:
    """``p``'s command line; "" once it has ended (a zombie not yet reaped,
    such as a zygote whose ranks have all left, counts as ended)."""
    try:
        return " ".join(p.cmdline())
    except psutil.Error:
        return ""


def launch_processes(pid: int) -> list[int]:
    """What launches made under process ``pid``, less multiprocessing's
    forkserver and resource tracker (they live as long as ``pid``, by design)."""
    return [p.pid for p in psutil.Process(pid).children(recursive=True)
            if "forkserver" not in cmdline(p) and "resource_tracker" not in cmdline(p)]


def wait_for_file(path: str, limit: float = 120.0) -> None:
    """Until ``path`` exists (a rank's or a run's sign); ``TimeoutError`` after ``limit`` s."""
    deadline = time.monotonic() + limit
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(path)
        time.sleep(0.02)


def wait_for_pid(path: str, limit: float = 120.0) -> int:
    """The pid a rank wrote to ``path``, once written whole (a file is seen as soon as it is
    created, before what is written to it: seen empty once under load)."""
    deadline = time.monotonic() + limit
    wait_for_file(path, limit)
    while True:
        with open(path) as f:
            text = f.read().strip()
        if text.isdigit():
            return int(text)
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} holds {text!r}, not a pid")
        time.sleep(0.02)


def wait_gone(pids, timeout: float = 10.0) -> list[int]:
    """Wait until none of ``pids`` runs; return the ones still running."""
    deadline = time.monotonic() + timeout
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [pid for pid in alive if _running(pid)]
        if alive:
            time.sleep(0.05)
    return alive


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.fixture(autouse=True)
def no_process_left():
    before = set(_descendants())
    yield
    leftover = [pid for pid in _descendants() if pid not in before]
    still = wait_gone(leftover, timeout=10)
    for pid in still:
        try:
            psutil.Process(pid).kill()
        except psutil.Error:
            pass
    assert not still, f"processes left behind: {still}"


@dataclass
class CellResult:
    stdout: str = ""
    stderr: str = ""
    error: dict | None = None
    outputs: list = field(default_factory=list)

    @property
    def text(self) -> str:
        return self.stdout + self.stderr


class _PrefixedKernelManager(KernelManager):
    """Starts the kernel behind a command prefix (``ip netns exec NAME``)."""

    prefix: list = []

    def format_kernel_cmd(self, extra_arguments=None):
        return list(self.prefix) + super().format_kernel_cmd(extra_arguments)


class Kernel:
    """A real IPython kernel (the environment's own Python) and a client."""

    def __init__(self, extra_env: dict | None = None, console: str | None = None, netns: str | None = None):
        """``console``: a file that gets the kernel process's own stdout and
        stderr (what a Jupyter server would log). ``netns``: run the kernel in
        that network namespace, talking to this client over Unix sockets
        (a namespace has its own loopback)."""
        env = dict(os.environ)
        env.pop("PYTEST_CURRENT_TEST", None)
        env.update(extra_env or {})
        # Unix sockets, not TCP: jupyter_client picks five free ports and lets
        # them go before the kernel binds them, and three test processes (and
        # their ranks' rendezvous ports) starting kernels at once took one
        # (CI: "Kernel died before replying to kernel_info").
        self._ipc_dir = tempfile.mkdtemp(prefix="nblaunch-ipc-")
        ipc = dict(kernel_name="python3", transport="ipc", ip=os.path.join(self._ipc_dir, "kernel"))
        if netns is None:
            self.km = KernelManager(**ipc)
        else:
            self.km = _PrefixedKernelManager(**ipc)
            self.km.prefix = ["ip", "netns", "exec", netns]
        if console is None:  # kept, so that a test that times out can show where the kernel was
            fd, console = tempfile.mkstemp(prefix="nblaunch-kernel-console-", suffix=".log")
            os.close(fd)
            self._own_console = console
        self.console_path = console
        self._console = open(console, "wb")
        # History in memory: the kernels of parallel tests shared one sqlite
        # file in ~/.ipython, whose journal IPython's history thread opens and
        # closes at times of its own (a leak check counted it as the launch's).
        self.km.start_kernel(env=env, stdout=self._console, stderr=subprocess.STDOUT,
                             extra_arguments=["--HistoryManager.hist_file=:memory:"])
        self.kc = self.km.client()
        self.kc.start_channels()
        try:
            self.kc.wait_for_ready(timeout=60)
        except RuntimeError as exc:
            self._console.flush()
            with open(console, errors="replace") as f:
                raise RuntimeError(f"{exc}; the kernel's console:\n{f.read()[-5000:]}") from exc
        # SIGUSR1 -> every thread's stack on the kernel's console (see _where_it_hangs).
        self.kc.execute_interactive("import faulthandler as _fh, signal as _sig, sys as _sys\n"
                                    "_fh.register(_sig.SIGUSR1, file=_sys.__stderr__, all_threads=True)",
                                    silent=True, timeout=60)

    def _where_it_hangs(self) -> str:
        """The kernel's threads' stacks and its processes, for a cell that timed out."""
        try:
            os.kill(self.pid, signal.SIGUSR1)
            time.sleep(1.0)
            self._console.flush()
            with open(self.console_path, errors="replace") as f:
                console = _main_thread_first(f.read()[-20000:])
        except OSError as exc:
            console = f"(no console: {exc})"
        try:
            procs = [f"{p.pid} {p.status()} {' '.join(p.cmdline())[:150]}"
                     for p in psutil.Process(self.pid).children(recursive=True)]
        except psutil.Error as exc:
            procs = [f"(no process list: {exc})"]
        return "kernel console (stacks after SIGUSR1):\n" + console + "\nkernel's processes:\n" + "\n".join(procs)

    @property
    def pid(self) -> int:
        return self.km.provisioner.pid

    def execute(self, code: str, timeout: float = 120, on_output=None) -> CellResult:
        result = CellResult()

        def hook(msg):
            kind, content = msg["msg_type"], msg["content"]
            result.outputs.append(msg)
            if kind == "stream":
                setattr(result, content["name"], getattr(result, content["name"]) + content["text"])
                if on_output:
                    on_output(content["text"])
            elif kind == "error":
                result.error = content

        try:
            reply = self.kc.execute_interactive(code, output_hook=hook, timeout=timeout)
        except TimeoutError as exc:
            raise TimeoutError(f"{exc}\n{self._where_it_hangs()}") from None
        if reply["content"]["status"] == "error" and result.error is None:
            result.error = reply["content"]
        return result

    def execute_async(self, code: str) -> str:
        return self.kc.execute(code)

    def execute_started(self, code: str, timeout: float = 60) -> str:
        """``execute_async``, returning once the cell runs: ipykernel ignores
        SIGINT between cells, so a stop pressed before this is not the cell's
        (it hung a test that pressed stop 6 ms after sending the cell).
        Only the cell's "busy" status comes before it, and is dropped."""
        msg_id = self.kc.execute(code)
        for msg in self._iopub(timeout, "the cell did not start"):
            if msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "execute_input":
                return msg_id

    def _iopub(self, timeout: float, what: str):
        """iopub's messages as they come; after ``timeout`` s, ``TimeoutError``
        saying ``what`` did not happen, and where the kernel was."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                yield self.kc.get_iopub_msg(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"{what} within {timeout} s\n{self._where_it_hangs()}") from None

    def wait_for_output(self, needle: str, timeout: float = 60) -> str:
        """Read iopub until a stream message contains ``needle``."""
        seen = ""
        deadline = time.monotonic() + timeout
        while needle not in seen:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"{needle!r} not seen; got {seen[-2000:]!r}")
            try:
                msg = self.kc.get_iopub_msg(timeout=remaining)
            except queue.Empty:
                continue
            if msg["msg_type"] == "stream":
                seen += msg["content"]["text"]
        return seen

    def wait_for_reply(self, msg_id: str, timeout: float = 60) -> CellResult:
        """Collect iopub of ``msg_id`` until the kernel is idle again."""
        result = CellResult()
        for msg in self._iopub(timeout, "no reply"):
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                setattr(result, content["name"], getattr(result, content["name"]) + content["text"])
            elif kind == "error":
                result.error = content
            elif kind == "status" and content["execution_state"] == "idle":
                return result

    def shutdown(self):
        self.kc.stop_channels()
        if self.km.is_alive():
            self.km.shutdown_kernel(now=True)
        if getattr(self, "_console", None) is not None:
            self._console.close()
        if getattr(self, "_own_console", None) is not None:
            os.unlink(self._own_console)
        shutil.rmtree(self._ipc_dir, ignore_errors=True)


def _main_thread_first(console: str) -> str:
    """The console, led by its last dump's main thread (the cell's): a log
    cut to its head and tail (CI's) kept only that thread's tail."""
    end = console.rfind("_run_module_as_main")
    start = max(console.rfind("Thread 0x", 0, end), console.rfind("thread 0x", 0, end))
    if end < 0 or start < 0:
        return console
    return "the cell's thread, last seen:\n" + console[start:end] + "...\n\n" + console


@dataclass
class RowsUpdate:
    """One redraw of a launch view's rank rows, as the front end received it."""

    time: float  # the kernel's send time, seconds since the epoch
    rows: list  # per rank: (status, fraction, text)


_ROW = re.compile(r"class='nblaunch-rank' data-status='([^']+)' data-fraction='([\d.]+)'.*?"
                  r"<span class='nblaunch-text' style='[^']*'>(.*?)</span></div>", re.S)


def rows_updates(outputs: list) -> list[RowsUpdate]:
    """The rank-row redraws among a cell's iopub messages, in order."""
    updates = []
    for msg in outputs:
        if msg["msg_type"] != "comm_msg":
            continue
        value = msg["content"]["data"].get("state", {}).get("value", "")
        if isinstance(value, str) and "class='nblaunch-ranks'" in value:
            rows = [(status, float(frac), html.unescape(text).replace("\xa0", " "))
                    for status, frac, text in _ROW.findall(value)]
            updates.append(RowsUpdate(msg["header"]["date"].timestamp(), rows))
    return updates


def widget_html(outputs: list) -> list[str]:
    """Every HTML value the cell's widgets were given, and the view's static
    HTML (the final view, or the whole view of a launch too short to build
    widgets), in order."""
    values = []
    for msg in outputs:
        if msg["msg_type"] in ("comm_msg", "comm_open"):
            value = msg["content"]["data"].get("state", {}).get("value")
            if isinstance(value, str):
                values.append(value)
        elif msg["msg_type"] in ("display_data", "update_display_data"):
            value = msg["content"]["data"].get("text/html")
            if isinstance(value, str):
                values.append(value)
    return values


@pytest.fixture
def kernel():
    k = Kernel()
    try:
        yield k
    finally:
        k.shutdown()
