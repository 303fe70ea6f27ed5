"""The kernel as the hub of many ranks: what it costs as the world grows, in a real kernel.

Every rank reports ``nblaunch.progress`` and ``nblaunch.log`` ten times a
second; the kernel draws its default view (widgets). Measured for N ranks
on this machine, in one real IPython kernel (jupyter_client), as a
notebook user would run it:

- **kernel CPU per rank-second**: the kernel process's CPU time (psutil,
  sampled from outside at 20 Hz, so the sampling costs the kernel nothing)
  over the window in which every rank reports, divided by N x the window;
- **kernel memory per rank**: the kernel's peak RSS during the launch over
  its RSS before, divided by N;
- **call -> every rank's first step** without a process group (what nblaunch
  itself costs), and, up to ``--pg-max`` ranks, with a gloo process group
  and one all_reduce, against torch's ``start_processes`` (fork) in the same
  kernel, alternating;
- **failure verdict**: one rank raises after 1 s of reporting; seconds from
  its raise (the rank's clock) to the ``WorkerError`` in the cell;
- **failure named**: from the raise to the first message in the cell that
  names it (above 16 ranks the view's notice, before the others are stopped);
- **stop**: the kernel is interrupted while the ranks report; seconds until
  no rank process is left, and until the cell has returned;
- **the system's floor**: the kernel forks N copies of itself that sleep,
  SIGKILLs them all at once and reaps them: what the operating system needs
  to end N ranks, measured between the failure and the stop.

The ranks run without a process group where the group is not what is
measured (``init_process_group=False``): a gloo group of 128+ ranks on two
cores measures gloo's rendezvous, not the hub.

    python bench/scale.py                       # 8..128 ranks, 3 repetitions (about 15 min on 2 cores)
    python bench/scale.py --sizes 8,16 --reps 1 --seconds 4    # a quick look
    python bench/scale.py --stops-only --sizes 64,128,256   # failure and stop only, with the system's floor
    python bench/scale.py --plot-only           # redraw docs/scale.png from bench/results/scale*.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Optional

import psutil

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from run import BenchKernel  # noqa: E402

RESULT = HERE / "results" / "scale.json"
STOPS = HERE / "results" / "scale_stops.json"  # --stops-only
PLOT = HERE.parent / "docs" / "scale.png"

SETUP = r'''
import glob, json, os, socket, tempfile, time
import nblaunch
import torch, torch.distributed as dist
import torch.multiprocessing as tmp

def _report(seconds, hz, fail_after=None):
    """Report progress and a metric ``hz`` times a second for ``seconds``;
    the last rank raises after ``fail_after`` seconds if given."""
    steps = int(seconds * hz)
    fails = fail_after is not None and int(os.environ["RANK"]) == int(os.environ["WORLD_SIZE"]) - 1
    first = None
    for i in nblaunch.progress(range(steps), desc="train"):
        now = time.time()
        if first is None:
            first = now
        nblaunch.log(loss=1.0 / (i + 1) + 0.01 * int(os.environ["RANK"]), step=i)
        if fails and now - first >= fail_after:
            raise RuntimeError(f"failed on purpose at {now!r}")
        time.sleep(max(0.0, first + (i + 1) / hz - time.time()))
    return first, time.time()

def run_report(n, seconds, hz):
    t = time.time()
    out = nblaunch.notebook_launcher(_report, (seconds, hz), num_processes=n, init_process_group=False)
    return {"call": t, "first": [o[0] for o in out], "last": [o[1] for o in out], "returned": time.time()}

def run_fail(n, after):
    try:
        nblaunch.notebook_launcher(_report, (60, 10, after), num_processes=n, init_process_group=False)
    except nblaunch.WorkerError as e:
        seen = time.time()
        assert e.rank == n - 1, e.rank
        raised = float(str(e).split("failed on purpose at ")[1].split()[0].rstrip("'\"),."))
        return seen - raised
    raise AssertionError("no failure")

def os_floor(n):
    """What the operating system needs to end ``n`` copies of this kernel:
    fork them (each sleeps), SIGKILL every one at once, seconds until all
    are reaped. A forked rank is such a copy, and its teardown (its share of
    the kernel's pages) is most of what a stop of many ranks waits for."""
    pids = []
    for _ in range(n):
        pid = os.fork()
        if pid == 0:
            try:
                time.sleep(600)
            finally:
                os._exit(0)
        pids.append(pid)
    time.sleep(1.0)
    t = time.time()
    for pid in pids:
        os.kill(pid, 9)
    for pid in pids:
        os.waitpid(pid, 0)
    return time.time() - t

def _pg_step():
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    return time.time()

def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

def _torch_rank(index, n, port, folder):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(index), WORLD_SIZE=str(n))
    t = _pg_step()
    with open(os.path.join(folder, str(index)), "w") as f:
        f.write(repr(t))
    dist.destroy_process_group()

def first_step_nblaunch(n):
    t = time.time()
    return max(nblaunch.notebook_launcher(_pg_step, num_processes=n)) - t

def first_step_torch_fork(n):
    folder = tempfile.mkdtemp()
    t = time.time()
    tmp.start_processes(_torch_rank, args=(n, _free_port(), folder), nprocs=n, start_method="fork")
    return max(float(open(p).read()) for p in glob.glob(folder + "/*")) - t
'''


class Sampler:
    """The kernel's CPU time and RSS, read from this process at ``hz``."""

    def __init__(self, pid: int, hz: float = 20.0):
        self.proc = psutil.Process(pid)
        self.samples: list[tuple[float, float, int]] = []  # (time, cpu seconds, rss)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(1.0 / hz,), daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def _run(self, every: float) -> None:
        while not self._stop.is_set():
            with self.proc.oneshot():
                t = self.proc.cpu_times()
                self.samples.append((time.time(), t.user + t.system, self.proc.memory_info().rss))
            self._stop.wait(every)

    def cpu_at(self, when: float) -> float:
        """CPU seconds at ``when``, interpolated between samples."""
        s = self.samples
        for (t0, c0, _), (t1, c1, _) in zip(s, s[1:]):
            if t0 <= when <= t1:
                return c0 + (c1 - c0) * (when - t0) / ((t1 - t0) or 1)
        raise ValueError("outside the sampled window")


def descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def measure_report(kernel: BenchKernel, n: int, seconds: float, hz: float) -> dict:
    pid = kernel.km.provisioner.process.pid
    rss0 = psutil.Process(pid).memory_info().rss
    with Sampler(pid) as sampler:
        text = kernel.run(f"print('JSON', json.dumps(run_report({n}, {seconds}, {hz})))", timeout=seconds + 300)
    out = json.loads(text.split("JSON ", 1)[1])
    # Every rank reports from the last one's first step to the first one's last.
    begin, end = max(out["first"]) + 0.2, min(out["last"]) - 0.2
    cpu = sampler.cpu_at(end) - sampler.cpu_at(begin)
    peak = max(rss for t, _, rss in sampler.samples if out["call"] <= t <= out["returned"])
    return {"cpu_ms_per_rank_s": 1000 * cpu / (n * (end - begin)), "kernel_cpu_share": cpu / (end - begin),
            "window_s": end - begin, "first_step_s": max(out["first"]) - out["call"],
            "rss_per_rank_kib": (peak - rss0) / n / 1024}


def measure_fail(kernel: BenchKernel, n: int) -> dict:
    """One rank raises: seconds from its raise to the failure named in the
    cell's output (the first message that names it: the view's notice, or
    the error) and to the ``WorkerError``."""
    named: list = []

    def hook(msg):
        text = json.dumps(msg["content"])
        if not named and "failed on purpose at " in text:
            named.append((time.time(), text))

    out: list = []

    def keep(msg):
        hook(msg)
        if msg["msg_type"] == "stream":
            out.append(msg["content"]["text"])

    kernel.kc.execute_interactive(f"print('SECONDS', run_fail({n}, 1.0))", output_hook=keep, timeout=300)
    verdict = float("".join(out).split("SECONDS ", 1)[1].split()[0])
    if not named:  # nothing named it before the error (which the cell catches)
        return {"named_s": verdict, "verdict_s": verdict}
    seen, text = named[0]
    raised = float(re.search(r"failed on purpose at ([0-9.]+[0-9])", text).group(1))
    return {"named_s": seen - raised, "verdict_s": verdict}


def measure_stop(kernel: BenchKernel, n: int) -> dict:
    """Interrupt the kernel while ``n`` ranks report: until none is left, and until the cell returned."""
    pid = kernel.km.provisioner.process.pid
    msg_id = kernel.kc.execute(f"run_report({n}, 60, 10)")
    deadline = time.monotonic() + 120
    while len(descendants(pid)) < n and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(2.0)  # reporting by now
    ranks = descendants(pid)
    t0 = time.monotonic()
    kernel.km.interrupt_kernel()
    gone = None
    while time.monotonic() - t0 < 30:
        if not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in ranks):
            gone = time.monotonic() - t0
            break
        time.sleep(0.01)
    while True:  # the cell's reply: a KeyboardInterrupt
        reply = kernel.kc.get_shell_msg(timeout=60)
        if reply["parent_header"].get("msg_id") == msg_id:
            returned = time.monotonic() - t0
            break
    left = [p.pid for p in ranks if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    return {"gone_s": gone, "returned_s": returned, "left": left, "status": reply["content"]["status"]}


def seconds(kernel: BenchKernel, call: str, timeout: float = 300) -> float:
    text = kernel.run(f"print('SECONDS', {call})", timeout=timeout)
    return float(text.split("SECONDS ", 1)[1])


def machine() -> dict:
    return {"cpus": os.cpu_count(), "load_avg_1m": os.getloadavg()[0], "python": platform.python_version(),
            "memory_gib": round(psutil.virtual_memory().total / 2**30, 1)}


def median(values: list) -> float:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def run(sizes: list[int], reps: int, secs: float, hz: float, pg_max: int, report: bool = True) -> dict:
    kernel = BenchKernel()
    results: dict = {"machine_before": machine(), "seconds": secs, "hz": hz, "reps": reps, "sizes": {}}
    try:
        kernel.run(SETUP)
        kernel.run("nblaunch.notebook_launcher(_report, (0.5, 10), num_processes=2, init_process_group=False)")
        for n in sizes:
            rows: dict = {"report": [], "fail": [], "stop": [], "os_floor_s": [], "pg_nblaunch_s": [],
                          "pg_torch_fork_s": []}
            for rep in range(reps):
                print(f"{n} ranks, repetition {rep + 1}/{reps}", file=sys.stderr, flush=True)
                if report:
                    rows["report"].append(measure_report(kernel, n, secs, hz))
                # Each against what the system needs to end n copies of the kernel, measured next to it.
                rows["fail"].append(measure_fail(kernel, n))
                rows["os_floor_s"].append(seconds(kernel, f"os_floor({n})"))
                rows["stop"].append(measure_stop(kernel, n))
                if n <= pg_max:
                    rows["pg_nblaunch_s"].append(seconds(kernel, f"first_step_nblaunch({n})"))
                    rows["pg_torch_fork_s"].append(seconds(kernel, f"first_step_torch_fork({n})"))
            summary = {key: median([r[key] for r in rows["report"]]) for key in rows["report"][0]} if report else {}
            summary.update(fail_named_s=median([f["named_s"] for f in rows["fail"]]),
                           fail_verdict_s=median([f["verdict_s"] for f in rows["fail"]]),
                           os_floor_s=median(rows["os_floor_s"]),
                           stop_gone_s=median([s["gone_s"] for s in rows["stop"]]),
                           stop_returned_s=median([s["returned_s"] for s in rows["stop"]]),
                           stop_left=sum(len(s["left"]) for s in rows["stop"]))
            if rows["pg_nblaunch_s"]:
                summary.update(pg_first_step_nblaunch_s=median(rows["pg_nblaunch_s"]),
                               pg_first_step_torch_fork_s=median(rows["pg_torch_fork_s"]))
                summary["pg_first_step_ratio"] = (summary["pg_first_step_nblaunch_s"]
                                                  / summary["pg_first_step_torch_fork_s"])
            results["sizes"][str(n)] = {"median": summary, "runs": rows}
            print(json.dumps({n: summary}, indent=1), file=sys.stderr, flush=True)
    finally:
        kernel.close()
    results["machine_after"] = machine()
    return results


def fit(results: dict) -> dict:
    """The kernel's CPU as ``fixed + per_rank x N`` (least squares over the
    sizes' medians): what the view and the watch cost whatever the world,
    and what each reporting rank adds."""
    sizes = sorted(int(n) for n in results["sizes"])
    ys = [results["sizes"][str(n)]["median"]["kernel_cpu_share"] * 1000 for n in sizes]  # ms per second
    mean_x, mean_y = statistics.mean(sizes), statistics.mean(ys)
    slope = (sum((x - mean_x) * (y - mean_y) for x, y in zip(sizes, ys))
             / (sum((x - mean_x) ** 2 for x in sizes) or 1))
    return {"fixed_ms_per_s": mean_y - slope * mean_x, "per_rank_ms_per_rank_s": slope,
            "ranks_per_core": 1000 / slope if slope > 0 else None}


class _ReplayPool:
    """What the call watch asks of a pool while it applies reports."""

    def __init__(self, size: int):
        self.size = size

    def global_rank(self, rank: int) -> int:
        return rank

    def node(self, rank: int):
        return None

    def send(self, rank, message) -> bool:
        return True


def replay_cluster(world: int = 1024, per_node: int = 8, seconds: int = 10, hz: int = 10) -> dict:
    """The kernel's side of a cluster run of ``world`` ranks, without the
    nodes: each tick, one message per node as its agent sends it (every
    rank's bar and metric, coalesced and pickled), received (unpickled),
    applied by the call watch to the widget view (its drawing code, without
    widgets), and the view drawn. CPU time of this process per rank-second.
    What it leaves out: the link's HMAC and socket reads (one message per
    node per tick), and ipywidgets' messages to the front end (their size
    is bounded by the screen)."""
    import pickle

    from nblaunch.engines.pipes import coalesce
    from nblaunch.engines.pool import Message
    from nblaunch.view.widget import WidgetDisplay, _Static
    from nblaunch.watch.call import CallWatch
    from nblaunch.wire.channel import Metrics, Progress

    nodes = world // per_node
    view = WidgetDisplay(show=False)
    view.begin(world, "fork", "nccl", "/tmp/replay")
    view.place(0, world, None, nodes, hosts=[f"node{r // per_node}" for r in range(world)])
    view._build(_Static)
    watch = CallWatch(_ReplayPool(world), view, 0, stall_warning=60)
    for r in range(world):
        view.rank_status(r, "running")
    t = time.time()

    def node_messages(step: int) -> list[bytes]:
        out = []
        for node in range(nodes):
            items = []
            for r in range(node * per_node, (node + 1) * per_node):
                n = step // 2 if r == 7 else step  # one rank at half speed
                items += [Message(r, Progress(r, 1, "train", n, 10 * seconds * hz, False, t + step / hz)),
                          Message(r, Metrics(r, ((n, t, {"loss": 1 / (n + 1)}),)))]
            out.append(pickle.dumps(("events", coalesce(items)), protocol=pickle.HIGHEST_PROTOCOL))
        return out

    ticks = [node_messages(step) for step in range(seconds * hz)]
    cpu0 = time.process_time()
    for messages in ticks:
        for message in messages:
            watch._apply(pickle.loads(message)[1])
        watch._stalls.check(time.monotonic(), set(range(world)), lambda r: r)
        view.tick(force=True)
    cpu = time.process_time() - cpu0
    return {"world": world, "nodes": nodes, "cpu_ms_per_rank_s": 1000 * cpu / (world * seconds),
            "kernel_cpu_share": cpu / seconds, "slowest_named": "rank 7" in view.rows.value}


def plot(results: dict, path: Path = PLOT, stops: Optional[dict] = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    sizes = sorted(int(n) for n in results["sizes"])
    med = [results["sizes"][str(n)]["median"] for n in sizes]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    ax = axes[0]
    ax.plot(sizes, [m["cpu_ms_per_rank_s"] for m in med], "o-", label="nblaunch (widget view): all of it")
    if "fit" in results:
        ax.axhline(results["fit"]["per_rank_ms_per_rank_s"], color="#2e7d32", lw=1,
                   label=f"each added rank: {results['fit']['per_rank_ms_per_rank_s']:.2f} ms")
    before = results.get("baseline_before_issue_40")
    if before:
        ns = sorted(int(n) for n in before)
        ax.plot(ns, [before[str(n)]["median"]["cpu_ms_per_rank_s"] for n in ns], "x:", color="#8a8a8a",
                label="before #40 (same bench)")
    ax.axhline(1.0, color="#c62828", ls="--", lw=1, label="goal: 1 ms")
    ax.set(xscale="log", xlabel="ranks", ylabel="kernel CPU, ms per rank-second",
           title=f"kernel CPU: every rank reports at {results['hz']:g} Hz")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    ax = axes[1]
    ax.plot(sizes, [m["first_step_s"] for m in med], "o-", label="nblaunch, no process group")
    pg = [(n, m) for n, m in zip(sizes, med) if "pg_first_step_nblaunch_s" in m]
    if pg:
        ax.plot([n for n, _ in pg], [m["pg_first_step_nblaunch_s"] for _, m in pg], "s-", label="nblaunch, gloo group")
        ax.plot([n for n, _ in pg], [m["pg_first_step_torch_fork_s"] for _, m in pg], "^--",
                label="torch start_processes (fork), gloo group")
    ax.set(xscale="log", xlabel="ranks", ylabel="seconds", title="call -> every rank's first step")
    ax.legend(fontsize=8)
    ax = axes[2]
    stop_sizes, stop_med = sizes, med
    if stops:  # the later --stops-only run: failure named, stop, and the system's floor
        chosen = stops.get("quieter_alternating", {}).get("after") or stops["sizes"]
        stop_sizes = sorted(int(n) for n in chosen)
        stop_med = [chosen[str(n)]["median"] for n in stop_sizes]
        ax.plot(stop_sizes, [m["fail_named_s"] for m in stop_med], "^-", label="one rank raises -> named in the view")
    ax.plot(stop_sizes, [m["fail_verdict_s"] for m in stop_med], "o-", label="one rank raises -> WorkerError")
    ax.plot(stop_sizes, [m["stop_gone_s"] for m in stop_med], "s-", label="interrupt -> no rank left")
    if stops:
        ax.plot(stop_sizes, [m["os_floor_s"] for m in stop_med], "x:", color="#8a8a8a",
                label="the system: SIGKILL n copies of the kernel -> reaped")
    title = "failure and stop"
    if stops and stops.get("quieter_alternating"):
        loads = [v for _, *pair in stops["quieter_alternating"]["loads"] for v in pair]
        title += f" (load average {min(loads):.0f}-{max(loads):.0f})"
    elif stops and stops.get("machine"):
        loads = [m[i]["load_avg_1m"] for m in stops["machine"] for i in (1, 2)]
        title += f" (load average {min(loads):.0f}-{max(loads):.0f})"
    ax.set(xscale="log", xlabel="ranks", ylabel="seconds", title=title)
    ax.legend(fontsize=8)
    for ax, xs in zip(axes, (sizes, sizes, stop_sizes)):
        ax.set_xticks(xs, [str(n) for n in xs])
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="8,16,32,64,128")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--hz", type=float, default=10.0)
    parser.add_argument("--pg-max", type=int, default=32, help="largest N timed with a gloo process group")
    parser.add_argument("--out", default=None, help=f"default: {RESULT} ({STOPS} with --stops-only)")
    parser.add_argument("--plot-only", action="store_true")
    parser.add_argument("--stops-only", action="store_true",
                        help="only failure, stop and the system's floor (no reporting, no process group)")
    parser.add_argument("--replay", type=int, default=1024, help="ranks of the replayed cluster run (0: none)")
    opts = parser.parse_args()
    opts.out = opts.out or str(STOPS if opts.stops_only else RESULT)
    if opts.plot_only:
        plot(json.loads(RESULT.read_text()), stops=json.loads(STOPS.read_text()) if STOPS.exists() else None)
        return
    results = run([int(n) for n in opts.sizes.split(",")], opts.reps, opts.seconds, opts.hz,
                  0 if opts.stops_only else opts.pg_max, report=not opts.stops_only)
    if len(results["sizes"]) > 1 and not opts.stops_only:
        results["fit"] = fit(results)
    if opts.replay and not opts.stops_only:
        results["replay"] = replay_cluster(opts.replay)
    Path(opts.out).write_text(json.dumps(results, indent=1))
    try:
        if not opts.stops_only:
            plot(results, stops=json.loads(STOPS.read_text()) if STOPS.exists() else None)
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
    print(json.dumps({n: r["median"] for n, r in results["sizes"].items()}, indent=1))
    print(json.dumps(results.get("fit"), indent=1))


if __name__ == "__main__":
    main()
