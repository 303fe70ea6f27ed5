"""What progress()/log() cost a training loop.

1. Per-iteration cost of ``nblaunch.progress`` inside a launch (the reporter
   thread running) against one ``tqdm`` iteration, side by side in a rank:
   a tqdm bar on the rank's stderr (mirrored into the rank's row, its text
   silenced) and one writing to a file (left alone: drawing text as usual).
   Also what making a rank look like a torchrun rank costs at its start
   (``rank_env``) with torch, transformers and Lightning already imported,
   and what the view's once-a-second resource sample costs the kernel.
2. A 2-rank DDP MLP loop calling ``progress`` and ``log`` every step under
   nblaunch, against the same loop without them under torch.multiprocessing
   fork. Only the loop is timed (inside the ranks), medians over alternating
   repetitions.

    python bench/overhead.py            # full
    python bench/overhead.py --smoke    # CI
"""
from __future__ import annotations

import argparse
import io
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def per_iteration(n: int) -> dict:
    from tqdm import tqdm

    from nblaunch import progress

    def timed(make):
        t = time.perf_counter_ns()
        for _ in make():
            pass
        return (time.perf_counter_ns() - t) / n

    sink = io.StringIO()
    out = {}
    for name, make in [("bare loop", lambda: range(n)),
                       ("nblaunch.progress", lambda: progress(range(n))),
                       ("tqdm, mirrored to the row", lambda: tqdm(range(n), mininterval=0.1)),
                       ("tqdm, drawing text", lambda: tqdm(range(n), file=sink, mininterval=0.1))]:
        out[name] = min(timed(make) for _ in range(5))
    return out


def sampling_ms(ranks: int = 4, children: int = 2) -> float:
    """One resource sample (CPU and memory of each rank's tree, as the view
    takes once a second in the kernel) over ``ranks`` processes with
    ``children`` each, like DataLoader workers."""
    import subprocess

    from nblaunch.system.resources import INTERVAL_S, Sampler

    code = "import subprocess, sys, time; [subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']) " \
           f"for _ in range({children})]; time.sleep(60)"
    procs = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(ranks)]
    try:
        time.sleep(1.0)
        sampler = Sampler({})
        times = []
        for _ in range(6):
            sampler._last = 0.0  # due now
            t = time.perf_counter()
            sampler.sample({i: p.pid for i, p in enumerate(procs)})
            times.append(time.perf_counter() - t)
        return statistics.median(times[1:]) * 1e3 / INTERVAL_S
    finally:
        for p in procs:
            import psutil
            for c in psutil.Process(p.pid).children(recursive=True):
                c.kill()
            p.kill()
            p.wait()


def rank_setup_ms() -> float:
    """The part of ``rank_env.become_rank`` that grows with what is imported:
    the walk over loaded modules and loggers."""
    import pytorch_lightning  # noqa: F401
    import transformers.trainer  # noqa: F401

    from nblaunch.rank import integrations
    from nblaunch.rank import env as rank_env

    t = time.perf_counter()
    for _ in range(5):
        integrations.fix_import_time_answers()
        rank_env._repoint_logging((sys.stdout, sys.stderr))
    return (time.perf_counter() - t) / 5 * 1e3


def _loop(steps: int, report: bool) -> float:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from nblaunch import log, progress

    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(128, 64), torch.randn(128, 1)
    steps_iter = progress(range(steps), desc="train") if report else range(steps)
    dist.barrier()
    t = time.perf_counter()
    for _ in steps_iter:
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if report:
            log(loss=loss.item())
        else:
            loss.item()  # the same host sync the logging version pays
    return time.perf_counter() - t


def _torch_rank(index, steps, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(index), WORLD_SIZE="2")
    import torch
    import torch.distributed as dist

    from nblaunch.engines.plan import default_threads

    torch.set_num_threads(default_threads(2))  # what nblaunch gives each rank: compare loops, not thread counts
    dist.init_process_group("gloo")
    elapsed = _loop(steps, report=False)
    if index == 0:
        out.put(elapsed)
    dist.destroy_process_group()


def loop_overhead(steps: int, reps: int) -> dict:
    import torch.multiprocessing as tmp

    from nblaunch import notebook_launcher

    with_report, without, plain = [], [], []
    ctx = tmp.get_context("fork")
    for _ in range(reps):
        with_report.append(notebook_launcher(_loop, args=(steps, True), num_processes=2, display="none")[0])
        plain.append(notebook_launcher(_loop, args=(steps, False), num_processes=2, display="none")[0])
        q = ctx.SimpleQueue()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        tmp.start_processes(_torch_rank, args=(steps, port, q), nprocs=2, start_method="fork")
        without.append(q.get())
    a, b, c = statistics.median(with_report), statistics.median(without), statistics.median(plain)
    return {"steps": steps, "nblaunch_with_progress_log_s": a, "torch_fork_plain_s": b,
            "nblaunch_plain_s": c, "ratio": a / b, "ratio_same_launcher": a / c}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true")
    opts = parser.parse_args(argv)
    n, steps, reps = (10_000, 50, 1) if opts.smoke else (1_000_000, 400, 7)
    from nblaunch import notebook_launcher

    iters = notebook_launcher(per_iteration, args=(n,), num_processes=1, display="none")[0]
    setup_ms = notebook_launcher(rank_setup_ms, num_processes=1, display="none")[0]
    sample_ms = sampling_ms()
    loop = loop_overhead(steps, reps)
    print("per-iteration cost inside a rank (ns):")
    for name, ns in iters.items():
        print(f"  {name:26s} {ns:8.1f}")
    print(f"rank set-up walk (torch, transformers, Lightning imported): {setup_ms:.2f} ms")
    print(f"resource sampling in the kernel, 4 ranks x 3 processes: {sample_ms:.2f} ms per second")
    print(f"2-rank DDP loop, {steps} steps: nblaunch with progress+log {loop['nblaunch_with_progress_log_s']:.3f} s, "
          f"torch fork plain {loop['torch_fork_plain_s']:.3f} s (ratio {loop['ratio']:.3f}); "
          f"nblaunch plain {loop['nblaunch_plain_s']:.3f} s (ratio {loop['ratio_same_launcher']:.3f})")
    if not opts.smoke:
        (HERE / "results").mkdir(exist_ok=True)
        (HERE / "results" / "overhead.json").write_text(json.dumps({"per_iteration_ns": iters, "rank_setup_ms": setup_ms,
                                                                      "sampling_ms_per_s": sample_ms,
                                                                      "loop": loop}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
