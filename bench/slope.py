"""Launch cost per added rank, 2 to 256 ranks on one machine (#40), for
``bench/run.py``: nblaunch against torch's ``start_processes`` (fork) and
accelerate's ``notebook_launcher``, in one real kernel, alternating.

Two jobs, because they measure different things:

- ``none``: each rank returns at once, without a process group. What a
  launcher itself costs per rank: making the process, setting it up,
  hearing from it, reaping it.
- ``group``: each rank joins a gloo group and does one ``all_reduce``
  (``bench/run.py``'s job). Adds the rendezvous and gloo's mesh of
  connections, which grow with the world whoever launches.

The slope is a least-squares line through each launcher's medians,
seconds against ranks (``fit``): its slope is the cost per added rank.
"""
from __future__ import annotations

import statistics
import sys

LAUNCHERS = ("nblaunch", "torch_fork", "accelerate")
JOBS = ("none", "group")

# Defined in the kernel after bench/run.py's SETUP: the "none" job's launches.
SETUP = r'''
def _nothing(*args):
    return None

def launch_nblaunch_none(n):
    from nblaunch import notebook_launcher
    t = time.perf_counter()
    out = notebook_launcher(_nothing, num_processes=n, init_process_group=False)
    assert out == [None] * n
    return time.perf_counter() - t

def launch_torch_fork_none(n):
    t = time.perf_counter()
    tmp.start_processes(_nothing, nprocs=n, start_method="fork")
    return time.perf_counter() - t

def launch_accelerate_none(n):
    import contextlib, io
    from accelerate import notebook_launcher
    t = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        notebook_launcher(_nothing, num_processes=n, use_port=str(_free_port()))
    return time.perf_counter() - t

def launch_nblaunch_group(n):
    return launch_nblaunch(n)

def launch_torch_fork_group(n):
    return launch_torch_fork(n)

def launch_accelerate_group(n):
    return launch_accelerate(n)
'''


def fit(points: dict) -> dict:
    """Least squares ``seconds = fixed + per_rank * ranks`` over ``{ranks: seconds}``
    (NaN points, a competitor's hangs, left out)."""
    xs, ys = zip(*[(n, s) for n, s in points.items() if s == s]) if points else ((), ())
    if len(xs) < 2:
        return {"per_rank_s": float("nan"), "fixed_s": float("nan")}
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return {"per_rank_s": slope, "fixed_s": my - slope * mx}


def measure(guarded, sizes, reps: dict, jobs=JOBS) -> dict:
    """``guarded``: a ``run.GuardedKernel`` with run.py's SETUP and this
    module's. ``reps``: repetitions by size (fewer at the large sizes). A
    warm-up launch per launcher and job, at the smallest size, is not counted."""
    def timed(name: str, job: str, n: int) -> float:
        value = guarded.call(name, f" {job}({n})", lambda k: k.seconds(f"launch_{name}_{job}({n})"))
        return float("nan") if value is None else value

    out: dict = {}
    for job in jobs:
        for name in LAUNCHERS:
            timed(name, job, min(sizes))
        raw = {name: {n: [] for n in sizes} for name in LAUNCHERS}
        for n in sizes:
            for rep in range(reps[n]):
                order = LAUNCHERS[rep % 3:] + LAUNCHERS[: rep % 3]
                for name in order:
                    raw[name][n].append(timed(name, job, n))
        medians = {name: {n: _median(raw[name][n]) for n in sizes} for name in LAUNCHERS}
        fits = {name: fit(medians[name]) for name in LAUNCHERS}
        ours = fits["nblaunch"]["per_rank_s"]
        out[job] = {"raw_s": raw, "median_s": medians, "fit": fits,
                    "nblaunch/torch_fork": ours / fits["torch_fork"]["per_rank_s"],
                    "nblaunch/accelerate": ours / fits["accelerate"]["per_rank_s"]}
    return out


def _median(xs: list) -> float:
    xs = [x for x in xs if x == x]
    return statistics.median(xs) if xs else float("nan")


def reps_for(sizes, reps: int) -> dict:
    """``reps`` up to 32 ranks, fewer above (a 256-rank gloo launch takes
    tens of seconds on two cores), at least 3 unless ``reps`` is smaller."""
    return {n: reps if n <= 32 else max(min(reps, 3), reps // 3) for n in sizes}


def table(result: dict, sizes) -> str:
    lines = []
    for job, r in ((job, result[job]) for job in JOBS if job in result):
        what = "no process group" if job == "none" else "gloo group + all_reduce"
        lines.append(f"| {what}: ranks | " + " | ".join(LAUNCHERS) + " |")
        lines.append("|---" * (len(LAUNCHERS) + 1) + "|")
        for n in sizes:
            lines.append(f"| {n} | " + " | ".join(f"{r['median_s'][name][n]:.3f} s" for name in LAUNCHERS) + " |")
        lines.append("| per added rank (fit) | " + " | ".join(
            f"**{1000 * r['fit'][name]['per_rank_s']:.1f} ms**" for name in LAUNCHERS) + " |")
        lines.append(f"\nnblaunch / torch fork {r['nblaunch/torch_fork']:.2f}, nblaunch / accelerate "
                     f"{r['nblaunch/accelerate']:.2f} (goal: both <= 1)\n")
    return "\n".join(lines)


def plot(result: dict, sizes, path) -> None:
    """Launch time against ranks, each launcher's medians and its fitted line, one panel per job."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    jobs = [job for job in JOBS if job in result]
    fig, axes = plt.subplots(1, len(jobs), figsize=(6 * len(jobs), 4), squeeze=False)
    for ax, job in zip(axes[0], jobs):
        r = result[job]
        for name, color in zip(LAUNCHERS, ("#1565c0", "#c62828", "#2e7d32")):
            f = r["fit"][name]
            ax.plot(sizes, [r["median_s"][name][n] for n in sizes], "o", color=color,
                    label=f"{name}: {1000 * f['per_rank_s']:.1f} ms per added rank")
            ax.plot(sizes, [f["fixed_s"] + f["per_rank_s"] * n for n in sizes], "-", color=color, alpha=0.5)
        ax.set_xlabel("ranks")
        ax.set_ylabel("call -> return, median (s)")
        ax.set_title("no process group" if job == "none" else "gloo group + one all_reduce")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit("run it through bench/run.py (--slope-sizes)")
