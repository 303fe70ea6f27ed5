"""Seconds from a node's freeze to the survivors' next step: nblaunch vs torchrun (issue 47), one run.

bench/recovery.py's scenario (3 SLURM nodes x 1 rank, an ``all_reduce`` and 0.1 s a step), but
node n3 is frozen, not killed: its slurmd and the launch's whole process tree there SIGSTOPped 10
steps in, as a hung machine or a partition look: nothing closes. Measured: from the freeze to the
last survivor's first step of the next generation; a wait past ``--cap`` seconds is reported as
"more than N s" (null in the JSON). n3 is thawed after each round and must leave nothing.

* ``nblaunch``: ``notebook_launcher(..., cluster="slurm", max_restarts=1, min_nodes=2)``, the
  heartbeats at their default (``NBLAUNCH_NODE_LOST_AFTER`` or 10 s);
* ``torchrun``: ``--nnodes=2:3 --max-restarts=1 --rdzv-backend=c10d``, torch's defaults (the
  survivors wait in gloo's all_reduce for the process group's timeout, 30 minutes).

* on three Ray nodes (bench/lost_node_ray.py, ``--engines`` with ``ray``): ``nblaunch`` with
  ``cluster=nblaunch.Ray(nodes=3)`` against Ray Train's ``TorchTrainer`` (elastic, 2 to 3
  workers, ``max_failures=1``), the third Ray node frozen whole.

    python bench/lost_node.py [--cap 120] [--rounds 1] [--engines slurm,ray]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "tests")]

import recovery  # noqa: E402 - the scenario and both runners
import slurm_cluster  # noqa: E402 - the three-node lock: n3's slurmd is every allocation's

_frozen: list[int] = []


def _freeze_node(command: str) -> float:
    """SIGSTOP to n3's slurmd and to the process tree its step daemon started there; the time of it."""
    slurmd = Path(os.environ.get("NBLAUNCH_SLURM_DIR", "/tmp/nblaunch-slurm")) / f"slurmd-{recovery.LOST}.pid"
    for p in psutil.process_iter(["cmdline"]):
        try:
            if (command in " ".join(p.info["cmdline"] or []) and p.parent().name() == "slurmstepd"
                    and p.environ().get("SLURMD_NODENAME") == recovery.LOST):
                _frozen[:] = [int(slurmd.read_text())] + [q.pid for q in [p] + p.children(recursive=True)]
                t = time.time()
                for pid in _frozen:
                    os.kill(pid, signal.SIGSTOP)
                return t
        except (psutil.Error, OSError, ValueError):
            pass
    raise RuntimeError(f"no {command} on {recovery.LOST}")


def _measure(folder: Path, command: str) -> float:
    """recovery._measure with the cap on the survivors' wait only (their start may take minutes)."""
    if not recovery._wait(folder, "step10-0-", 3, 300.0):  # noqa: SLF001
        raise RuntimeError("the first generation never reached step 10")
    t_frozen = _freeze_node(command)
    firsts = recovery._wait(folder, "step0-1-", 2, CAP_S[0])  # noqa: SLF001
    return max(f["time"] for f in firsts) - t_frozen if firsts else float("inf")


CAP_S = [120.0]


def _thaw() -> None:
    for pid in _frozen:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    _frozen.clear()


def _ratio(anchor: "list | None", ours: "list | None", cap: float) -> "str | None":
    """The anchor's median over ours, "at least" when the anchor hit the cap."""
    if not anchor or not ours or None in ours:
        return None
    mid = sorted(ours)[len(ours) // 2]
    waited = sorted(cap if s is None else s for s in anchor)[len(anchor) // 2]
    return f"{'at least ' if None in anchor else ''}{waited / mid:.1f}x"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cap", type=float, default=120.0, help="seconds an anchor is waited for")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--engines", default="slurm,ray", help="slurm (vs torchrun), ray (vs Ray Train), or both")
    parser.add_argument("--out", default=str(HERE / "results" / "lost_node.json"))
    opts = parser.parse_args()
    recovery._measure = _measure  # noqa: SLF001 - the same scenario, the node frozen instead
    CAP_S[0] = opts.cap
    engines = opts.engines.split(",")
    times: dict[str, list] = {"nblaunch": [], "torchrun": []} if "slurm" in engines else {}
    for i in range(opts.rounds if "ray" in engines else 0):
        import lost_node_ray

        for name, s in lost_node_ray.measure(opts.cap).items():
            times.setdefault(f"{name} (Ray nodes)", []).append(None if s == float("inf") else round(s, 2))
            said = f"{s:.1f} s" if s != float("inf") else f"more than {opts.cap:.0f} s"
            print(f"round {i + 1}: {name} on 3 Ray nodes: {said} from the freeze to the survivors' next step", flush=True)
    with slurm_cluster.losing_a_node() if "slurm" in engines else contextlib.nullcontext():
        job, ours = recovery._allocation() if "slurm" in engines else ("", False)  # noqa: SLF001
        os.environ["SLURM_JOB_ID"] = job
        try:
            for i in range(opts.rounds if "slurm" in engines else 0):
                for name in ("nblaunch", "torchrun"):
                    try:
                        s = recovery.run_nblaunch(job) if name == "nblaunch" else recovery.run_torchrun(job, "127.0.0.1")
                    finally:
                        _thaw()
                    times[name].append(None if s == float("inf") else round(s, 2))
                    said = f"{s:.1f} s" if s != float("inf") else f"more than {opts.cap:.0f} s"
                    print(f"round {i + 1}: {name}: {said} from the freeze of {recovery.LOST} to the survivors' next step",
                          flush=True)
        finally:
            if ours:
                subprocess.run(["scancel", job], timeout=30)
    result = {"scenario": "3 SLURM nodes x 1 rank (gloo); node n3's slurmd and process tree SIGSTOPped 10 steps in; "
                          "seconds from the freeze to the last survivor's first step of the next generation; "
                          "the same on 3 Ray nodes, the third's raylet and everything under it SIGSTOPped",
              "anchors": ["torchrun --nnodes=2:3 --max-restarts=1 --rdzv-backend=c10d (torch defaults)",
                          "Ray Train TorchTrainer, ScalingConfig(num_workers=(2, 3)), FailureConfig(max_failures=1)"],
              "seconds": times, "cap_s": opts.cap,
              "anchor_over_nblaunch": {anchor: _ratio(times.get(anchor), times.get(ours), opts.cap)
                                       for anchor, ours in (("torchrun", "nblaunch"),
                                                            ("Ray Train (Ray nodes)", "nblaunch (Ray nodes)"))},
              "lost_after_s": float(os.environ.get("NBLAUNCH_NODE_LOST_AFTER") or 10),
              "machine": f"{os.cpu_count()} CPUs", "python": sys.version.split()[0],
              "torch": __import__("torch").__version__, "date": time.strftime("%Y-%m-%d")}
    Path(opts.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
