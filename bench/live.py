"""Live ranks (``nblaunch.start``) against fresh launches, in real kernels, one run.

1. Overhead of a call: a trivial job (one ``all_reduce`` on the existing
   process group) as ``ranks.run`` on live ranks vs a fresh
   ``notebook_launcher`` call (which must also make the group), 2 and 4
   ranks, both with their default view in a kernel (widgets); medians of 15,
   alternating. Goal: a run costs <= 10 ms and <= 0.2x a fresh launch.
2. The scenario live ranks exist for: a set-up of several seconds (build a
   model, make its data, and 3 s of sleep standing in for reading a dataset
   from disk), then 5 short training tries (20 DDP steps each). Live ranks
   (start, set-up once, 5 runs) vs 5 fresh launches that each redo the
   set-up, with nblaunch and with accelerate's ``notebook_launcher``; total
   wall time, and the kernel's process tree's memory (sum of PSS, sampled
   between tries, and peak RSS sampled at 20 Hz during the whole scenario).
3. Interrupt -> ranks idle again: the ranks spin in Python; the kernel is
   interrupted; time until the cell has returned (every rank has left the
   call and waits for the next). Goal: <= 1 s. Median of 5.
4. The stop button on a compute-bound DDP loop (no sleep): how many of 20
   interrupts keep the ranks (no restart, the same step count on every
   rank), with the loop over ``nblaunch.progress`` (the ranks agree on a step
   to stop at) and over a plain ``range`` (interrupted wherever each rank
   is, as every other launcher does). Goal: 20 of 20 with the bar.

    python bench/live.py            # about 3 minutes on 2 CPUs
    python bench/live.py --smoke    # one of each, 2 ranks (CI)
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import psutil

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from run import BenchKernel  # noqa: E402

sys.path.insert(0, str(HERE.parent / "tests"))
from busy_ddp import BUSY_DDP  # noqa: E402  (the stop-button loop, shared with the tests)

SETUP = r'''
import os, socket, time, contextlib, io
import torch, torch.distributed as dist
import nblaunch

def trivial():
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()

def timed(call):
    t = time.perf_counter()
    call()
    return time.perf_counter() - t

def build(sleep_s):
    """The expensive part: a model, its data, and a stand-in for reading files."""
    global model, opt, data
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)], torch.nn.Linear(256, 10))
    model = torch.nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(dist.get_rank())
    data = [(torch.randn(64, 256, generator=g), torch.randint(0, 10, (64,), generator=g)) for _ in range(200)]
    time.sleep(sleep_s)

def try_once(steps, lr):
    for group in opt.param_groups:
        group["lr"] = lr
    loss = None
    for x, y in data[:steps]:
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
    return float(loss)

def fresh_try(sleep_s, steps, lr):
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    build(sleep_s)
    out = try_once(steps, lr)
    return out

def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

def accelerate_try(sleep_s, steps, lr):
    from accelerate import notebook_launcher
    with contextlib.redirect_stdout(io.StringIO()):
        notebook_launcher(fresh_try, args=(sleep_s, steps, lr), num_processes=N, use_port=str(_free_port()))

def spin():
    print("spinning", flush=True)
    while True:
        sum(range(1000))

'''


class TreeMemory:
    """Peak RSS of a process tree, sampled at 20 Hz, and PSS on demand."""

    def __init__(self, pid: int):
        self.root = psutil.Process(pid)
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _procs(self):
        try:
            return [self.root, *self.root.children(recursive=True)]
        except psutil.Error:
            return []

    def _run(self):
        while not self._stop.wait(0.05):
            total = 0
            for p in self._procs():
                try:
                    total += p.memory_info().rss
                except psutil.Error:
                    pass
            self.peak = max(self.peak, total)

    def pss(self) -> int:
        total = 0
        for p in self._procs():
            try:
                total += p.memory_full_info().pss
            except psutil.Error:
                pass
        return total

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def overhead(sizes, reps: int) -> dict:
    out = {}
    for n in sizes:
        k = BenchKernel()
        try:
            k.run(SETUP + f"\nN = {n}\nranks = nblaunch.start({n})\n")
            k.run("ranks.run(trivial); nblaunch.notebook_launcher(trivial, num_processes=N)")  # warm-up
            live, fresh, quiet = [], [], []
            for _ in range(reps):
                live.append(k.seconds("timed(lambda: ranks.run(trivial))"))
                fresh.append(k.seconds("timed(lambda: nblaunch.notebook_launcher(trivial, num_processes=N))"))
                quiet.append(k.seconds("timed(lambda: ranks.run(trivial, display='none'))"))
            k.run("ranks.close()")
        finally:
            k.close()
        out[n] = {"run_s": statistics.median(live), "run_no_view_s": statistics.median(quiet),
                  "fresh_launch_s": statistics.median(fresh),
                  "ratio": statistics.median(live) / statistics.median(fresh)}
        print(f"{n} ranks: run {out[n]['run_s'] * 1e3:.1f} ms (no view {out[n]['run_no_view_s'] * 1e3:.1f} ms), "
              f"fresh launch {out[n]['fresh_launch_s'] * 1e3:.1f} ms, ratio {out[n]['ratio']:.2f}", flush=True)
    return out


def scenario(n: int, tries: int, sleep_s: float, steps: int) -> dict:
    rows = {}
    for name in ("live", "nblaunch_fresh", "accelerate_fresh"):
        k = BenchKernel()
        try:
            k.run(SETUP + f"\nN = {n}\n")
            mem = TreeMemory(k.km.provisioner.pid)
            idle_pss = []
            t0 = time.perf_counter()
            if name == "live":
                k.run(f"ranks = nblaunch.start(N)\nranks.run(build, {sleep_s})")
            for i in range(tries):
                lr = 0.01 * (i + 1)
                if name == "live":
                    k.run(f"ranks.run(try_once, {steps}, {lr})")
                elif name == "nblaunch_fresh":
                    k.run(f"nblaunch.notebook_launcher(fresh_try, args=({sleep_s}, {steps}, {lr}), num_processes=N)")
                else:
                    k.run(f"accelerate_try({sleep_s}, {steps}, {lr})")
                idle_pss.append(mem.pss())
            total = time.perf_counter() - t0
            peak = mem.stop()
            if name == "live":
                k.run("ranks.close()")
        finally:
            k.close()
        rows[name] = {"total_s": total, "idle_pss_mib": statistics.median(idle_pss) / 2**20,
                      "peak_rss_mib": peak / 2**20}
        print(f"{name:17s} {tries} tries: {total:6.2f} s; kernel tree between tries {rows[name]['idle_pss_mib']:.0f} MiB "
              f"PSS, peak {rows[name]['peak_rss_mib']:.0f} MiB RSS", flush=True)
    rows["live_vs_nblaunch_fresh"] = rows["live"]["total_s"] / rows["nblaunch_fresh"]["total_s"]
    rows["live_vs_accelerate_fresh"] = rows["live"]["total_s"] / rows["accelerate_fresh"]["total_s"]
    return rows


def interrupt(n: int, reps: int) -> dict:
    k = BenchKernel()
    times = []
    try:
        k.run(SETUP + f"\nN = {n}\nranks = nblaunch.start(N, display='text')\n")
        for _ in range(reps):
            msg = k.kc.execute("ranks.run(spin)")
            _wait_stream(k, "spinning")
            t0 = time.perf_counter()
            k.km.interrupt_kernel()
            _wait_idle(k, msg)
            times.append(time.perf_counter() - t0)
        alive = k.run("print(ranks.status)")
        assert alive.startswith("up:"), alive
        k.run("ranks.close()")
    finally:
        k.close()
    out = {"median_s": statistics.median(times), "max_s": max(times), "runs": reps}
    print(f"interrupt -> ranks idle, {n} ranks: median {out['median_s']:.3f} s, max {out['max_s']:.3f} s", flush=True)
    return out


def stop_button(tries: int) -> dict:
    """Interrupts of a busy DDP loop on live ranks that keep them, with and without a bar."""
    out = {}
    for bar in (True, False):
        k = BenchKernel()
        kept = 0
        try:
            k.run(BUSY_DDP)
            kind = "progress" if bar else "plain"
            for attempt in range(tries):
                msg = k.kc.execute(f"ranks.run(train, {kind!r}, {attempt}, display='text')")
                _wait_stream(k, f"looping {attempt}")
                k.km.interrupt_kernel()
                _wait_idle(k, msg, timeout=120)
                if k.run("print(ranks.restarts)").split()[-1] == "0":
                    steps = k.run("print(len(set(ranks.run(lambda: steps_done, display='none'))))")
                    kept += steps.split()[-1] == "1"  # every rank at the same step
                else:  # a restart lost the set-up: make it again for the next try
                    k.run("ranks.restarts = 0\nranks.run(setup, display='none')")
            k.run("ranks.close()")
        finally:
            k.close()
        name = "progress_bar" if bar else "plain_range"
        out[name] = {"kept": kept, "tries": tries}
        print(f"stop button on a busy DDP loop ({name.replace('_', ' ')}): ranks kept {kept} of {tries}", flush=True)
    return out


def _wait_stream(k, needle: str, timeout: float = 60) -> None:
    seen, deadline = "", time.monotonic() + timeout
    while needle not in seen:
        msg = k.kc.get_iopub_msg(timeout=max(0.01, deadline - time.monotonic()))
        if msg["msg_type"] == "stream":
            seen += msg["content"]["text"]


def _wait_idle(k, msg_id: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        msg = k.kc.get_iopub_msg(timeout=max(0.01, deadline - time.monotonic()))
        if (msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "status"
                and msg["content"]["execution_state"] == "idle"):
            return


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true")
    opts = parser.parse_args(argv)
    if opts.smoke:  # the script still runs; nothing is written
        overhead([2], 1), scenario(2, 1, 0.1, 2), interrupt(2, 1), stop_button(1)
        return 0
    result = {"overhead": overhead([2, 4], 15), "scenario": scenario(2, 5, 3.0, 20), "interrupt": interrupt(2, 5),
              "stop_button": stop_button(20)}
    (HERE / "results").mkdir(exist_ok=True)
    (HERE / "results" / "live.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
