"""Ranks on a Spark application's executors: nblaunch vs pyspark's TorchDistributor (issue 49), one run.

The scenario: one ``local-cluster[2,1,1024]`` session (two executor JVMs on
this machine, Java 17, pip's pyspark), 2 ranks (one per executor); each rank
joins a gloo process group, does one ``all_reduce`` and returns a value.

* ``TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(fn)``;
* ``nblaunch.notebook_launcher(fn, num_processes=1, cluster="spark")``.

Measured from the call, in the same session, alternating: time until every
rank is running the user's function (each rank leaves ``time.time()`` in a
file as it starts: one machine), and until the result is back in the caller
(the first round of each is the cold one, reported apart). Then failures,
alternating: rank 1 raises, noting the time first; the time from the raise
to the exception in the caller. Goals: a warm launch at most half of
TorchDistributor's, a failure named within 1 s of the raise.

    python bench/spark.py            # 3 rounds and 3 failures of each, a few minutes
    python bench/spark.py --smoke    # one round, one failure of nblaunch (CI)
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


def rank_fn(folder: str, fail: bool = False):
    import os
    import time

    import torch
    import torch.distributed as dist

    started = time.time()
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))
    Path(folder, f"start{rank}").write_text(repr(started))
    if fail and rank == 1:
        Path(folder, "raised").write_text(repr(time.time()))
        raise ValueError("a failing rank")
    if not dist.is_initialized():
        dist.init_process_group("gloo")  # TorchDistributor sets the variables; its fn makes the group
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def _one(kind: str, run, fail: bool = False) -> dict:
    folder = tempfile.mkdtemp(prefix=f"bench-spark-{kind}-")
    t0 = time.time()
    error = None
    try:
        run(folder, fail)
    except Exception as exc:  # noqa: BLE001 - the failure round's
        error = exc
    t1 = time.time()
    starts = [float(p.read_text()) for p in Path(folder).glob("start*")]
    out = {"kind": kind, "to_result_s": t1 - t0, "to_every_first_step_s": max(starts) - t0 if starts else None}
    if fail:
        raised = Path(folder, "raised")
        out["failed_with"] = type(error).__name__ if error else None
        out["raise_to_cell_s"] = t1 - float(raised.read_text()) if raised.exists() else None
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--failures", type=int, default=3, help="failure rounds of each, alternating")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default=None)
    opts = ap.parse_args()
    rounds = 1 if opts.smoke else opts.rounds
    os.environ["PYSPARK_PYTHON"] = sys.executable
    from pyspark.ml.torch.distributor import TorchDistributor
    from pyspark.sql import SparkSession

    import nblaunch

    spark = (SparkSession.builder.master("local-cluster[2,1,1024]").config("spark.ui.enabled", "false")
             .config("spark.executor.memory", "900m").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")

    def td(folder, fail):
        return TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(rank_fn, folder, fail)

    def nb(folder, fail):
        return nblaunch.notebook_launcher(rank_fn, (folder, fail), num_processes=1, cluster="spark", display="none")

    rows = []
    try:
        for i in range(rounds + 1):  # round 0: the cold launch of each
            for kind, run in (("torch_distributor", td), ("nblaunch", nb)) if i % 2 == 0 else (
                    ("nblaunch", nb), ("torch_distributor", td)):
                rows.append({"round": i, **_one(kind, run)})
                print(json.dumps(rows[-1]), flush=True)
        both = (("nblaunch", nb), ("torch_distributor", td))
        for i in range(1 if opts.smoke else opts.failures):
            for kind, run in both[:1] if opts.smoke else both if i % 2 == 0 else both[::-1]:
                rows.append({"round": "failure", **_one(kind, run, fail=True)})
                print(json.dumps(rows[-1]), flush=True)
    finally:
        spark.stop()
    warm = {k: [r for r in rows if r["kind"] == k and isinstance(r["round"], int) and r["round"] > 0]
            for k in ("nblaunch", "torch_distributor")}
    summary = {}
    for what in ("to_every_first_step_s", "to_result_s"):
        nb_s = statistics.median(r[what] for r in warm["nblaunch"])
        td_s = statistics.median(r[what] for r in warm["torch_distributor"])
        summary[what] = {"nblaunch": round(nb_s, 2), "torch_distributor": round(td_s, 2), "ratio": round(nb_s / td_s, 2)}
    failed = {k: [r["raise_to_cell_s"] for r in rows if r["kind"] == k and r["round"] == "failure"
                  and r.get("raise_to_cell_s") is not None] for k in ("nblaunch", "torch_distributor")}
    summary["raise_to_cell_s"] = {k: round(statistics.median(v), 2) for k, v in failed.items() if v}
    print(json.dumps({"medians": summary}), flush=True)
    if opts.out:
        Path(opts.out).write_text(json.dumps({"rows": rows, "medians": summary}, indent=1))


if __name__ == "__main__":
    main()
