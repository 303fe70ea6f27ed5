"""Growing back (issue 48), without a process: ``max_nodes`` refused before anything
starts, with a one-line reason."""
from __future__ import annotations

import re
import time

import pytest

from nblaunch.config import LaunchConfig, check_max_nodes
from nblaunch.engines import engine_for
from nblaunch.engines import slurm as slurm_engine

SLURM = {"cluster": "slurm", "max_restarts": 1}
ELASTIC = {"num_nodes": 3, "rdzv_endpoint": "127.0.0.1:29400", "max_restarts": 1}


# -- max_nodes: refused before anything starts ------------------------------------------

@pytest.mark.parametrize("kwargs, reason", [
    (ELASTIC | {"min_nodes": 3, "max_nodes": 2}, "max_nodes=2 is below min_nodes=3"),
    (ELASTIC | {"min_nodes": 2, "max_nodes": 4}, "max_nodes=4 is more than the c10d rendezvous of num_nodes can hold (3 nodes)"),
    (SLURM | {"max_nodes": 3}, "max_nodes is the size a run grows back to after it lost nodes: give min_nodes too"),
    (SLURM | {"min_nodes": 2, "max_nodes": 1}, "max_nodes=1 is below min_nodes=2"),
])
def test_a_bad_max_nodes_is_refused_with_a_one_line_reason(kwargs, reason):
    t0 = time.perf_counter()
    with pytest.raises(ValueError) as refused:
        LaunchConfig(1, **kwargs)
    assert reason in str(refused.value) and "\n" not in str(refused.value)
    assert time.perf_counter() - t0 < 0.05


def test_max_nodes_must_be_an_int():
    with pytest.raises(TypeError, match="max_nodes must be an int or None, got str"):
        LaunchConfig(1, **SLURM, min_nodes=2, max_nodes="3")


def test_the_rule_on_what_an_allocation_can_hold():
    check_max_nodes(None, 2, 3, "SLURM job 12")  # default: the nodes the launch starts with
    check_max_nodes(3, 2, 3, "SLURM job 12")
    with pytest.raises(ValueError, match=re.escape("max_nodes=4 is more than SLURM job 12 can hold (3 nodes)")):
        check_max_nodes(4, 2, 3, "SLURM job 12")


@pytest.fixture
def fake_slurm(monkeypatch):
    """SLURM's commands answering as an allocation of three running nodes would, no process run."""
    ran = []

    def run(args):
        ran.append(args)
        if args[1:3] == ["show", "job"]:
            return "JobId=12 JobState=RUNNING NodeList=n[1-3] NumCPUs=6 NumNodes=3\n"
        if args[1:3] == ["show", "hostnames"]:
            return "n1\nn2\nn3\n"
        return f"NodeName={args[-1]} NodeAddr=127.0.0.1\n"

    monkeypatch.setattr(slurm_engine, "_slurm_command", lambda name: name)
    monkeypatch.setattr(slurm_engine, "_run", run)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    return ran


def test_inside_an_allocation_max_nodes_above_its_nodes_is_refused_before_any_agent(fake_slurm):
    config = LaunchConfig(1, cluster=slurm_engine.Slurm(job="12"), max_restarts=1, min_nodes=2, max_nodes=4)
    with pytest.raises(ValueError) as refused:
        engine_for(config)
    assert str(refused.value) == "max_nodes=4 is more than SLURM job 12 can hold (3 nodes)"
    assert not [a for a in fake_slurm if a[0] in ("srun", "salloc")]


def test_an_allocation_asked_for_holds_the_nodes_asked_for(fake_slurm):
    config = LaunchConfig(1, cluster=slurm_engine.Slurm(nodes=2), max_restarts=1, min_nodes=1, max_nodes=3)
    with pytest.raises(ValueError) as refused:
        engine_for(config)
    assert str(refused.value) == "max_nodes=3 is more than Slurm(nodes=2) can hold (2 nodes)"
    assert fake_slurm == []  # refused before SLURM was asked anything
