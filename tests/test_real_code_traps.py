"""What users do every day that broke a launch (issue 24), in real kernels:
a ``torch.compile`` in the kernel before the launch, a rank that leaves
early while its peer waits in a collective, and tracebacks that name the
notebook's cells."""
from __future__ import annotations

import re
import time

import pytest

from busy_ddp import BUSY_DDP
from conftest import Kernel, matrix

pytestmark = pytest.mark.timeout(600)


def _traceback(reply) -> str:
    assert reply.error is not None, reply.stdout
    return "\n".join(reply.error["traceback"])


# --- torch.compile in the kernel ------------------------------------------------------

COMPILE_IN_THE_KERNEL = """
import torch
from nblaunch import notebook_launcher
probe = torch.compile(torch.nn.Linear(4, 4))
probe(torch.randn(2, 4)).sum().backward()   # the kernel's first compile starts inductor's compile pool
from torch._inductor.async_compile import AsyncCompile
print("POOL", AsyncCompile.pool.cache_info().currsize)
"""

TRAIN_COMPILED = """
def train_compiled(steps):
    import torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    model = DDP(torch.compile(net))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(steps):
        loss = model(torch.randn(4, 8, generator=g)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return round(float(sum(p.sum() for p in model.parameters())), 5)
"""


@pytest.mark.long  # inductor compiles in the kernel and in each rank: a minute of 2 cores
def test_ddp_of_a_compiled_model_trains_after_a_compile_in_the_kernel(tmp_path):
    """The kernel compiled first (its compile pool's threads are not in a
    forked rank), then forked ranks train DDP(torch.compile(model)), against
    a cold cache, so that they really compile; then the default method. A
    forkserver's or spawned rank is a fresh interpreter with no pool to
    inherit (test_start_methods runs cell code under each)."""
    k = Kernel(extra_env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
                          "TORCHINDUCTOR_COMPILE_THREADS": "2"})  # the pool, on any machine
    try:
        reply = k.execute(COMPILE_IN_THE_KERNEL, timeout=300)
        assert reply.error is None, _traceback(reply)
        assert "POOL 1" in reply.stdout  # the trap is armed: the kernel holds a compile pool
        k.execute(TRAIN_COMPILED)
        for method in ("fork",):
            reply = k.execute(f"r = notebook_launcher(train_compiled, args=(3,), num_processes=2, "
                              f"start_method='{method}', display='none', timeout=300)\n"
                              "print('TRAINED', r[0] == r[1], r)", timeout=360)
            assert reply.error is None, (method, _traceback(reply))
            assert "TRAINED True" in reply.stdout, (method, reply.stdout)  # DDP kept the ranks equal
        reply = k.execute("r = notebook_launcher(train_compiled, args=(2,), num_processes=2, display='none', "
                          "timeout=300)\nprint('DEFAULT', r[0] == r[1])", timeout=360)
        assert reply.error is None and "DEFAULT True" in reply.stdout, reply.stdout
    finally:
        k.shutdown()


# --- a rank that leaves early ------------------------------------------------------------

LEAVERS = """
import os, sys, time
import nblaunch
from nblaunch import notebook_launcher

def leave_early(how):
    import torch, torch.distributed as dist
    if dist.get_rank() == 1:
        time.sleep(0.2)            # rank 0 is in all_reduce by now
        if how == "sys.exit(0)":
            sys.exit(0)
        if how == "os._exit(0)":
            os._exit(0)
        return "done early"
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()
"""


@pytest.fixture(scope="module")
def leavers():
    k = Kernel()
    try:
        assert k.execute(LEAVERS, timeout=180).error is None
        yield k
    finally:
        k.shutdown()


@pytest.mark.parametrize("how, said", [("return", "returned"), ("sys.exit(0)", "exited (code 0)"),
                                       ("os._exit(0)", "exited (code 0)")])
def test_a_rank_that_leaves_early_is_named_in_a_launch(leavers, how, said):
    t0 = time.monotonic()
    reply = leavers.execute(f"notebook_launcher(leave_early, args=({how!r},), num_processes=2, timeout=120)",
                            timeout=180)
    shown = _traceback(reply)
    assert f"WorkerError: rank 1 {said} while rank 0 was in all_reduce" in shown, shown
    assert time.monotonic() - t0 < 60  # loose: within seconds, not at the timeout
    assert re.search(r"data-status='failed'[^>]*>.*?rank 1", str(reply.outputs)) or "rank 1" in shown


def test_a_live_rank_that_returns_while_its_peer_waits_restarts_the_ranks_with_that_message(leavers):
    reply = leavers.execute("ranks = nblaunch.start(2)\nprint(ranks.run(lambda: 'up'))", timeout=180)
    assert reply.error is None and "['up', 'up']" in reply.stdout, reply.stdout
    t0 = time.monotonic()
    reply = leavers.execute("ranks.run(leave_early, 'return', timeout=120)", timeout=180)
    shown = _traceback(reply)
    assert time.monotonic() - t0 < 60, shown  # within seconds, not at the call's timeout
    assert "WorkerError: rank 1 returned while rank 0 was in all_reduce" in shown, shown
    assert "restarted its ranks (rank 1 returned while rank 0 was in all_reduce)" in shown, shown
    reply = leavers.execute("print('AFTER', ranks.run(lambda: 3), ranks.restarts)\nranks.close()", timeout=180)
    assert reply.error is None and "AFTER [3, 3] 1" in reply.stdout, reply.stdout


# --- tracebacks in the notebook's terms --------------------------------------------------


def _number(reply) -> int:
    """The cell's In[N], as the front end shows it."""
    return next(m["content"]["execution_count"] for m in reply.outputs if m["msg_type"] == "execute_input")


def test_rank_tracebacks_name_the_cell_and_leave_out_the_magic(leavers):
    reply = leavers.execute("def broken(x):\n    y = x + 1\n    raise ValueError(f'bad {y}')\n")
    assert reply.error is None
    defined_in = _number(reply)
    shown = _traceback(leavers.execute("notebook_launcher(broken, args=(1,), num_processes=2, display='none')"))
    assert f"Cell In[{defined_in}], line 3, in broken" in shown, shown
    assert "ipykernel_" not in shown

    leavers.execute("%load_ext nblaunch")
    assert leavers.execute("%nblaunch start -n 2").error is None
    try:
        reply = leavers.execute("%%nblaunch\nz = rank + 1\nraise KeyError(f'no {z}')\n")
        count = _number(reply)
        shown = _traceback(reply)
        assert f"Cell In[{count}], line 3" in shown, shown  # the cell's own line 3 (the body's line 2)
        assert "magic.py" not in shown and "_exec_cell" not in shown and "run_cell" not in shown, shown
    finally:
        leavers.execute("%nblaunch stop")


# --- the stop button on a compute-bound DDP loop, on live ranks --------------------------

TRIES = 20


@pytest.mark.parametrize("kind", ["progress", *matrix("tqdm")])
def test_the_stop_button_on_a_busy_ddp_loop_keeps_the_live_ranks(kind):
    k = Kernel()
    try:
        assert k.execute(BUSY_DDP, timeout=180).error is None
        for attempt in range(TRIES):
            msg_id = k.execute_async(f"ranks.run(train, {kind!r}, {attempt}, display='text')")
            k.wait_for_output(f"looping {attempt}", timeout=120)
            k.km.interrupt_kernel()
            reply = k.wait_for_reply(msg_id, timeout=120)
            assert reply.error is not None and reply.error["ename"] == "KeyboardInterrupt", reply.stdout
            shown = "\n".join(reply.error["traceback"])
            assert "keep their state" in shown, (attempt, shown.replace("\n", " // "), reply.stdout[-3000:])
            reply = k.execute("print('STATE', ranks.restarts, ranks.run(lambda: steps_done, display='none'))")
            restarts, done = reply.stdout.split("STATE ")[1].split(" ", 1)
            assert restarts == "0", (attempt, reply.stdout)  # the set-up survived
            same = eval(done)  # noqa: S307 - [steps on rank 0, steps on rank 1]
            assert same[0] == same[1] > 20 * (attempt + 1), (attempt, same)  # stopped at the same step
        k.execute("ranks.close()")
    finally:
        k.shutdown()
