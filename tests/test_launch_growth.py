"""Nothing on a launch's way grows with the square of the world (#40).
Process-free: a generation of 64 and of 256 ranks is made (pipes, specs,
what the zygote is handed) but not started, and counted; milliseconds."""
from __future__ import annotations

import os

import pytest

from nblaunch.config import LaunchConfig
from nblaunch.engines import local
from nblaunch.engines.local_pool import LocalPool
from nblaunch.engines.nodes import SingleNode
from nblaunch.engines.plan import plan_ranks
from nblaunch.engines.zygote import ZygoteRank, close_spans, fd_spans

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="Linux: forked ranks, fds in /proc")


def job():
    return None


def _holes() -> int:
    """Free fd numbers below the highest open one (other tests' closed fds):
    new pipes fill them first, so a generation's fds are one run plus these."""
    fds = [int(fd) for fd in os.listdir("/proc/self/fd")]
    return max(fds) + 1 - len(fds)


def _elements(value, seen=None) -> int:
    """How many items the lists, tuples and dicts reachable from ``value`` hold."""
    seen = set() if seen is None else seen
    if id(value) in seen or not isinstance(value, (list, tuple, dict)):
        return 0
    seen.add(id(value))
    items = list(value.items()) if isinstance(value, dict) else list(value)
    return len(items) + sum(_elements(item, seen) for item in items)


def _generation(n: int) -> tuple[int, int, LocalPool]:
    """A forked generation of ``n`` ranks, made and not started: the pipe
    ends it made, what its zygote is handed (items), and the pool."""
    config = LaunchConfig(n, start_method="fork", display="none")
    plan = plan_ranks(config)
    pool = LocalPool(plan, SingleNode(config.addr, n, plan.pg_timeout), job=(job, (), {}))
    ends = len(pool._ends) + 2 * len(pool._zygote.ranks)  # 3 pipes per rank, and its status pipe
    return ends, _elements(pool._zygote._proc._args), pool


def test_a_generations_pipes_and_what_its_zygote_is_handed_grow_linearly():
    """Before, the zygote was handed, for each rank, the list of every other
    rank's pipe ends to close: 256 ranks, 195,840 items."""
    counts = {}
    for n in (64, 256):
        fds, handed, pool = _generation(n)
        try:
            assert all(isinstance(p.proc, ZygoteRank) for p in pool._procs)  # one zygote forks them all
            counts[n] = (fds, handed)
        finally:
            pool.close()
    assert counts[256][0] == 4 * counts[64][0]  # the same pipes per rank
    assert counts[256][1] <= 4.2 * counts[64][1], counts  # linear, not 16x


def test_a_forked_rank_closes_the_other_ranks_pipes_in_a_few_calls_whatever_the_world():
    """Each rank forked by the zygote closes the ends it inherited from every
    other rank; one ``close_range`` per run of numbers, not one call per fd."""
    for n in (64, 256):
        holes = _holes()
        pipes = [os.pipe() for _ in range(4 * n)]  # a rank's 3 pipes and its status pipe
        fds = [fd for pair in pipes for fd in pair]
        own = tuple(fds[4 * (n // 2): 4 * (n // 2) + 3])
        left = fds
        try:
            spans = fd_spans(fds)
            # Made one after the other: one run, and the holes they filled
            # (a little slack: another test's thread may free a number meanwhile).
            assert len(spans) <= holes + 3
            calls = close_spans(spans, own)
            left = list(own)
            assert calls <= len(spans) + len(own)
            for fd in fds:
                closed = not os.path.exists(f"/proc/self/fd/{fd}")
                assert closed == (fd not in own), fd
        finally:
            for fd in left:  # never a number close_spans closed: it may be someone else's now
                os.close(fd)


def test_an_agents_generation_comes_from_one_zygote_and_only_a_kernels_small_first_one_skips_it(monkeypatch):
    """A node agent (not a kernel) builds its pool with the zygote, as does
    a kernel's second generation or a first one above ``FIRST_DIRECT_MAX_RANKS``."""
    config = LaunchConfig(2, start_method="fork", display="none")
    plan = plan_ranks(config)
    pools = []
    try:
        pools.append(LocalPool(plan, SingleNode(config.addr, 2, plan.pg_timeout), job=(job, (), {})))
        assert pools[-1]._zygote is not None  # what agent.py makes
        monkeypatch.setattr(local, "_forked_before", False)
        monkeypatch.setattr(local, "_in_kernel", lambda: True)
        engine = local.LocalEngine(config, live=False)
        try:
            pools.append(engine.new_pool((job, (), {}), 0))
            assert pools[-1]._zygote is None  # a kernel's first, small: forked directly
            pools.append(engine.new_pool((job, (), {}), 1))
            assert pools[-1]._zygote is not None
        finally:
            engine.close()
        monkeypatch.setattr(local, "_forked_before", False)
        big = LaunchConfig(local.FIRST_DIRECT_MAX_RANKS + 1, start_method="fork", display="none")
        engine = local.LocalEngine(big, live=False)
        try:
            pools.append(engine.new_pool((job, (), {}), 0))
            assert pools[-1]._zygote is not None
        finally:
            engine.close()
    finally:
        for pool in pools:
            pool.close()
