"""Whether a SLURM cluster of two (or three) nodes is up here (``.ci/slurm``
starts one of three), for the SLURM tests and the SLURM tutorial notebooks; loaded as a pytest
plugin (``-p slurm_cluster`` in pyproject.toml), it leaves that notebook out
where SLURM is not up (and the Spark tutorial out of the README's command)."""
from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
import tempfile

import pytest


def why_not(nodes: int = 2, partition: str = "") -> str:
    """Why SLURM cannot be used here ('' when it can): it needs ``nodes``
    nodes up (in ``partition``, "grow" being the one with the spare fourth
    node). With ``NBLAUNCH_REQUIRE_SLURM`` set (CI), a missing cluster is
    an error instead."""
    why = _why_not(nodes, partition)
    if why and os.environ.get("NBLAUNCH_REQUIRE_SLURM"):
        raise RuntimeError(f"NBLAUNCH_REQUIRE_SLURM is set, but {why}")
    return why


def _why_not(nodes: int, partition: str) -> str:
    if shutil.which("sinfo") is None or shutil.which("srun") is None:
        return "SLURM's commands are not installed (run .ci/slurm as root)"
    try:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T", *(["-p", partition] if partition else [])],
                             capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        return "sinfo did not answer"
    usable = {line.split()[0] for line in out.stdout.splitlines()  # a node in two partitions: listed twice
              if len(line.split()) == 2 and line.split()[1] in ("idle", "mixed", "allocated")}
    if out.returncode != 0 or len(usable) < nodes:
        where = f" in partition {partition}" if partition else ""
        return f"no {nodes}-node SLURM cluster{where} is up (sinfo: {out.stdout.strip() or out.stderr.strip()})"
    return ""


def pytest_ignore_collect(collection_path, config):
    """The SLURM tutorial runs where a SLURM cluster is up (CI starts one);
    elsewhere nbval leaves it out, unless ``NBLAUNCH_REQUIRE_SLURM`` is set,
    when its absence is an error."""
    if collection_path.name == "07_slurm.ipynb" and why_not():
        return True
    if collection_path.name == "09_lost_node.ipynb" and why_not(nodes=3):
        return True
    if collection_path.name == "10_spark.ipynb":
        return _spark_notebook_left_out(config)
    return None


def _spark_notebook_left_out(config) -> bool:
    """The Spark tutorial runs with the Spark group (``.ci/run``: ``-m ''``
    on it alone), not in the README's command, whose ``-m`` leaves Spark
    out (three JVMs); nor where pyspark or Java is missing, unless
    ``NBLAUNCH_REQUIRE_SPARK`` is set, when that is an error."""
    if "not spark" in (config.option.markexpr or ""):
        return True
    import importlib.util

    why = ("" if shutil.which("java") else "Java is not installed") or (
        "" if importlib.util.find_spec("pyspark") else "pyspark is not installed")
    if why and os.environ.get("NBLAUNCH_REQUIRE_SPARK"):
        raise RuntimeError(f"NBLAUNCH_REQUIRE_SPARK is set, but {why}")
    return bool(why)


@contextlib.contextmanager
def losing_a_node():
    """Held by whatever takes all three nodes and then ends one of them (its
    agent, or its slurmd: every step there): the three-node tests and the
    lost-node tutorial take turns, so that one's loss is never another's
    (the tutorial, run beside those tests, once killed their agent on n3)."""
    with open(os.path.join(tempfile.gettempdir(), "nblaunch-slurm-three-nodes.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """The SLURM tutorial runs with the SLURM engine's tests (``pytest -m
    slurm``); the lost-node tutorial loses a node on purpose, as the tests
    marked ``long`` do, and runs with them (``pytest -m long``): neither in
    the README's command."""
    for item in items:
        if item.path.name == "07_slurm.ipynb":
            item.add_marker(pytest.mark.slurm)
        elif item.path.name == "09_lost_node.ipynb":
            item.add_marker(pytest.mark.long)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    if item.path.name == "09_lost_node.ipynb":
        with losing_a_node():
            yield
    else:
        yield
