"""What a large result costs the caller: rank 0 returns a 512 MiB state_dict
(8 float32 tensors of 64 MiB), the caller then reads all of it.

Each way runs in a fresh Python process (the "kernel"), which samples its own
resident memory every 2 ms; reported: the peak above the baseline taken just
before the call, and the time from the call to having the whole result.

* nblaunch: ``notebook_launcher`` returns it (tensors travel through torch's
  shared-memory reductions);
* save + load: the rank ``torch.save``s it to a file and returns the path;
  the caller ``torch.load``s it (the usual workaround);
* save + load(mmap=True): the same, loaded memory-mapped;
* torch.multiprocessing + queue: ``start_processes`` with the rank putting
  the state_dict on a ``SimpleQueue`` (torch shares tensors through shared
  memory too). accelerate's ``notebook_launcher`` returns nothing, so it has
  no row.

    python bench/result_transfer.py           # 3 repetitions, medians
    python bench/result_transfer.py --smoke   # 64 MiB, once
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import textwrap
from pathlib import Path

HERE = Path(__file__).resolve().parent

COMMON = """
import os, sys, tempfile, threading, time, json
import psutil, torch
MB = {mb}
me = psutil.Process()
peak = [0]
def sample():
    while True:
        peak[0] = max(peak[0], me.memory_info().rss)
        time.sleep(0.002)
threading.Thread(target=sample, daemon=True).start()

def make_state():
    import torch
    return {{f"layer{{i}}.weight": torch.ones(MB << 15) for i in range(8)}}   # 8 x MB/8 MiB

def touch(sd):
    return sum(float(t[:: 1 << 10].sum()) for t in sd.values())   # read every page
"""

WAYS = {
    "nblaunch": """
from nblaunch import notebook_launcher
def fn():
    import torch.distributed as dist
    return make_state() if dist.get_rank() == 0 else None
notebook_launcher(fn, num_processes=2, display="none")   # warm-up
time.sleep(0.2); base = me.memory_info().rss; peak[0] = base
t = time.perf_counter()
sd = notebook_launcher(fn, num_processes=2, display="none")[0]
total = touch(sd)
""",
    "save + load": """
from nblaunch import notebook_launcher
def fn(path):
    import torch, torch.distributed as dist
    if dist.get_rank() == 0:
        torch.save(make_state(), path)
    return path
path = os.path.join(tempfile.mkdtemp(), "sd.pt")
notebook_launcher(fn, args=(path,), num_processes=2, display="none")
time.sleep(0.2); base = me.memory_info().rss; peak[0] = base
t = time.perf_counter()
p = notebook_launcher(fn, args=(path,), num_processes=2, display="none")[0]
sd = torch.load(p{mmap})
total = touch(sd)
""",
    "torch.multiprocessing + queue": """
import torch.multiprocessing as tmp
def rank(i, q):
    if i == 0:
        q.put(make_state())
        time.sleep(2)   # keep the storages' owner alive while the caller maps them
q = tmp.get_context("fork").SimpleQueue()
time.sleep(0.2); base = me.memory_info().rss; peak[0] = base
t = time.perf_counter()
ctx = tmp.start_processes(rank, args=(q,), nprocs=2, start_method="fork", join=False)
sd = q.get()
total = touch(sd)
""",
}


def run(way: str, mb: int) -> dict:
    body = WAYS["save + load"].format(mmap=", mmap=True") if way == "save + load(mmap=True)" else \
        WAYS[way].format(mmap="")
    code = COMMON.format(mb=mb) + textwrap.dedent(body) + textwrap.dedent("""
        elapsed = time.perf_counter() - t
        time.sleep(0.01)
        print(json.dumps({"seconds": elapsed, "peak_mib": (peak[0] - base) / 2**20}))
        if "ctx" in globals():
            ctx.join()
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    if out.returncode:
        raise RuntimeError(f"{way} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true")
    opts = parser.parse_args(argv)
    mb, reps = (64, 1) if opts.smoke else (512, 3)
    ways = ["nblaunch", "save + load", "save + load(mmap=True)", "torch.multiprocessing + queue"]
    rows = {}
    for way in ways:
        runs = [run(way, mb) for _ in range(reps)]
        rows[way] = {"seconds": statistics.median(r["seconds"] for r in runs),
                     "peak_mib": statistics.median(r["peak_mib"] for r in runs), "runs": runs}
        print(f"{way:32s} {rows[way]['seconds']:6.2f} s   peak +{rows[way]['peak_mib']:7.0f} MiB "
              f"({rows[way]['peak_mib'] / mb:.2f}x the {mb} MiB result)", flush=True)
    if not opts.smoke:
        (HERE / "results").mkdir(exist_ok=True)
        (HERE / "results" / "result_transfer.json").write_text(json.dumps({"mib": mb, "ways": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
