"""Background runs (``nblaunch.submit``, issue 38) in a real kernel, one run.

1. Submit -> return: how long the cell is held by ``submit`` (the goal:
   under 1 s), for a run in this kernel and a detached one, against the
   anchor: ``notebook_launcher``'s call -> return of the same trivial job
   (a gloo group, one ``all_reduce``).
2. Call -> results of that trivial job: a background run (its ranks from
   the forkserver) against ``notebook_launcher`` (forked by the zygote): what
   being safe beside other threads costs per launch.
3. Two runs side by side against the same two as sequential launches: 2
   runs x 2 ranks, each run 10 steps of (``wait`` s of waiting, standing in
   for reading data, then ``work`` 256x256 matmuls and an ``all_reduce``);
   ``io`` (mostly waiting) and ``cpu`` (mostly computing, 1 thread per rank)
   variants. Wall time from the first call to both results.

Alternating within each repetition; medians. Writes
``bench/results/background.json``.

    python bench/background.py            # about 2 minutes on 2 CPUs
    python bench/background.py --smoke    # one repetition (CI)
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from run import BenchKernel  # noqa: E402

SETUP = r'''
import os, time
import torch, torch.distributed as dist
import nblaunch

def trivial():
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()

def steps(wait, work):
    torch.set_num_threads(1)
    a = torch.randn(256, 256)
    for _ in range(10):
        time.sleep(wait)
        for _ in range(work):  # a fixed amount of compute: it takes longer on a busier machine
            a = (a @ a).tanh()
        dist.all_reduce(torch.ones(1))
    return 0

def submit_return(detach):
    t = time.perf_counter()
    run = nblaunch.submit(trivial, num_processes=2, display="none", detach=detach)
    took = time.perf_counter() - t
    run.result(timeout=120)
    run.forget()
    return took

def launch_return():
    t = time.perf_counter()
    nblaunch.notebook_launcher(trivial, num_processes=2, display="none")
    return time.perf_counter() - t

def background_call():
    t = time.perf_counter()
    run = nblaunch.submit(trivial, num_processes=2, display="none")
    run.result(timeout=120)
    took = time.perf_counter() - t
    run.forget()
    return took

def side_by_side(wait, work):
    t = time.perf_counter()
    runs = [nblaunch.submit(steps, args=(wait, work), num_processes=2, display="none") for _ in range(2)]
    for run in runs:
        run.result(timeout=300)
        run.forget()
    return time.perf_counter() - t

def sequential(wait, work):
    t = time.perf_counter()
    for _ in range(2):
        nblaunch.notebook_launcher(steps, args=(wait, work), num_processes=2, display="none")
    return time.perf_counter() - t
'''

VARIANTS = {"io": (0.1, 5), "cpu": (0.0, 150)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--reps", type=int, default=7)
    opts = parser.parse_args()
    reps = 1 if opts.smoke else opts.reps
    kernel = BenchKernel()
    raw: dict = {}
    try:
        runs_dir = tempfile.mkdtemp(prefix="nblaunch-bench-runs-")
        kernel.run(f"import os\nos.environ['NBLAUNCH_RUNS_DIR'] = {runs_dir!r}\n" + SETUP)
        warm = ["launch_return()", "background_call()", "submit_return(True)"]
        for call in warm:  # the forkserver, torch in it, the first supervisor: not counted
            kernel.seconds(call)
        calls = {"submit_return": "submit_return(False)", "submit_return_detached": "submit_return(True)",
                 "launch_return": "launch_return()", "background_call": "background_call()"}
        for name, (wait, work) in VARIANTS.items():
            calls[f"side_by_side_{name}"] = f"side_by_side({wait}, {work})"
            calls[f"sequential_{name}"] = f"sequential({wait}, {work})"
        for _ in range(reps):
            for name, call in calls.items():
                raw.setdefault(name, []).append(kernel.seconds(call))
    finally:
        kernel.close()
    med = {name: statistics.median(times) for name, times in raw.items()}
    ratios = {
        "submit_return / launch_return": med["submit_return"] / med["launch_return"],
        "submit_return_detached / launch_return": med["submit_return_detached"] / med["launch_return"],
        "background_call / launch_return": med["background_call"] / med["launch_return"],
        **{f"side_by_side_{v} / sequential_{v}": med[f"side_by_side_{v}"] / med[f"sequential_{v}"]
           for v in VARIANTS},
    }
    result = {"medians_s": med, "ratios": ratios, "raw_s": raw, "reps": reps, "variants": VARIANTS,
              "machine": {"cpus": __import__("os").cpu_count(), "python": platform.python_version()},
              "when": time.strftime("%Y-%m-%d %H:%M:%S")}
    if not opts.smoke:
        (HERE / "results" / "background.json").write_text(json.dumps(result, indent=2))
    print(json.dumps({"medians_s": med, "ratios": ratios}, indent=2))


if __name__ == "__main__":
    main()
