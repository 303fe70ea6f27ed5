"""Seconds from a node's loss to the survivors' next step: nblaunch vs torchrun (issue 37), one run.

The scenario: 3 SLURM nodes x 1 rank; each rank loops over steps (an
``all_reduce`` and 0.1 s of "work") and notes the time of its first step in
each generation (``TORCHELASTIC_RESTART_COUNT``). Once every rank is 10
steps in, node n3 is lost: its whole process tree (the node's agent and the
rank under it) gets SIGKILL, as when the machine dies. The measure: from the
kill to the last survivor's first step of the next generation.

* ``nblaunch``: ``notebook_launcher(fn, num_processes=1, cluster="slurm",
  max_restarts=1, min_nodes=2)`` from this process, as a kernel in the
  allocation runs it;
* ``torchrun``: ``srun -N3 python -m torch.distributed.run --nnodes=2:3
  --nproc-per-node=1 --max-restarts=1 --rdzv-backend=c10d`` on the same
  allocation, its rendezvous store hosted by this process (so that the lost
  node is never the store's host), torch's defaults otherwise.

Runs inside an allocation of three nodes (``SLURM_JOB_ID``), or makes one
(``salloc --no-shell -N3 --no-kill``) and gives it back; ``.ci/slurm``
starts three nodes on this machine.

    python bench/recovery.py            # 5 alternating rounds (--rounds N)
    python bench/recovery.py --smoke    # one round
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

HERE = Path(__file__).resolve().parent
LOST = "n3"
GIVE_UP_S = 300.0  # a generation that has not stepped by then is reported as not recovered (inf)
END_WAIT_S = 60.0  # a recovered torchrun's survivors finish their 20 steps within this

STEPS = r'''
import json, os, sys, time
def steps(folder, total=100_000):
    import torch, torch.distributed as dist
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    rank = dist.get_rank()
    t = torch.ones(1)
    for step in range(total):
        dist.all_reduce(t)
        if step in (0, 10):
            with open(os.path.join(folder, f"step{step}-{restart}-{rank}"), "w") as f:
                json.dump({"time": time.time(), "world": dist.get_world_size()}, f)
        if restart == 1 and step == 20:
            return (restart, rank, dist.get_world_size())
        time.sleep(0.1)
if __name__ == "__main__":
    steps(sys.argv[1])
'''


def _wait(folder: Path, prefix: str, n: int, timeout: float) -> list[dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = sorted(folder.glob(prefix + "*"))
        if len(found) >= n:
            time.sleep(0.05)  # written whole
            return [json.loads(p.read_text()) for p in found]
        time.sleep(0.02)
    return []


def _lose_node(command: str) -> float:
    """SIGKILL to the process tree that SLURM's step daemon started on node ``LOST``; the time of the kill."""
    for p in psutil.process_iter(["cmdline"]):
        try:
            if (command in " ".join(p.info["cmdline"] or []) and p.parent().name() == "slurmstepd"
                    and p.environ().get("SLURMD_NODENAME") == LOST):
                tree = [p] + p.children(recursive=True)
                t = time.time()
                for q in tree:
                    q.send_signal(signal.SIGKILL)
                return t
        except psutil.Error:
            pass
    raise RuntimeError(f"no {command} on {LOST}")


def _measure(folder: Path, command: str) -> float:
    """Once every rank is 10 steps in, lose the node; seconds to the survivors' first step after."""
    if not _wait(folder, "step10-0-", 3, GIVE_UP_S):
        raise RuntimeError("the first generation never reached step 10")
    t_lost = _lose_node(command)
    firsts = _wait(folder, "step0-1-", 2, GIVE_UP_S)
    if not firsts:
        return float("inf")
    assert all(f["world"] == 2 for f in firsts), firsts
    return max(f["time"] for f in firsts) - t_lost


def run_nblaunch(job: str) -> float:
    import nblaunch

    namespace: dict = {"__name__": "bench_recovery_steps"}  # not importable: fn travels by value
    exec(STEPS, namespace)
    with tempfile.TemporaryDirectory() as d:
        folder = Path(d)
        out: dict = {}
        watcher = threading.Thread(target=lambda: out.update(s=_measure(folder, "nblaunch.engines.agent")),
                                   daemon=True)
        watcher.start()
        results = nblaunch.notebook_launcher(namespace["steps"], (d,), num_processes=1, cluster="slurm",
                                             max_restarts=1, min_nodes=2, display="none")
        watcher.join()
        assert sorted(results) == [(1, 0, 2), (1, 1, 2)], results
        return out["s"]


def run_torchrun(job: str, addr: str) -> float:
    import torch.distributed as dist

    from nblaunch.engines.slurm import without_slurm_vars

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    with tempfile.TemporaryDirectory() as d:
        script = Path(d) / "steps.py"
        script.write_text(STEPS)
        folder = Path(d) / "marks"
        folder.mkdir()
        cmd = ["srun", f"--jobid={job}", "--overlap", "-N3", "--ntasks-per-node=1", "--kill-on-bad-exit=0",
               sys.executable, "-m", "torch.distributed.run", "--nnodes=2:3", "--nproc-per-node=1",
               "--max-restarts=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{store.port}",
               "--rdzv-conf=is_host=0", "--rdzv-id=bench", f"--local-addr={addr}", str(script), str(folder)]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(Path(d) / "log", "w"),
                                env=without_slurm_vars(os.environ), start_new_session=True)
        try:
            return _measure(folder, "torch.distributed.run")
        finally:
            try:
                proc.wait(END_WAIT_S)
            except subprocess.TimeoutExpired:  # not recovered: srun ends its step (SIGINT twice: srun's rule)
                for sig in (signal.SIGINT, signal.SIGINT, signal.SIGKILL):
                    os.killpg(proc.pid, sig)
                    time.sleep(0.5)
                proc.wait()


def _allocation() -> tuple[str, bool]:
    job = os.environ.get("SLURM_JOB_ID")
    if job:
        return job, False
    out = subprocess.run(["salloc", "--no-shell", "-N3", "--no-kill", "--job-name=nblaunch-bench"],
                         capture_output=True, text=True, timeout=120)
    found = re.search(r"job allocation (\d+)", out.stdout + out.stderr)
    if not found:
        sys.exit(f"no allocation of 3 nodes: {out.stdout}{out.stderr}")
    return found.group(1), True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="one round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=str(HERE / "results" / "recovery.json"))
    opts = parser.parse_args()
    job, ours = _allocation()
    os.environ["SLURM_JOB_ID"] = job
    rounds = 1 if opts.smoke else opts.rounds
    times: dict[str, list[float]] = {"nblaunch": [], "torchrun": []}
    try:
        for i in range(rounds):
            for name in (("nblaunch", "torchrun") if i % 2 == 0 else ("torchrun", "nblaunch")):
                s = run_nblaunch(job) if name == "nblaunch" else run_torchrun(job, "127.0.0.1")
                times[name].append(round(s, 2))
                print(f"round {i + 1}: {name}: {s:.1f} s from the loss of {LOST} to the survivors' next step",
                      flush=True)
    finally:
        if ours:
            subprocess.run(["scancel", job], timeout=30)
    med = {k: statistics.median(v) for k, v in times.items()}
    for k, v in times.items():  # JSON has no infinity: a round that never recovered is null
        times[k] = [None if x == float("inf") else x for x in v]
    result = {"scenario": "3 SLURM nodes x 1 rank (gloo), node n3's process tree SIGKILLed 10 steps in; seconds from "
                          "the kill to the last survivor's first step of the next generation",
              "anchor": "torchrun --nnodes=2:3 --max-restarts=1 --rdzv-backend=c10d (torch defaults)",
              "seconds": times, "median_s": {k: (None if v == float("inf") else v) for k, v in med.items()},
              "give_up_s": GIVE_UP_S,
              "ratio_torchrun_over_nblaunch": (round(med["torchrun"] / med["nblaunch"], 2)
                                               if med["torchrun"] != float("inf") else None),
              "machine": f"{os.cpu_count()} CPUs", "python": sys.version.split()[0],
              "torch": __import__("torch").__version__, "date": time.strftime("%Y-%m-%d")}
    Path(opts.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
