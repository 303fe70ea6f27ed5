"""Spawn and forkserver: notebook-defined code by value, the automatic choice,
shared tensors, and the same failure guarantees as fork, in real kernels."""
from __future__ import annotations

import os
import re
import signal
import time

import psutil
import pytest

from conftest import Kernel, matrix, wait_gone

pytestmark = pytest.mark.timeout(300)

NOTEBOOK_CODE = """
import dataclasses, math
from nblaunch import notebook_launcher
SCALE = 3                                   # a notebook global

@dataclasses.dataclass
class Point:                                # a dataclass defined in a cell
    x: int
    def norm(self):
        return math.hypot(self.x, self.x)   # an imported module

class Counter:                              # a plain class defined in a cell
    def __init__(self):
        self.n = 0
    def bump(self):
        self.n += SCALE
        return self.n

def make_adder(k):                          # a closure
    return lambda v: v + k

def job(point, add):
    import torch.distributed as dist
    rank = dist.get_rank()
    c = Counter()
    c.bump()
    print(f"rank {rank} sees SCALE={SCALE}")
    return [rank, c.n, round(point.norm(), 3), add(rank), type(point).__name__]
"""


@pytest.mark.parametrize("method", ["fork", "spawn", *matrix("forkserver")])
def test_cell_defined_code_runs_the_same_under_every_start_method(kernel, method):
    assert kernel.execute(NOTEBOOK_CODE).error is None
    r = kernel.execute(
        f"out = notebook_launcher(job, args=(Point(2), make_adder(10)), display='text', num_processes=2, start_method={method!r})\n"
        "print('RESULT', out)\n"
        "print('LAMBDA', notebook_launcher(lambda: SCALE * 2, display='text', num_processes=2, start_method="
        f"{method!r}))\n")
    assert r.error is None, r.error
    assert "RESULT [[0, 3, 2.828, 10, 'Point'], [1, 3, 2.828, 11, 'Point']]" in r.stdout
    assert "LAMBDA [6, 6]" in r.stdout
    assert "[rank 0] rank 0 sees SCALE=3" in r.stdout and "[rank 1] rank 1 sees SCALE=3" in r.stdout


@pytest.mark.parametrize("method", ["spawn", *matrix("forkserver")])
def test_rank_output_reaches_the_cell_when_ipykernel_disables_fd_capture(method):
    # nbval runs kernels with PYTEST_CURRENT_TEST set, and ipykernel then does
    # not capture fds: output of non-forked ranks would go to the terminal.
    k = Kernel(extra_env={"PYTEST_CURRENT_TEST": "nbval"})
    try:
        r = k.execute(
            "import os, sys\nfrom nblaunch import notebook_launcher\n"
            "def say():\n"
            "    print('stdout of', os.environ['RANK'])\n"
            "    os.write(1, b'raw fd 1 of ' + os.environ['RANK'].encode() + b'\\n')\n"
            "    print('stderr of', os.environ['RANK'], file=sys.stderr)\n"
            f"notebook_launcher(say, display='text', num_processes=2, start_method={method!r})\n")
        assert r.error is None, r.error
        for rank in (0, 1):
            for text in (f"stdout of {rank}", f"raw fd 1 of {rank}", f"stderr of {rank}"):
                assert f"[rank {rank}] {text}" in r.stdout
    finally:
        k.shutdown()


def test_auto_avoids_fork_when_cuda_is_initialised(kernel):
    # This machine has no GPU: torch.cuda.is_initialized is replaced by a
    # stand-in that says True, which is all the decision reads.
    r = kernel.execute(
        "import torch\nfrom nblaunch import notebook_launcher\n"
        "torch.cuda.is_initialized = lambda: True\n"
        "print('RESULT', notebook_launcher(lambda: 5, display='text', num_processes=2))\n")
    assert r.error is None, r.error
    assert "[nblaunch] CUDA is initialised in this kernel; starting ranks with forkserver" in r.stdout
    assert "RESULT [5, 5]" in r.stdout
    r = kernel.execute("notebook_launcher(lambda: 5, display='text', num_processes=2, start_method='fork')")
    assert r.error is not None and r.error["ename"] == "ValueError"
    assert "CUDA is initialised in this kernel" in r.error["evalue"]
    assert "start_method='auto'" in r.error["evalue"]


def test_a_big_tensor_reaches_ranks_through_shared_memory(kernel):
    shm_before = set(os.listdir("/dev/shm"))
    r = kernel.execute(
        "import torch, psutil\nfrom nblaunch import notebook_launcher\n"
        "big = torch.ones(256 * 1024 * 1024)             # 1 GiB, captured by fn\n"
        "def touch(t):\n"
        "    total = big.sum().item() + t.sum().item()   # every page read\n"
        "    return total, psutil.Process().memory_full_info().uss\n"
        "out = notebook_launcher(touch, args=(big,), display='text', num_processes=4, start_method='forkserver')\n"
        "print('TOTALS', sorted({t for t, _ in out}))\n"
        "print('USS_MB', sum(u for _, u in out) // 2**20)\n", timeout=240)
    assert r.error is None, r.error
    assert "TOTALS [536870912.0]" in r.stdout
    uss_mb = int(re.search(r"USS_MB (\d+)", r.stdout).group(1))
    assert uss_mb < 1024, f"4 ranks hold {uss_mb} MB of their own: the tensor was copied"
    assert set(os.listdir("/dev/shm")) <= shm_before
    r = kernel.execute(
        "def fail(t):\n    raise RuntimeError('after mapping')\n"
        "try:\n    notebook_launcher(fail, args=(big,), display='text', num_processes=2, start_method='forkserver')\n"
        "except Exception as e:\n    print('FAILED', type(e).__name__)\n")
    assert "FAILED WorkerError" in r.stdout
    assert set(os.listdir("/dev/shm")) <= shm_before


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_unpicklable_input_is_named_before_any_rank_starts(method):
    import threading

    from nblaunch import notebook_launcher

    class Holder:
        def __init__(self):
            self.lock = threading.Lock()

    import torch  # noqa: F401  (imported first: the bound below is for nblaunch's checks, not torch's import)

    lock = threading.Lock()
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    start = time.monotonic()
    with pytest.raises(TypeError, match=re.escape("args[0].lock: cannot pickle '_thread.lock' object")):
        notebook_launcher(lambda h: 1, args=(Holder(),), display='text', num_processes=2, start_method=method)
    with pytest.raises(TypeError, match=r"captured by fn as `lock`"):
        notebook_launcher(lambda: lock.locked(), display='text', num_processes=2, start_method=method)
    assert time.monotonic() - start < 1.0
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before


@pytest.mark.parametrize("method", ["forkserver", *matrix("spawn")])
def test_interrupt_and_orphans_under_non_fork_methods(method):
    k = Kernel()
    try:
        code = (
            "from nblaunch import notebook_launcher\nimport os, time\n"
            "def wait():\n    print('ready', os.getpid(), flush=True)\n    time.sleep(600)\n")
        k.execute(code)
        msg_id = k.execute_async(f"notebook_launcher(wait, display='text', num_processes=2, start_method={method!r})")
        pids = _ready_pids(k, 2)
        k.km.interrupt_kernel()
        reply = k.wait_for_reply(msg_id, timeout=30)
        assert reply.error is not None and reply.error["ename"] == "KeyboardInterrupt"
        assert wait_gone(pids, timeout=1.0) == []
        shown = "\n".join(reply.error["traceback"])  # where each rank was: in the error, once
        assert re.search(r"rank 0: in wait at Cell In\[\d+\], line 5 .*\| time\.sleep\(600\)", shown), shown
        assert re.search(r"rank 1: in wait at ", shown), shown
        k.execute_async(f"notebook_launcher(wait, display='text', num_processes=2, start_method={method!r})")
        pids = _ready_pids(k, 2)
        helpers = [p.pid for p in psutil.Process(k.pid).children(recursive=True) if p.pid not in pids]
        os.kill(k.pid, signal.SIGKILL)
        assert wait_gone(pids + helpers, timeout=5) == []  # ranks, and the forkserver too
    finally:
        k.shutdown()


def _ready_pids(k: Kernel, n: int) -> list[int]:
    seen = ""
    while len(re.findall(r"ready (\d+)", seen)) < n:
        seen += k.wait_for_output("ready", timeout=90)
    return [int(p) for p in re.findall(r"ready (\d+)", seen)]


def test_a_cell_function_that_calls_open_travels_small(kernel):
    """IPython's `open` and the library source around it stay home: the job
    is the function, not IPython (it was 185 KB per rank)."""
    reply = kernel.execute(
        "from nblaunch import notebook_launcher\n"
        "from nblaunch.wire.payload import CloudJob\n"
        "def reads(path):\n"
        "    with open(path) as f:\n"
        "        return f.read()\n"
        "import tempfile, os\n"
        "path = os.path.join(tempfile.mkdtemp(), 'x.txt'); open(path, 'w').write('hello')\n"
        "print('SIZE', len(CloudJob(reads, (path,), {}).pack()))\n"
        "print('OUT', notebook_launcher(reads, args=(path,), num_processes=2, start_method='spawn', display='none'))\n")
    assert reply.error is None, reply.error
    assert int(reply.stdout.split("SIZE ")[1].split()[0]) < 10_000, reply.stdout
    assert "OUT ['hello', 'hello']" in reply.stdout
