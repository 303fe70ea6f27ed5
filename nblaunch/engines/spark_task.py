"""What one barrier task of the Spark engine runs on its executor: that
node's agent (:mod:`nblaunch.engines.agent`), as a child, until it leaves.

Imports nothing of nblaunch's but this module: it is unpickled in Spark's
Python worker on every task. The task never fails in Spark's eyes (whatever
happens is returned as the agent's output): a failed task makes Spark
abort and rerun the whole barrier stage, and nblaunch owns restarts. A
rerun by Spark (a task attempt after the first) starts no agent: the
kernel takes one agent per node and generation.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import traceback

__all__ = ["run_agent", "OUTPUT_CHARS"]

OUTPUT_CHARS = 20000  # an agent's output kept for the kernel (its last characters)


def _executor_id() -> str:
    """The executor's id, read from the log address Spark gives its Python workers ("" if not there)."""
    found = re.search(r"executorId=([^&]+)", os.environ.get("SPARK_LOG_URL_STDERR", ""))
    return found.group(1) if found else ""


def _die_with_parent() -> None:
    """In the agent before it runs: SIGTERM when this worker ends (Spark
    killed the task: a cancelled job group). An agent whose parent is gone
    takes SIGTERM as its end, stops its ranks and leaves."""
    import ctypes

    try:
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def run_agent(environ: dict, cwd: str, python: str, done, partitions):
    """The barrier task: ``(node, exit code, output)`` for the kernel, added to
    the accumulator ``done`` as the task ends and returned. ``python``: the
    kernel's interpreter, used where the executor has it (else the worker's)."""
    from pyspark import BarrierTaskContext

    ctx = BarrierTaskContext.get()
    node = ctx.partitionId()
    try:
        if ctx.attemptNumber() > 0:
            found = (node, None, "a rerun by Spark: no agent started (nblaunch owns restarts)")
        else:
            host = ctx.getTaskInfos()[node].address.rsplit(":", 1)[0]
            executor = _executor_id()
            env = {**environ, "NBLAUNCH_NODE": str(node),
                   "NBLAUNCH_NODE_NAME": f"{host} (executor {executor})" if executor else host}
            gpus = ctx.resources().get("gpu")
            if gpus is not None:
                env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus.addresses)
            exe = python if os.access(python, os.X_OK) else sys.executable
            proc = subprocess.Popen(
                [exe, "-m", "nblaunch.engines.agent", "--node-var", "NBLAUNCH_NODE", "--name-var",
                 "NBLAUNCH_NODE_NAME"], env=env, cwd=cwd if os.path.isdir(cwd) else None,
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent)
            out = proc.stdout.read()
            found = (node, proc.wait(), out[-OUTPUT_CHARS:].decode(errors="replace"))
    except BaseException:  # noqa: BLE001 - never a failed task: Spark would rerun the stage
        found = (node, -1, traceback.format_exc()[-OUTPUT_CHARS:])
    done.add([found])
    yield found
