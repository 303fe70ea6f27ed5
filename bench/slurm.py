"""Ranks across the nodes of a SLURM allocation: nblaunch vs srun vs submitit (issue 26), one run.

The scenario: 2 nodes x 2 ranks; each rank joins a gloo process group, does
one ``all_reduce`` and returns. Wall time from the call to every rank done:

* ``srun``: ``srun -N2 --ntasks-per-node=2 python train.py`` on the
  allocation, each task reading its rank from SLURM's variables, the way a
  batch script runs torch;
* ``submitit``: the same ``srun``, each task set up by submitit's
  ``TorchDistributedEnvironment().export()`` (its documented helper);
* ``nblaunch``: ``notebook_launcher(fn, num_processes=2, cluster="slurm")``
  from a process that has imported torch, as a notebook kernel has.

Then a live call across the two nodes: ``ranks.run`` of the same all_reduce
on ranks kept up by ``nblaunch.start(2, cluster="slurm")``; median of 30.
Goals: nblaunch within 1.2x of srun; a live call within 20 ms.

Runs inside an allocation of two nodes (``SLURM_JOB_ID``), or makes one
(``salloc --no-shell -N2 --ntasks-per-node=2``: a CPU per rank) and gives it back. ``.ci/slurm`` starts a
two-node cluster on this machine.

    python bench/slurm.py            # 5 alternating rounds, about 1 minute
    python bench/slurm.py --smoke    # one round (CI), and the node sweep at 2 and 3 nodes
    python bench/slurm.py --nodes 2 4 6 8   # also the cost per added node (bench/slurm_sweep.py),
                                            # on a private cluster of 8 nodes started for it
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

TRAIN = r'''
import os, sys
if sys.argv[1] == "submitit":
    import submitit
    submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
    os.environ["MASTER_ADDR"] = os.environ["BENCH_NODE_ADDR"]  # n1 does not resolve here; its address does
else:
    os.environ.update(MASTER_ADDR=os.environ["BENCH_NODE_ADDR"], MASTER_PORT=os.environ["BENCH_PORT"])
    os.environ.update(RANK=os.environ["SLURM_PROCID"], WORLD_SIZE=os.environ["SLURM_NTASKS"],
                      LOCAL_RANK=os.environ["SLURM_LOCALID"])
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
assert t.item() == dist.get_world_size()
dist.destroy_process_group()
'''


def all_reduce():
    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def run_srun(job: str, script: str, how: str, port: int) -> float:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SRUN_")) or k == "SLURM_CONF"}
    # SLURM's node names need not resolve (they do not on the test cluster):
    # the first node's address is given, as a batch script would give it.
    env.update(BENCH_NODE_ADDR="127.0.0.1", BENCH_PORT=str(port), SUBMITIT_EXECUTOR="slurm")
    t = time.perf_counter()
    subprocess.run(["srun", f"--jobid={job}", "--overlap", "--nodes=2", "--ntasks-per-node=2", "--kill-on-bad-exit=1",
                    sys.executable, script, how], check=True, env=env, stdin=subprocess.DEVNULL)
    return time.perf_counter() - t


def run_nblaunch() -> float:
    import nblaunch

    t = time.perf_counter()
    out = nblaunch.notebook_launcher(all_reduce, num_processes=2, cluster="slurm", display="none")
    took = time.perf_counter() - t
    assert list(out) == [4.0] * 4, out
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="one round (CI)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--nodes", type=int, nargs="+", help="node counts of the per-added-node sweep")
    parser.add_argument("--sweep-rounds", type=int, default=3)
    parser.add_argument("--sweep-only", action="store_true", help="only the node sweep")
    parser.add_argument("--ranks-per-node", type=int, default=1, help="ranks on each node of the sweep")
    opts = parser.parse_args()
    rounds = 1 if opts.smoke else opts.rounds
    sizes = [2, 3] if opts.smoke and not opts.nodes else opts.nodes
    if sizes:
        import slurm_sweep

        per_node = slurm_sweep.sweep(sizes, 1 if opts.smoke else opts.sweep_rounds, TRAIN, all_reduce,
                                     opts.ranks_per_node)
        print(slurm_sweep.table(per_node), flush=True)
        if not opts.smoke:
            name = "slurm_nodes.json" if opts.ranks_per_node == 1 else f"slurm_nodes_{opts.ranks_per_node}_per_node.json"
            (HERE / "results" / name).write_text(json.dumps(per_node, indent=2) + "\n")
        if opts.sweep_only:
            return
    import torch  # noqa: F401 - a notebook has it imported before it launches

    ours = None
    job = os.environ.get("SLURM_JOB_ID")
    if job is None:
        out = subprocess.run(["salloc", "--no-shell", "--nodes=2", "--ntasks-per-node=2", "--job-name=nblaunch-bench"],
                             capture_output=True, text=True, check=True)
        job = ours = re.search(r"job allocation (\d+)", out.stdout + out.stderr).group(1)
        os.environ["SLURM_JOB_ID"] = job
    try:
        with tempfile.TemporaryDirectory() as tmp:
            script = os.path.join(tmp, "train.py")
            Path(script).write_text(TRAIN)
            times: dict[str, list[float]] = {"srun": [], "submitit": [], "nblaunch": []}
            for i in range(rounds):  # alternating, so a slow moment of the machine hits all three
                times["srun"].append(run_srun(job, script, "srun", 29600 + 2 * i))
                times["submitit"].append(run_srun(job, script, "submitit", 29601 + 2 * i))
                times["nblaunch"].append(run_nblaunch())
                print(f"round {i + 1}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in times.items()), flush=True)
            import nblaunch

            calls = []
            with nblaunch.start(2, cluster="slurm", display="none") as ranks:
                for _ in range(5 if opts.smoke else 30):
                    t = time.perf_counter()
                    assert ranks.run(all_reduce, display="none") == [4.0] * 4
                    calls.append(time.perf_counter() - t)
    finally:
        if ours is not None:
            subprocess.run(["scancel", ours])
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "scenario": "2 nodes x 2 ranks, gloo, one all_reduce; wall time from the call to every rank done",
        "rounds": rounds,
        "median_s": med,
        "all_s": times,
        "nblaunch_vs_srun": med["nblaunch"] / med["srun"],
        "nblaunch_vs_submitit": med["nblaunch"] / med["submitit"],
        "live_call_ms_median": 1000 * statistics.median(calls),
        "live_call_ms_max": 1000 * max(calls),
        "goals": {"nblaunch_vs_srun": 1.2, "live_call_ms": 20},
        "machine": f"{os.cpu_count()} CPUs; both SLURM nodes on this machine (.ci/slurm)",
    }
    print(json.dumps(result, indent=2))
    if not opts.smoke:
        (HERE / "results" / "slurm.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
