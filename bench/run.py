"""Launch-time benchmark: nblaunch vs torch.multiprocessing (fork) vs accelerate.

Everything runs inside one real IPython kernel, as a notebook user would run
it. Each launcher does the same trivial job (initialise a gloo process group,
one all_reduce, return) and is timed call -> return inside the kernel.
Launchers alternate within every repetition so drift in the machine hits all
of them alike; we report medians and ratios, not absolute seconds.

    python bench/run.py                 # full: 2, 4, 8 ranks, 7 repetitions
    python bench/run.py --smoke         # CI: 2 ranks, 1 repetition
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path

from jupyter_client.manager import KernelManager

HERE = Path(__file__).resolve().parent
LAUNCHERS = ("nblaunch", "torch_fork", "accelerate")

# Defined in the kernel. Each launch_* runs the job on n ranks and returns the
# seconds from call to return.
SETUP = r'''
import os, socket, time
import torch, torch.distributed as dist
import torch.multiprocessing as tmp

def _job():
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()

def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

def _torch_rank(index, n, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      RANK=str(index), WORLD_SIZE=str(n))
    _job()
    dist.destroy_process_group()

def launch_nblaunch(n):
    from nblaunch import notebook_launcher
    t = time.perf_counter()
    out = notebook_launcher(_job, num_processes=n)
    assert out == [float(n)] * n, out
    return time.perf_counter() - t

def launch_torch_fork(n):
    t = time.perf_counter()
    tmp.start_processes(_torch_rank, args=(n, _free_port()), nprocs=n, start_method="fork")
    return time.perf_counter() - t

def _accelerate_rank():
    _job()
    dist.destroy_process_group()

def launch_accelerate(n):
    import contextlib, io
    from accelerate import notebook_launcher
    t = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        notebook_launcher(_accelerate_rank, num_processes=n, use_port=str(_free_port()))
    return time.perf_counter() - t
'''


class BenchKernel:
    def __init__(self):
        self.km = KernelManager(kernel_name="python3")
        self.km.start_kernel()
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=60)

    def run(self, code: str, timeout: float = 300) -> str:
        out, err = [], []

        def hook(msg):
            if msg["msg_type"] == "stream":
                out.append(msg["content"]["text"])
            elif msg["msg_type"] == "error":
                err.append("\n".join(msg["content"]["traceback"]))

        self.kc.execute_interactive(code, output_hook=hook, timeout=timeout)
        if err:
            raise RuntimeError(f"cell failed:\n{code}\n{err[0]}")
        return "".join(out)

    def seconds(self, call: str) -> float:
        print(f"  {call} ...", file=sys.stderr, flush=True)
        text = self.run(f"print('SECONDS', {call})", timeout=float(os.environ.get("BENCH_CALL_TIMEOUT", 120)))
        return float(re.findall(r"SECONDS ([0-9.e-]+)", text)[-1])

    def close(self):
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=True)


def measure(sizes, reps) -> dict:
    kernel = BenchKernel()
    kernel.run(SETUP)
    hangs = []

    def timed(name: str, n: int) -> float:
        """One launch; a competitor that hangs is recorded (NaN) and its
        kernel replaced, so one hang does not end the benchmark."""
        nonlocal kernel
        try:
            return kernel.seconds(f"launch_{name}({n})")
        except TimeoutError:
            if name == "nblaunch":
                raise
            hangs.append(f"{name}({n})")
            print(f"  {name}({n}) hung; restarting the kernel", file=sys.stderr, flush=True)
            kernel.close()
            kernel = BenchKernel()
            kernel.run(SETUP)
            return float("nan")

    try:
        times = {name: {n: [] for n in sizes} for name in LAUNCHERS}
        for n in sizes:
            for name in LAUNCHERS:  # warm-up: imports, first process group
                timed(name, n)
            for rep in range(reps):
                order = LAUNCHERS[rep % 3:] + LAUNCHERS[: rep % 3]
                for name in order:
                    times[name][n].append(timed(name, n))
        times["hangs"] = hangs
        return times
    finally:
        kernel.close()


def measure_relaunch(reps) -> dict:
    """Cold (first, the forkserver starts and imports torch) and warm
    forkserver launches against fork, 2 ranks, in a fresh kernel."""
    kernel = BenchKernel()
    try:
        kernel.run(SETUP)
        kernel.run("def launch_forkserver(n):\n"
                   "    from nblaunch import notebook_launcher\n"
                   "    t = time.perf_counter()\n"
                   "    assert notebook_launcher(_job, num_processes=n, start_method='forkserver') == [float(n)] * n\n"
                   "    return time.perf_counter() - t\n")
        kernel.seconds("launch_nblaunch(2)")  # imports and first process group, paid by fork
        cold = kernel.seconds("launch_forkserver(2)")
        warm, fork = [], []
        for _ in range(reps):
            warm.append(kernel.seconds("launch_forkserver(2)"))
            fork.append(kernel.seconds("launch_nblaunch(2)"))
        return {"cold_forkserver_s": cold, "warm_forkserver_s": statistics.median(warm),
                "fork_s": statistics.median(fork),
                "warm/fork": statistics.median(warm) / statistics.median(fork)}
    finally:
        kernel.close()


FAILURE_SETUP = r'''
import signal as _signal

def _raise_on_1(stamp_dir):
    import torch.distributed as dist
    if dist.get_rank() == 1:
        time.sleep(0.3)
        open(f"{stamp_dir}/t", "w").write(repr(time.time()))
        raise ValueError("boom")
    dist.all_reduce(torch.ones(1))

def _kill_1(stamp_dir):
    import torch.distributed as dist
    if dist.get_rank() == 1:
        time.sleep(0.3)
        open(f"{stamp_dir}/t", "w").write(repr(time.time()))
        os.kill(os.getpid(), _signal.SIGKILL)
    dist.all_reduce(torch.ones(1))

def failure_latency(kind):
    """Seconds from the failure inside rank 1 to the exception in the cell."""
    import tempfile
    from nblaunch import notebook_launcher, WorkerError
    d = tempfile.mkdtemp()
    try:
        notebook_launcher(_raise_on_1 if kind == "raise" else _kill_1, args=(d,), num_processes=2, display="none")
    except WorkerError:
        caught = time.time()
    return caught - float(open(f"{d}/t").read())
'''


def measure_failure(reps) -> dict:
    """Rank raises / rank SIGKILLed -> the cell raises, in a kernel (nblaunch)."""
    kernel = BenchKernel()
    try:
        kernel.run(SETUP + FAILURE_SETUP)
        kernel.seconds("launch_nblaunch(2)")  # warm
        out = {}
        for kind in ("raise", "sigkill"):
            out[kind] = statistics.median(kernel.seconds(f"failure_latency({kind!r})") for _ in range(reps))
        return out
    finally:
        kernel.close()


def summarise(times: dict, sizes) -> dict:
    def median(xs):
        xs = [x for x in xs if x == x]  # without hangs
        return statistics.median(xs) if xs else float("nan")

    med = {name: {n: median(times[name][n]) for n in sizes} for name in LAUNCHERS}
    ratios = {
        n: {
            "nblaunch/torch_fork": med["nblaunch"][n] / med["torch_fork"][n],
            "nblaunch/accelerate": med["nblaunch"][n] / med["accelerate"][n],
        }
        for n in sizes
    }
    return {"median_s": med, "ratios": ratios}


def versions() -> dict:
    import accelerate
    import torch

    import nblaunch

    return {"python": platform.python_version(), "torch": torch.__version__,
            "accelerate": accelerate.__version__, "nblaunch": nblaunch.__version__,
            "machine": f"{platform.machine()}, {_cpus()} CPUs", "date": time.strftime("%Y-%m-%d")}


def _cpus() -> int:
    return len(os.sched_getaffinity(0))


def table(summary: dict, sizes) -> str:
    med, ratios = summary["median_s"], summary["ratios"]
    lines = ["| ranks | nblaunch (s) | torch fork (s) | accelerate (s) | nblaunch / torch fork | nblaunch / accelerate |",
             "|---|---|---|---|---|---|"]
    for n in sizes:
        lines.append(f"| {n} | {med['nblaunch'][n]:.3f} | {med['torch_fork'][n]:.3f} | "
                     f"{med['accelerate'][n]:.3f} | {ratios[n]['nblaunch/torch_fork']:.2f} | "
                     f"{ratios[n]['nblaunch/accelerate']:.2f} |")
    return "\n".join(lines)


def plot(summary: dict, sizes, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name in LAUNCHERS:
        ax.plot(sizes, [summary["median_s"][name][n] for n in sizes], marker="o", label=name)
    ax.set_xlabel("ranks")
    ax.set_ylabel("call -> return, median (s)")
    ax.set_title("Trivial launch in a Jupyter kernel (init, all_reduce, return)")
    ax.set_xticks(list(sizes))
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="2 ranks, 1 repetition (CI)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--out", type=Path, default=HERE / "results")
    opts = parser.parse_args(argv)
    sizes, reps = ([2], 1) if opts.smoke else (opts.sizes, opts.reps)
    times = measure(sizes, reps)
    summary = summarise(times, sizes)
    summary["relaunch_2_ranks"] = measure_relaunch(reps)
    summary["failure_latency_s"] = measure_failure(reps)
    print(table(summary, sizes))
    if times["hangs"]:
        print(f"hung (timed out after {os.environ.get('BENCH_CALL_TIMEOUT', 120)} s, not counted): {times['hangs']}")
    rl = summary["relaunch_2_ranks"]
    print(f"\nnblaunch, 2 ranks: forkserver cold {rl['cold_forkserver_s']:.3f} s, warm "
          f"{rl['warm_forkserver_s']:.3f} s, fork {rl['fork_s']:.3f} s, warm/fork {rl['warm/fork']:.2f}")
    fl = summary["failure_latency_s"]
    print(f"failure -> cell raises (nblaunch, 2 ranks): rank raises {fl['raise']:.3f} s, "
          f"rank SIGKILLed {fl['sigkill']:.3f} s")
    if not opts.smoke:
        opts.out.mkdir(parents=True, exist_ok=True)
        record = {"versions": versions(), "reps": reps, "raw_s": times, **summary}
        (opts.out / "launch.json").write_text(json.dumps(record, indent=2))
        plot(summary, sizes, opts.out / "launch.png")
        print(f"wrote {opts.out / 'launch.json'} and {opts.out / 'launch.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
