"""What one full garbage collection in a forked rank costs it, in a kernel
that holds a notebook's usual objects: nblaunch against torch's
``start_processes`` (fork) and accelerate's ``notebook_launcher``, in one
real kernel, alternating.

A forked rank shares the kernel's pages until it writes to them, and a full
collection (``gc.collect()``, or Python's own once enough objects have been
made: any real training loop gets there) writes to every object it visits.
Without care, each rank then copies the kernel's whole heap of Python
objects. nblaunch's ranks freeze what they inherit (``gc.freeze()`` in the
zygote and at a rank's start), so their collections visit only their own
objects.

    python bench/gc_copy.py            # 4 ranks, 5 rounds -> results/gc_copy.json
    python bench/gc_copy.py --smoke    # 2 ranks, 1 round (CI)

Measured per rank: the growth of its own memory (USS) over one
``gc.collect()``, and that collection's time.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from run import BenchKernel, versions

HERE = Path(__file__).resolve().parent
LAUNCHERS = ("nblaunch", "torch_fork", "accelerate")

# A notebook's kernel: the libraries of a fine-tuning notebook imported, a
# tiny model built from its config, and some data of the notebook's own.
SETUP = r'''
import contextlib, gc, io, json, os, socket, tempfile, time
import psutil, torch, torch.multiprocessing as tmp
import transformers, pytorch_lightning, accelerate
from accelerate import notebook_launcher as accelerate_launcher
from nblaunch import notebook_launcher
model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=1000))
rows = [{"id": i, "text": f"example {i}", "label": i % 7} for i in range(200_000)]

def _collect(out, rank):
    me = psutil.Process()
    before = me.memory_full_info().uss
    t = time.perf_counter()
    gc.collect()
    took = time.perf_counter() - t
    grew = me.memory_full_info().uss - before
    with open(os.path.join(out, str(rank)), "w") as f:
        json.dump([grew, took], f)

def _nblaunch_rank(out):
    _collect(out, int(os.environ["RANK"]))

def _torch_rank(i, out):
    _collect(out, i)

def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

def one(launcher, n):
    out = tempfile.mkdtemp()
    if launcher == "nblaunch":
        notebook_launcher(_nblaunch_rank, args=(out,), num_processes=n, init_process_group=False, display="none")
    elif launcher == "torch_fork":
        tmp.start_processes(_torch_rank, args=(out,), nprocs=n, start_method="fork")
    else:
        with contextlib.redirect_stdout(io.StringIO()):
            accelerate_launcher(_nblaunch_rank, args=(out,), num_processes=n, use_port=str(_free_port()))
    readings = [json.load(open(os.path.join(out, str(r)))) for r in range(n)]
    print("READINGS", json.dumps(readings))

print("OBJECTS", len(gc.get_objects()))
'''


def measure(n: int, rounds: int) -> dict:
    kernel = BenchKernel()
    try:
        objects = int(kernel.run(SETUP).split("OBJECTS")[-1].split()[0])
        for name in LAUNCHERS:  # warm-up: a forkserver, file caches
            kernel.run(f"one({name!r}, 2)")
        raw: dict = {name: [] for name in LAUNCHERS}
        for r in range(rounds):
            order = LAUNCHERS[r % 3:] + LAUNCHERS[:r % 3]
            for name in order:
                text = kernel.run(f"one({name!r}, {n})")
                raw[name] += json.loads(text.split("READINGS")[-1])
                print(f"  round {r + 1}: {name}", file=sys.stderr, flush=True)
    finally:
        kernel.close()
    med = {name: {"copied_mib": statistics.median(g for g, _ in v) / 2**20,
                  "collect_ms": 1000 * statistics.median(t for _, t in v)} for name, v in raw.items()}
    return {"ranks": n, "rounds": rounds, "kernel_objects": objects, "raw": raw, "median_per_rank": med,
            "nblaunch/torch_fork copied": med["nblaunch"]["copied_mib"] / med["torch_fork"]["copied_mib"],
            "nblaunch/torch_fork collect": med["nblaunch"]["collect_ms"] / med["torch_fork"]["collect_ms"],
            "versions": versions()}


def table(result: dict) -> str:
    lines = [f"| one `gc.collect()` in a rank ({result['kernel_objects']:,} objects in the kernel) "
             "| copied into the rank (MiB, median) | the collection's time (ms, median) |", "|---|---|---|"]
    for name, m in result["median_per_rank"].items():
        lines.append(f"| {name} | {m['copied_mib']:.1f} | {m['collect_ms']:.1f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="2 ranks, 1 round (CI)")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=str(HERE / "results"))
    opts = parser.parse_args(argv)
    n, rounds = (2, 1) if opts.smoke else (opts.ranks, opts.rounds)
    result = measure(n, rounds)
    print(table(result))
    print(f"\nnblaunch / torch fork: copied {result['nblaunch/torch_fork copied']:.3f}, "
          f"collection time {result['nblaunch/torch_fork collect']:.3f}")
    if not opts.smoke:
        Path(opts.out).mkdir(parents=True, exist_ok=True)
        (Path(opts.out) / "gc_copy.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
