"""Two versions of nblaunch on the same scenarios, interleaved in one run.

A change that should not move the numbers (a refactor) is checked here
against the commit before it. Each round runs both versions one after the
other, in fresh kernels (and, with ``--slurm``, on the SLURM nodes), so
load from anything else on the machine falls on both alike. Scenarios,
median per version:

* launch cost: ``notebook_launcher(f, num_processes=n)`` for n in ``--sizes``,
  in a kernel that has imported torch (after one warm-up launch);
* failure verdict: rank 1 raises; the call to the ``WorkerError``;
* with ``--slurm``: a 2-node x 2-rank launch with ``cluster="slurm"``, from
  a process that has imported torch (``.ci/slurm``'s nodes), and a call on
  live ranks there (``nblaunch.start(2, cluster="slurm")``, median of 30).

    python bench/ab.py REV [--sizes 2 4 8] [--rounds 5] [--reps 10] [--slurm]

REV (e.g. a commit) is checked out in a temporary git worktree; the other
version is this working tree. Writes bench/results/ab.json.
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
import textwrap
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

KERNEL_CODE = """
import json, statistics, time, torch
from nblaunch import notebook_launcher, WorkerError
def f():
    return 1
def fail():
    import torch.distributed as dist
    if dist.get_rank() == 1:
        raise ValueError("boom")
    dist.barrier()
notebook_launcher(f, num_processes=2, display="none")
out = {{}}
for n in {sizes}:
    ts = []
    for _ in range({reps}):
        t = time.perf_counter(); notebook_launcher(f, num_processes=n, display="none"); ts.append(time.perf_counter() - t)
    out[f"launch {{n}} ranks (s)"] = statistics.median(ts)
ts = []
for _ in range({reps}):
    t = time.perf_counter()
    try:
        notebook_launcher(fail, num_processes=2, display="none")
    except WorkerError:
        ts.append(time.perf_counter() - t)
out["failure verdict, 2 ranks (s)"] = statistics.median(ts)
print("AB " + json.dumps(out))
"""

SLURM_CODE = """
import json, time, torch
import nblaunch
def f():
    import torch, torch.distributed as dist
    t = torch.ones(1); dist.all_reduce(t); return t.item()
t = time.perf_counter()
out = nblaunch.notebook_launcher(f, num_processes=2, cluster="slurm", display="none")
assert list(out) == [4.0] * 4, out
took = time.perf_counter() - t
with nblaunch.start(2, cluster="slurm", display="none") as ranks:
    calls = []
    for _ in range(30):
        t = time.perf_counter(); ranks.run(f); calls.append(time.perf_counter() - t)
calls.sort()
print("AB " + json.dumps({"SLURM 2 nodes x 2 ranks (s)": took, "SLURM live call, median of 30 (s)": calls[15]}))
"""


def _in_kernel(tree: Path, code: str) -> dict:
    from jupyter_client.manager import start_new_kernel

    env = dict(os.environ, PYTHONPATH=str(tree))
    km, kc = start_new_kernel(kernel_name="python3", env=env, cwd=str(tree))
    text: list[str] = []

    def hook(msg):
        if msg["msg_type"] == "stream":
            text.append(msg["content"]["text"])
        elif msg["msg_type"] == "error":
            text.append("\n".join(msg["content"]["traceback"]))

    try:
        kc.execute_interactive(code, output_hook=hook, timeout=600)
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    return _parse("".join(text))


def _in_process(tree: Path, code: str, job: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree), SLURM_JOB_ID=job)
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=tree, capture_output=True, text=True, timeout=600)
    return _parse(done.stdout + done.stderr)


def _allocate() -> str:
    """Two nodes with a CPU per rank, as bench/slurm.py asks (given back at the end)."""
    out = subprocess.run(["salloc", "--no-shell", "--nodes=2", "--ntasks-per-node=2", "--job-name=nblaunch-ab"],
                         capture_output=True, text=True, check=True)
    return re.search(r"job allocation (\d+)", out.stdout + out.stderr).group(1)


def _parse(text: str) -> dict:
    for line in text.splitlines():
        if line.startswith("AB "):
            return json.loads(line[3:])
    raise RuntimeError(f"no result; output:\n{text[-3000:]}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("rev", help="the version to compare this working tree with (a commit)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--slurm", action="store_true", help="also a launch on the SLURM nodes (.ci/slurm)")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "ab.json")
    opts = parser.parse_args()
    rev = subprocess.run(["git", "rev-parse", "--short", opts.rev], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.strip()
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()
    job = _allocate() if opts.slurm else ""
    with tempfile.TemporaryDirectory(prefix="nblaunch-ab-") as tmp:
        old = Path(tmp) / "old"
        subprocess.run(["git", "worktree", "add", "-q", "--detach", str(old), rev], cwd=ROOT, check=True)
        try:
            sides = {"before": old, "now": ROOT}
            got: dict[str, dict[str, list]] = {side: {} for side in sides}
            code = KERNEL_CODE.format(sizes=opts.sizes, reps=opts.reps)
            for round_ in range(opts.rounds):
                order = list(sides) if round_ % 2 == 0 else list(reversed(sides))
                for side in order:
                    results = _in_kernel(sides[side], code)
                    if opts.slurm:
                        results.update(_in_process(sides[side], SLURM_CODE, job))
                    for k, v in results.items():
                        got[side].setdefault(k, []).append(v)
                    print(f"round {round_ + 1} {side}: " + ", ".join(f"{k} {v:.4f}" for k, v in results.items()),
                          file=sys.stderr, flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(old)], cwd=ROOT)
            if job:
                subprocess.run(["scancel", job], capture_output=True)
    medians = {side: {k: statistics.median(v) for k, v in got[side].items()} for side in got}
    summary = {"before": rev, "now": f"{head} + working tree", "rounds": opts.rounds, "reps": opts.reps,
               "median": medians, "now/before": {k: medians["now"][k] / medians["before"][k] for k in medians["now"]},
               "all": got, "machine": f"{os.cpu_count()} CPUs"}
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    opts.out.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"| scenario | {rev} | now | now / {rev} |\n|---|---|---|---|")
    for k, ratio in summary["now/before"].items():
        print(f"| {k} | {medians['before'][k]:.4f} | {medians['now'][k]:.4f} | {ratio:.2f} |")
    print(textwrap.dedent(f"""
        wrote {opts.out}"""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
