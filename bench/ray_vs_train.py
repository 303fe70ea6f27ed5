"""Ranks across the nodes of a Ray cluster: nblaunch vs Ray Train's TorchTrainer (issue 27), one run.

The scenario: a two-node Ray cluster on this machine (``ray start --head``
and a second ``ray start``, 2 CPUs each), 4 ranks (2 per node); each rank
joins a gloo process group, does one ``all_reduce`` and returns a value.

* ``TorchTrainer(train_loop, scaling_config=ScalingConfig(num_workers=4))
  .fit()``, the loop reporting its value with ``ray.train.report``;
* ``nblaunch.notebook_launcher(fn, num_processes=2, cluster="ray")``.

Measured from the call, in the same run, alternating: time until every rank
is running the user's function (each rank notes ``time.time()`` as it
starts), and time until the result is back in the caller. Then a live call
across the nodes: ``ranks.run`` of the same ``all_reduce`` on
``nblaunch.start(2, cluster="ray")``, median of 30 (goal: <= 20 ms).

    python bench/ray_vs_train.py            # 3 rounds, about 3 minutes
    python bench/ray_vs_train.py --smoke    # one round (CI)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

import ray_cluster  # noqa: E402  (the two-node cluster the tests use)


def nb_fn():
    import time

    import torch
    import torch.distributed as dist

    started = time.time()
    t = torch.ones(1)
    dist.all_reduce(t)
    return started, t.item()


def train_loop(config):
    import time

    import ray.train
    import torch
    import torch.distributed as dist

    started = time.time()
    t = torch.ones(1)
    dist.all_reduce(t)
    # Ray Train returns no metrics reported without a checkpoint (result.metrics
    # is None): each worker leaves its start time in a file (one machine here).
    with open(f"{config['dir']}/started-{dist.get_rank()}", "w") as f:
        f.write(repr(started))
    ray.train.report({"value": t.item()})


def run_trainer(storage: str) -> tuple[float, float]:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    marks = tempfile.mkdtemp(dir=storage)
    t0 = time.time()
    trainer = TorchTrainer(train_loop, train_loop_config={"dir": marks},
                           scaling_config=ScalingConfig(num_workers=4, resources_per_worker={"CPU": 1}),
                           run_config=RunConfig(storage_path=storage, name=f"bench-{time.time_ns()}"))
    trainer.fit()
    done = time.time()
    started = [float(Path(marks, f).read_text()) for f in os.listdir(marks)]
    assert len(started) == 4, started
    return max(started) - t0, done - t0


def run_nblaunch() -> tuple[float, float]:
    import nblaunch

    t0 = time.time()
    out = nblaunch.notebook_launcher(nb_fn, num_processes=2, cluster="ray", display="none")
    done = time.time()
    assert [v for _, v in out] == [4.0] * 4, out
    return max(s for s, _ in out) - t0, done - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="one round (CI)")
    parser.add_argument("--rounds", type=int, default=3)
    opts = parser.parse_args()
    rounds = 1 if opts.smoke else opts.rounds
    import ray
    import torch  # noqa: F401 - a notebook has it imported before it launches

    own = "RAY_ADDRESS" not in os.environ
    with tempfile.TemporaryDirectory() as tmp:
        try:
            address = ray_cluster.start(os.path.join(tmp, "ray")) if own else os.environ["RAY_ADDRESS"]
            ray.init(address=address, log_to_driver=False)
            os.makedirs(os.path.join(tmp, "train"))
            times: dict = {"TorchTrainer": [], "nblaunch": []}
            for i in range(rounds):
                times["TorchTrainer"].append(run_trainer(os.path.join(tmp, "train")))
                times["nblaunch"].append(run_nblaunch())
                print(f"round {i + 1}: " + ", ".join(f"{k} running {v[-1][0]:.2f} s, result {v[-1][1]:.2f} s"
                                                    for k, v in times.items()), flush=True)
            import nblaunch

            calls = []
            with nblaunch.start(2, cluster="ray", display="none") as ranks:
                for _ in range(5 if opts.smoke else 30):
                    t = time.perf_counter()
                    assert [v for _, v in ranks.run(nb_fn, display="none")] == [4.0] * 4
                    calls.append(time.perf_counter() - t)
        finally:
            ray.shutdown()
            if own:
                ray_cluster.stop()
    med = {k: {"running_s": statistics.median(r for r, _ in v), "result_s": statistics.median(d for _, d in v)}
           for k, v in times.items()}
    result = {
        "scenario": "2 Ray nodes on this machine x 2 ranks, gloo, one all_reduce; seconds from the call",
        "rounds": rounds,
        "median": med,
        "all": times,
        "nblaunch_vs_trainer_result": med["nblaunch"]["result_s"] / med["TorchTrainer"]["result_s"],
        "nblaunch_vs_trainer_running": med["nblaunch"]["running_s"] / med["TorchTrainer"]["running_s"],
        "live_call_ms_median": 1000 * statistics.median(calls),
        "live_call_ms_max": 1000 * max(calls),
        "goals": {"live_call_ms": 20},
        "versions": {"ray": ray.__version__},
        "machine": f"{os.cpu_count()} CPUs; both Ray nodes on this machine",
    }
    print(json.dumps(result, indent=2))
    if not opts.smoke:
        (HERE / "results" / "ray.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
