"""Launch-time benchmark: nblaunch vs torch.multiprocessing (fork) vs accelerate.

Everything runs inside one real IPython kernel, as a notebook user would run
it. Each launcher does the same trivial job (initialise a gloo process group,
one all_reduce, return) and is timed call -> return inside the kernel.
Launchers alternate within every repetition so drift in the machine hits all
of them alike; we report medians and ratios, not absolute seconds.

    python bench/run.py                 # full: 2, 4, 8 ranks, 15 repetitions
    python bench/run.py --smoke         # CI: 2 ranks, 1 repetition, a small tensor
    python bench/run.py --parts slope first   # only those parts, into results/slope.json

The per-added-rank sweep (bench/slope.py): 2 to 256 ranks, with and
without a process group, a least-squares slope per launcher.

Besides launch time: relaunch (cold and warm forkserver), failure latency,
spawn (where each launcher can run it at all) and memory (4 ranks given a
1 GiB tensor, under each launcher and start method; and forked ranks' own
memory at each rank count, against torch fork's).
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

import slope

HERE = Path(__file__).resolve().parent
LAUNCHERS = ("nblaunch", "torch_fork", "accelerate")
CALL_TIMEOUT_S = float(os.environ.get("BENCH_CALL_TIMEOUT", 120))  # one timed call, then it counts as hung

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
        text = self.run(f"print('SECONDS', {call})", timeout=CALL_TIMEOUT_S)
        return float(re.findall(r"SECONDS ([0-9.e-]+)", text)[-1])

    def close(self):
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=True)


class GuardedKernel:
    """A bench kernel (``setup`` run in it) for launchers that may hang: a
    competitor's hang (seen: accelerate's warm-up launch in CI) is recorded
    in ``hangs`` and its kernel replaced, so one hang does not end the
    benchmark; a hang of nblaunch still does."""

    def __init__(self, setup: str):
        self._setup = setup
        self.hangs: list[str] = []
        self.kernel = BenchKernel()
        self.kernel.run(setup)

    def call(self, name: str, what: str, fn):
        """``fn(kernel)``, or None when launcher ``name`` hung in it."""
        try:
            return fn(self.kernel)
        except TimeoutError:
            if name == "nblaunch":
                raise
            self.hangs.append(f"{name}{what}")
            print(f"  {name}{what} hung; restarting the kernel", file=sys.stderr, flush=True)
            self.kernel.close()
            self.kernel = BenchKernel()
            self.kernel.run(self._setup)
            return None

    def close(self) -> None:
        self.kernel.close()


def measure(sizes, reps) -> dict:
    kernel = GuardedKernel(SETUP)
    hangs = kernel.hangs

    def timed(name: str, n: int) -> float:
        """One launch (NaN: a competitor that hung)."""
        value = kernel.call(name, f"({n})", lambda k: k.seconds(f"launch_{name}({n})"))
        return float("nan") if value is None else value

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


def measure_slope(sizes, reps: int, jobs=slope.JOBS) -> dict:
    """bench/slope.py's sweep, in one kernel of its own."""
    kernel = GuardedKernel(SETUP + slope.SETUP)
    try:
        result = slope.measure(kernel, sizes, slope.reps_for(sizes, reps), jobs)
        result["hangs"] = kernel.hangs
        return result
    finally:
        kernel.close()


def measure_first_launch(reps) -> dict:
    """The first launch in a fresh kernel (torch and nblaunch imported in an
    earlier cell, as a notebook would), nblaunch with its default view against
    torch.multiprocessing fork; each launcher in its own fresh kernel,
    alternating, median of ``reps``."""
    times: dict[str, list] = {"nblaunch": [], "torch_fork": []}
    for _ in range(reps):
        for name in times:
            kernel = BenchKernel()
            try:
                kernel.run(SETUP + "\nimport nblaunch\n")  # the user's import cell
                times[name].append(kernel.seconds(f"launch_{name}(2)"))
            finally:
                kernel.close()
    out = {f"{name}_s": statistics.median(t) for name, t in times.items()}
    out["nblaunch/torch_fork"] = out["nblaunch_s"] / out["torch_fork_s"]
    out["raw"] = times
    return out


FAILURE_SETUP = r'''
import contextlib, io, tempfile
import signal as _signal

def _raise_on_1(stamp_dir):
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        time.sleep(0.3)
        open(f"{stamp_dir}/t", "w").write(repr(time.time()))
        raise ValueError("boom")
    dist.all_reduce(torch.ones(1))

def _kill_1(stamp_dir):
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        time.sleep(0.3)
        open(f"{stamp_dir}/t", "w").write(repr(time.time()))
        os.kill(os.getpid(), _signal.SIGKILL)
    dist.all_reduce(torch.ones(1))

def _blamed(exc):
    """The rank the launcher's exception names as the one that failed."""
    if hasattr(exc, "error_index"):  # torch.multiprocessing
        return exc.error_index
    if hasattr(exc, "get_first_failure"):  # torch elastic's ChildFailedError (accelerate)
        return exc.get_first_failure()[0]
    return getattr(exc, "rank", None)  # nblaunch

def failure_latency(kind, launcher):
    """Seconds from the failure inside rank 1 (rank 0 blocked in all_reduce)
    to the exception in the cell, and the rank that exception names."""
    from nblaunch import notebook_launcher
    from accelerate import notebook_launcher as accelerate_launcher
    d = tempfile.mkdtemp()
    fn = _raise_on_1 if kind == "raise" else _kill_1
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            if launcher == "nblaunch":
                notebook_launcher(fn, args=(d,), num_processes=2, display="none")
            elif launcher == "torch_fork":
                tmp.start_processes(jobs.torch_rank, args=(2, _free_port(), fn, d), nprocs=2,
                                    start_method="fork")
            else:
                accelerate_launcher(fn, args=(d,), num_processes=2, use_port=str(_free_port()))
    except Exception as exc:
        caught = time.time()
        blamed = _blamed(exc)
    else:
        raise AssertionError(f"{launcher} returned although rank 1 failed")
    return f"{caught - float(open(f'{d}/t').read())} {blamed}"
'''


# The importable rank functions (bench/jobs.py), for the kernel.
JOBS_SETUP = f"import sys\nsys.path.insert(0, {str(HERE)!r})\nimport jobs\n"

SPAWN_SETUP = r'''
def launch_nblaunch_spawn(n):
    from nblaunch import notebook_launcher
    t = time.perf_counter()
    assert notebook_launcher(_job, num_processes=n, start_method="spawn") == [float(n)] * n
    return time.perf_counter() - t

def launch_torch_spawn_module_fn(n):
    t = time.perf_counter()
    tmp.start_processes(jobs.torch_rank, args=(n, _free_port()), nprocs=n, start_method="spawn")
    return time.perf_counter() - t

def torch_spawn_notebook_fn_error(n):
    try:
        tmp.start_processes(_torch_rank, args=(n, _free_port()), nprocs=n, start_method="spawn")
    except Exception as exc:
        return repr(exc)  # the cause is printed by the ranks, to the kernel's terminal
    return None
'''


def measure_spawn(reps) -> dict:
    """Spawn at 2 ranks, in a fresh kernel: nblaunch with a notebook-defined
    function, torch.multiprocessing with one it can import (it cannot run a
    notebook-defined one: the error is recorded)."""
    kernel = BenchKernel()
    try:
        kernel.run(SETUP + JOBS_SETUP + SPAWN_SETUP)
        print("  torch spawn with a notebook-defined function: expected to fail; its ranks' "
              "tracebacks below come from that", file=sys.stderr, flush=True)
        text = kernel.run("print('ERROR', torch_spawn_notebook_fn_error(2))", timeout=120)
        error = text.split("ERROR ", 1)[1].strip()
        kernel.seconds("launch_nblaunch_spawn(2)")  # warm-up, as for the others
        kernel.seconds("launch_torch_spawn_module_fn(2)")
        ours, theirs = [], []
        for _ in range(reps):
            ours.append(kernel.seconds("launch_nblaunch_spawn(2)"))
            theirs.append(kernel.seconds("launch_torch_spawn_module_fn(2)"))
        return {"nblaunch_spawn_notebook_fn_s": statistics.median(ours),
                "torch_spawn_module_fn_s": statistics.median(theirs),
                "nblaunch/torch_spawn": statistics.median(ours) / statistics.median(theirs),
                "torch_spawn_notebook_fn": error}
    finally:
        kernel.close()


MEMORY_SETUP = r'''
import json, shutil, tempfile, threading, psutil
from accelerate import notebook_launcher as accelerate_launcher
from nblaunch import notebook_launcher

_big = []

def _make_big(mib):
    # Made in a helper thread: a parallel fill in the kernel's main thread
    # would hang the forked ranks of torch fork and accelerate (GNU OpenMP
    # after fork), and this measures memory, not that hang.
    t = threading.Thread(target=lambda: _big.append(torch.ones(mib * 2**20 // 4)))
    t.start(); t.join()

def _settle():
    # Until what the warm-up started has left (a fork launch's zygote leaves
    # a few ms after the launch returns; read while it tears its copy of the
    # kernel down, the baseline missed ~500 MiB shared with it). The
    # forkserver and resource tracker stay, by design.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        rest = []
        for p in psutil.Process().children(recursive=True):
            try:
                cmd = " ".join(p.cmdline())
            except psutil.Error:
                cmd = "(zombie)"
            if "forkserver" not in cmd and "resource_tracker" not in cmd:
                rest.append(p)
        if not rest:
            return
        time.sleep(0.01)
    raise RuntimeError(f"the warm-up launch left {rest}")

def memory(launcher, method, n):
    # Warm-up first, so a forkserver started once per kernel is not counted
    # as if every launch paid for it.
    if launcher == "nblaunch":
        notebook_launcher(jobs.job, num_processes=n, start_method=method, display="none")
        _settle()
    d = tempfile.mkdtemp()
    args = (_big[0], d, os.getpid())
    base = jobs.tree_pss(os.getpid())
    if launcher == "nblaunch":
        notebook_launcher(jobs.hold, args=args, num_processes=n, start_method=method, display="none")
    elif launcher == "torch":
        tmp.start_processes(jobs.torch_rank, args=(n, _free_port(), jobs.hold, *args), nprocs=n,
                            start_method=method)
    else:
        import contextlib, io
        with contextlib.redirect_stdout(io.StringIO()):
            accelerate_launcher(jobs.hold, args=args, num_processes=n, use_port=str(_free_port()))
    recs = [json.load(open(f"{d}/rank{r}.json")) for r in range(n)]
    shutil.rmtree(d)
    tree = recs[0]["tree_pss"]
    print("MEMORY", json.dumps({"ranks_uss_mib": sum(r["uss"] for r in recs) / 2**20,
                                "extra_mib": (tree - base) / 2**20}))
'''

MEMORY_CASES = (("nblaunch", "fork"), ("nblaunch", "forkserver"), ("nblaunch", "spawn"),
                ("torch", "fork"), ("torch", "spawn"), ("accelerate", "fork"))


def _memory_case(launcher: str, method: str, n: int, mib: int) -> dict:
    """One memory reading, in a fresh kernel, so one launcher's
    shared-memory choices cannot leak into the next one's numbers. A
    competitor that hangs (seen: accelerate forking 4 ranks from a kernel
    that had run torch's OpenMP ops) is recorded as hung, as the launch
    bench does; a hang of nblaunch still ends the benchmark."""
    kernel = BenchKernel()
    try:
        kernel.run(SETUP + JOBS_SETUP + MEMORY_SETUP)
        kernel.run(f"_make_big({mib})")
        print(f"  memory {launcher} {method} {n} ranks ...", file=sys.stderr, flush=True)
        try:
            text = kernel.run(f"memory({launcher!r}, {method!r}, {n})", timeout=300)
        except TimeoutError:
            if launcher == "nblaunch":
                raise
            print(f"  memory {launcher} {method} {n} ranks hung", file=sys.stderr, flush=True)
            return {"ranks_uss_mib": None, "extra_mib": None, "hung": True}
        return json.loads(text.split("MEMORY ", 1)[1])
    finally:
        kernel.close()


def measure_memory(mib: int, n: int) -> dict:
    """``n`` ranks each given the same ``mib`` MiB tensor from the kernel:
    the memory the ranks own (sum of USS), and the extra memory of the
    kernel's process tree (kernel, ranks, forkserver, zygote and other
    helpers; sum of PSS) while they hold it, against the same sum just
    before the launch (after a warm-up launch, so a forkserver started once
    per kernel is in both readings). Each case in a fresh kernel.
    (The machine's available memory was tried first: it dropped by 400 MiB
    across a launch whose ranks had all exited.)"""
    out = {f"{launcher} {method}": _memory_case(launcher, method, n, mib) for launcher, method in MEMORY_CASES}
    return {"tensor_mib": mib, "ranks": n, "cases": out}


FORK_LAUNCHERS = ("nblaunch", "torch", "accelerate")


def measure_fork_memory(mib: int, sizes) -> dict:
    """Forked ranks' own memory (sum of USS) by rank count, under each
    launcher that forks, and nblaunch's ratio to torch fork's."""
    by_ranks = {}
    for n in sizes:
        uss = {launcher: _memory_case(launcher, "fork", n, mib)["ranks_uss_mib"] for launcher in FORK_LAUNCHERS}
        ratio = uss["nblaunch"] / uss["torch"] if uss["torch"] else None
        by_ranks[n] = {"ranks_uss_mib": uss, "nblaunch/torch_fork": ratio}
    return {"tensor_mib": mib, "by_ranks": by_ranks}


def measure_failure(reps) -> dict:
    """Rank raises / rank SIGKILLed -> the cell raises, under each launcher in one kernel."""
    kernel = GuardedKernel(SETUP + JOBS_SETUP + FAILURE_SETUP)
    guarded = kernel.call
    try:
        for name in LAUNCHERS:  # warm
            guarded(name, " warm-up", lambda k: k.seconds(f"launch_{name}(2)"))
        out: dict = {"hangs": kernel.hangs}
        for kind in ("raise", "sigkill"):
            for name in LAUNCHERS:
                seconds, blamed = [], set()
                for _ in range(reps):
                    text = guarded(name, f" {kind}", lambda k: k.run(
                        f"print('FAILED', failure_latency({kind!r}, {name!r}))", timeout=CALL_TIMEOUT_S))
                    if text is None:
                        continue
                    value, rank = text.split("FAILED ", 1)[1].split()
                    seconds.append(float(value))
                    blamed.add(rank)
                out.setdefault(kind, {})[name] = {
                    "median_s": statistics.median(seconds) if seconds else float("nan"),
                    "rank_named": sorted(blamed)}
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


def per_added_rank(summary: dict, sizes) -> dict:
    """Launch cost per added rank, smallest to largest size, per launcher."""
    lo, hi = min(sizes), max(sizes)
    if lo == hi:
        return {}
    med = summary["median_s"]
    return {name: (med[name][hi] - med[name][lo]) / (hi - lo) for name in LAUNCHERS}


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


def failure_table(failures: dict) -> str:
    lines = ["| rank 1 fails, 2 ranks | " + " | ".join(LAUNCHERS) + " |", "|---" * (len(LAUNCHERS) + 1) + "|"]
    for kind, what in (("raise", "raises"), ("sigkill", "is SIGKILLed")):
        row = failures[kind]
        lines.append(f"| rank 1 {what}: failure -> cell raises (s) | "
                     + " | ".join(f"{row[name]['median_s']:.3f}" for name in LAUNCHERS) + " |")
        lines.append(f"| rank 1 {what}: rank the error names | "
                     + " | ".join(", ".join(row[name]["rank_named"]) for name in LAUNCHERS) + " |")
    return "\n".join(lines)


def memory_table(memory: dict) -> str:
    lines = [f"| {memory['ranks']} ranks, {memory['tensor_mib']} MiB tensor | ranks' own memory (MiB, sum of USS) "
             "| extra memory of the kernel's process tree (MiB, PSS) |", "|---|---|---|"]
    for case, m in memory["cases"].items():
        lines.append(f"| {case} | {_mib(m['ranks_uss_mib'], '.0f')} | {_mib(m['extra_mib'], '.0f')} |")
    return "\n".join(lines)


def fork_memory_table(memory: dict) -> str:
    lines = [f"| forked ranks' own memory (MiB, sum of USS; {memory['tensor_mib']} MiB tensor) | "
             + " | ".join(f"{name} fork" for name in FORK_LAUNCHERS) + " | nblaunch / torch fork |",
             "|---" * (len(FORK_LAUNCHERS) + 2) + "|"]
    for n, row in memory["by_ranks"].items():
        lines.append(f"| {n} ranks | " + " | ".join(_mib(row['ranks_uss_mib'][name], ".1f") for name in FORK_LAUNCHERS)
                     + f" | {_mib(row['nblaunch/torch_fork'], '.2f')} |")
    return "\n".join(lines)


def _mib(value, fmt: str) -> str:
    return "hung" if value is None else format(value, fmt)


def plot(summary: dict, sizes, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    memory = summary.get("memory")
    fig, axes = plt.subplots(1, 2 if memory else 1, figsize=(12 if memory else 6, 4), squeeze=False)
    ax = axes[0][0]
    for name in LAUNCHERS:
        ax.plot(sizes, [summary["median_s"][name][n] for n in sizes], marker="o", label=name)
    ax.set_xlabel("ranks")
    ax.set_ylabel("call -> return, median (s)")
    ax.set_title("Trivial launch in a Jupyter kernel (init, all_reduce, return)")
    ax.set_xticks(list(sizes))
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    if memory:
        ax = axes[0][1]
        cases = list(memory["cases"])
        ax.barh(cases, [memory["cases"][c]["extra_mib"] for c in cases], color="#1565c0")
        ax.axvline(memory["tensor_mib"], color="#c62828", linestyle="--", label="one copy of the tensor")
        ax.set_xlabel("extra memory of the kernel's process tree (MiB, PSS)")
        ax.legend(loc="lower right")
        ax.set_title(f"{memory['ranks']} ranks given one {memory['tensor_mib']} MiB tensor")
        ax.invert_yaxis()
        ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="2 ranks, 1 repetition (CI)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--slope-sizes", type=int, nargs="+", default=[2, 8, 32, 64, 128, 256])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--slope-reps", type=int, default=5)
    parser.add_argument("--slope-jobs", nargs="+", choices=slope.JOBS, default=list(slope.JOBS))
    parser.add_argument("--first-reps", type=int, default=9)
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--out", type=Path, default=HERE / "results")
    opts = parser.parse_args(argv)
    sizes, reps = ([2], 1) if opts.smoke else (opts.sizes, opts.reps)
    slope_sizes, slope_reps = ([2, 4], 1) if opts.smoke else (opts.slope_sizes, opts.slope_reps)
    parts = set(opts.parts)
    summary: dict = {}
    if "slope" in parts:
        summary["slope"] = measure_slope(slope_sizes, slope_reps, opts.slope_jobs)
        print(slope.table(summary["slope"], slope_sizes))
    if "first" in parts:
        summary["first_launch_2_ranks"] = fl = measure_first_launch(1 if opts.smoke else opts.first_reps)
        print(f"first launch in a fresh kernel, 2 ranks: nblaunch {fl['nblaunch_s']:.3f} s, torch fork "
              f"{fl['torch_fork_s']:.3f} s, ratio {fl['nblaunch/torch_fork']:.2f} (goal <= 1.3)")
    if "launch" in parts:
        _launch_parts(summary, sizes, reps, opts.smoke)
    if not opts.smoke:
        opts.out.mkdir(parents=True, exist_ok=True)
        record = {"versions": versions(), "reps": reps, "slope_reps": slope_reps, **summary}
        if parts == set(PARTS):
            (opts.out / "launch.json").write_text(json.dumps(record, indent=2))
            plot(summary, sizes, opts.out / "launch.png")
            print(f"wrote {opts.out / 'launch.json'} and {opts.out / 'launch.png'}")
        else:
            path = opts.out / "slope.json"  # the parts run now replace theirs; the others' are kept
            kept = json.loads(path.read_text()) if path.exists() else {}
            path.write_text(json.dumps({**kept, **record}, indent=2))
            print(f"wrote {opts.out / 'slope.json'}")
        if "slope" in summary:
            slope.plot(summary["slope"], slope_sizes, HERE.parent / "docs" / "launch-slope.png")
    return 0


PARTS = ("slope", "first", "launch")


def _launch_parts(summary: dict, sizes, reps: int, smoke: bool) -> None:
    """The launch bench at ``sizes``, relaunch, failures, spawn and memory."""
    times = measure(sizes, reps)
    summary["raw_s"] = times
    summary.update(summarise(times, sizes))
    summary["relaunch_2_ranks"] = measure_relaunch(reps)
    summary["failure_latency_s"] = measure_failure(reps)
    summary["spawn_2_ranks"] = measure_spawn(1 if smoke else 3)
    summary["memory"] = measure_memory(64 if smoke else 1024, 2 if smoke else 4)
    summary["fork_memory"] = measure_fork_memory(64 if smoke else 1024, sizes)
    summary["per_added_rank_s"] = per_added_rank(summary, sizes)
    print(table(summary, sizes))
    added = summary["per_added_rank_s"]
    if added:
        print("launch cost per added rank: " + ", ".join(f"{name} {1000 * s:.1f} ms" for name, s in added.items())
              + f"; nblaunch / torch fork {added['nblaunch'] / added['torch_fork']:.2f}")
    if times["hangs"]:
        print(f"hung (timed out after {CALL_TIMEOUT_S:g} s, not counted): {times['hangs']}")
    rl = summary["relaunch_2_ranks"]
    print(f"\nnblaunch, 2 ranks: forkserver cold {rl['cold_forkserver_s']:.3f} s, warm "
          f"{rl['warm_forkserver_s']:.3f} s, fork {rl['fork_s']:.3f} s, warm/fork {rl['warm/fork']:.2f}")
    print()
    print(failure_table(summary["failure_latency_s"]))
    sp = summary["spawn_2_ranks"]
    print(f"spawn, 2 ranks: nblaunch (notebook fn) {sp['nblaunch_spawn_notebook_fn_s']:.3f} s, torch "
          f"(importable fn) {sp['torch_spawn_module_fn_s']:.3f} s, ratio {sp['nblaunch/torch_spawn']:.2f}; "
          f"torch spawn with a notebook fn: {sp['torch_spawn_notebook_fn']}")
    print()
    print(memory_table(summary["memory"]))
    print()
    print(fork_memory_table(summary["fork_memory"]) + "\n(goal: nblaunch / torch fork <= 1.2)")


if __name__ == "__main__":
    sys.exit(main())
