"""Nothing a rank printed is lost (issue 52): everything a rank wrote before
it returned, exited or was stopped is in its log, and in the cell as the view
allows, before the call returns."""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time

import pytest

import nblaunch
from nblaunch import notebook_launcher
from nblaunch.engines.output import drain_due

import slurm_cluster
from conftest import Kernel, matrix

BIG = 50 * 2**20


# --- functions run on the ranks (module level, so spawn can import them too) ---


def no_newline(n: int) -> int:
    import sys

    sys.stdout.write("x" * n)  # a progress line that never ends
    return n


def lines_then_return(n_bytes: int) -> int:
    import sys

    line = "y" * 99
    count = n_bytes // 100
    for i in range(count - 1):
        sys.stdout.write(line + "\n")
    print(f"the last line of {count}")
    return count


@contextlib.contextmanager
def busy(n: int = 2):
    """``n`` busy-loop processes for the length of the block, ended after it."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait(10)


def _log(results, rank: int = 0) -> bytes:
    with open(os.path.join(results.log_dir, f"rank{rank}.log"), "rb") as f:
        return f.read()


# --- the rule -------------------------------------------------------------------


def test_a_ranks_end_waits_for_its_pipes_end_or_the_deadline():
    # (pipe ended, seconds since the rank's end, deadline) -> act on the end now?
    assert drain_due(ended=True, waited=0.0, deadline=2.0)
    assert not drain_due(ended=False, waited=0.0, deadline=2.0)
    assert not drain_due(ended=False, waited=1.99, deadline=2.0)
    assert drain_due(ended=False, waited=2.0, deadline=2.0)


# --- launches ------------------------------------------------------------------


# 50 MiB, the size the issue lost bytes at, takes ~6.5 s a run on two busy
# cores (the kernel reads 1 MiB of a flooding rank per 50 ms batch): 130 s for
# the 20 runs; 4 MiB (64 pipe reads), ~25 s. Both in the long group (pytest -m long).
@pytest.mark.long
@pytest.mark.parametrize("size", [4 << 20, BIG], ids=["4MiB", "50MiB"])
def test_a_long_line_without_a_newline_is_in_the_log_byte_exact_20_times_under_load(size):
    t = time.monotonic()
    with busy(2):
        for run in range(20):
            results = notebook_launcher(no_newline, args=(size,), num_processes=1, display="none",
                                        init_process_group=False)
            assert results == [size]
            log = _log(results)
            assert len(log) == size and log == b"x" * size, f"run {run}: {size - len(log):,} bytes short"
    print(f"20 runs of {size >> 20} MiB under load: {time.monotonic() - t:.1f} s")


@pytest.mark.parametrize("method", ["fork", *matrix("spawn")])
def test_a_rank_that_prints_1_mib_of_lines_and_returns_has_its_last_line_in_log_and_cell(method, capsys):
    results = notebook_launcher(lines_then_return, args=(1 << 20,), num_processes=2, start_method=method,
                                display="text", init_process_group=False)
    count = (1 << 20) // 100
    assert results == [count, count]
    out = capsys.readouterr().out
    for rank in (0, 1):
        assert _log(results, rank).endswith(f"the last line of {count}\n".encode())
        assert f"[rank {rank}] the last line of {count}\n" in out


def test_a_live_call_that_prints_1_mib_of_lines_has_its_last_line_in_the_cell(capsys):
    count = (1 << 20) // 100
    with nblaunch.start(2, start_method="fork", display="none", init_process_group=False) as ranks:
        for call in range(3):
            capsys.readouterr()
            assert ranks.run(lines_then_return, 1 << 20, display="text") == [count, count]
            out = capsys.readouterr().out
            for rank in (0, 1):
                assert f"[rank {rank}] the last line of {count}\n" in out, f"call {call}, rank {rank}"


# --- SLURM ----------------------------------------------------------------------

_WHY_NOT = slurm_cluster.why_not()


@pytest.mark.skipif(bool(_WHY_NOT), reason=_WHY_NOT)
@pytest.mark.timeout(300)
@pytest.mark.long  # fifty times over: pytest -m long
def test_a_slurm_live_call_that_prints_and_returns_has_its_last_line_in_the_cell_50_times():
    from test_slurm import _nothing_left, _ok, _salloc

    job = _salloc(2)
    try:
        k = Kernel(extra_env={"SLURM_JOB_ID": job})
        try:
            _ok(k.execute("import nblaunch\nranks = nblaunch.start(2, cluster='slurm', display='none')\n"
                          "def say(i):\n    import torch.distributed as dist\n"
                          "    print(f'call {i} rank {dist.get_rank()} last line')\n    return i"))
            for i in range(50):
                text = _ok(k.execute(f"r = ranks.run(say, {i}, display='text')"))
                for rank in range(4):
                    assert f"[rank {rank}] call {i} rank {rank} last line" in text, f"call {i}:\n{text}"
            _ok(k.execute("ranks.close()"))
        finally:
            k.shutdown()
        _nothing_left(job)
    finally:
        subprocess.run(["scancel", job], timeout=20)
