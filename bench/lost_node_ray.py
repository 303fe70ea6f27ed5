"""Seconds from a Ray node's freeze to the survivors' next step: nblaunch vs Ray Train (issue 47).

Ray's half of bench/lost_node.py (``--ray``): three Ray nodes on this machine
(tests/ray_cluster.py: 2 CPUs each, the GCS health checks every 1 s, a node dead after 3 missed),
one rank per node, gloo, an ``all_reduce`` and 0.1 s a step. 10 steps in, the third node is frozen
whole (its raylet and everything under it SIGSTOPped: nothing closes). Measured: from the freeze to
the last survivor's first step of the next generation (world size 2); a wait past the cap is
reported as "more than N s" (None). Each run gets a fresh third node; the frozen one is killed
after it, thawed.

* ``nblaunch``: ``notebook_launcher(..., cluster=nblaunch.Ray(nodes=3), max_restarts=1,
  min_nodes=2)``, the heartbeats at their default (``NBLAUNCH_NODE_LOST_AFTER`` or 10 s);
* ``Ray Train``: ``TorchTrainer`` with ``ScalingConfig(num_workers=(2, 3))`` (elastic: it may go
  on with 2), ``FailureConfig(max_failures=1)``, Ray Train v2's defaults otherwise.
"""
from __future__ import annotations

import os
import tempfile
import threading
import time
from pathlib import Path

import psutil

import ray_cluster  # tests/: the cluster the Ray tests use
from recovery import _wait  # the step files, read as the SLURM half reads them

STEPS = r'''
import json, os, time
def steps(folder, total=100_000):
    import torch, torch.distributed as dist
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.ones(1)
    for step in range(total):
        dist.all_reduce(t)
        if step in (0, 10):
            with open(os.path.join(folder, f"step{step}-{world}-{rank}"), "w") as f:
                json.dump({"time": time.time()}, f)
        if world == 2 and step == 20:
            return (rank, world)
        time.sleep(0.1)
def train_loop(config):
    steps(config["dir"])
'''
GIVE_UP_S = 300.0  # the first generation at step 10 by then, or the run is not measured


class _Freeze:
    """10 steps in, the node of ``raylet`` frozen whole; ``seconds``: to the survivors' next step (inf past ``cap``)."""

    def __init__(self, folder: Path, raylet, cap: float):
        self.folder, self.raylet, self.cap = folder, raylet, cap
        self.stopped: list = []
        self.seconds = float("inf")
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        if not _wait(self.folder, "step10-3-", 3, GIVE_UP_S):
            return
        self.stopped = [self.raylet, *self.raylet.children(recursive=True)]
        t = time.time()
        for p in self.stopped:
            p.suspend()
        firsts = _wait(self.folder, "step0-2-", 2, self.cap)
        if firsts:
            self.seconds = max(f["time"] for f in firsts) - t

    def end(self) -> None:
        """Thaw and kill the frozen node (a thawed raylet Ray declared dead exits by itself)."""
        self.thread.join(GIVE_UP_S + self.cap)
        for p in self.stopped:
            for act in (p.resume, p.kill):
                try:
                    act()
                except psutil.Error:
                    pass
        psutil.wait_procs(self.stopped, timeout=10)


def _nblaunch(namespace: dict, folder: Path, raylet, cap: float) -> float:
    import nblaunch

    freeze = _Freeze(folder, raylet, cap)
    try:
        nblaunch.notebook_launcher(namespace["steps"], (str(folder),), num_processes=1, cluster=nblaunch.Ray(nodes=3),
                                   max_restarts=1, min_nodes=2, display="none")
    finally:
        freeze.end()
    return freeze.seconds


def _ray_train(namespace: dict, folder: Path, raylet, cap: float) -> float:
    """Ray Train's run in a thread of its own: past the cap its survivors wait in gloo, and the
    cluster's end (the caller's) ends them."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    trainer = TorchTrainer(namespace["train_loop"], train_loop_config={"dir": str(folder)},
                           scaling_config=ScalingConfig(num_workers=(2, 3), resources_per_worker={"CPU": 2}),
                           run_config=RunConfig(storage_path=str(folder / "storage"), name=f"lost-{time.time_ns()}",
                                                failure_config=FailureConfig(max_failures=1)))
    fit = threading.Thread(target=trainer.fit, daemon=True)
    freeze = _Freeze(folder, raylet, cap)
    fit.start()
    freeze.end()
    fit.join(60 if freeze.seconds != float("inf") else 0)
    return freeze.seconds


def measure(cap: float) -> dict[str, float]:
    """One round on a fresh three-node cluster: the seconds of each (inf: more than ``cap``)."""
    import ray

    namespace: dict = {"__name__": "bench_lost_node_steps"}  # not importable: the functions travel by value
    exec(STEPS, namespace)
    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        address = ray_cluster.start(os.path.join(tmp, "ray"))
        try:
            ray.init(address=address, log_to_driver=False)
            for name, run in (("nblaunch", _nblaunch), ("Ray Train", _ray_train)):
                folder = Path(tmp, name.replace(" ", "_"))
                folder.mkdir()
                raylet = ray_cluster.add_node(address, os.path.join(tmp, f"ray-{len(out)}"))
                out[name] = run(namespace, folder, raylet, cap)
        finally:
            ray.shutdown()
            ray_cluster.stop()
    return out
