"""Launch cost per added node, nblaunch against ``srun``, 2 to 8 fake SLURM
nodes (#40), for ``bench/slurm.py --nodes``.

The test cluster (``.ci/slurm``: n1-n3) is shared with the test runs, so the
sweep starts a private one of its own (the script's private-cluster option:
its own ``SLURM_CONF``, controller port and state folder), runs on it, and
stops it after: only the daemons it started, by the pids in its folder.

Per node count, one rank per node (each node has this machine's 2 CPUs);
each rank joins a gloo group and does one ``all_reduce``; wall time from
the call to every rank done; alternating, medians; a least-squares line of
seconds against nodes gives the cost per added node.
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from slope import fit

ROOT = Path(__file__).resolve().parent.parent
PORT = int(os.environ.get("BENCH_SLURM_PORT", 18817))  # the shared cluster's is 16817


@contextlib.contextmanager
def private_cluster(nodes: int):
    """A SLURM cluster of ``nodes`` nodes for this process alone: its
    environment points SLURM's commands at it meanwhile."""
    folder = Path(tempfile.mkdtemp(prefix="nblaunch-bench-slurm-"))
    env = {"SLURM_CONF": str(folder / "slurm.conf"), "NBLAUNCH_SLURM_PORT": str(PORT),
           "NBLAUNCH_SLURM_NODES": str(nodes), "NBLAUNCH_SLURM_DIR": str(folder)}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        subprocess.run(["bash", str(ROOT / ".ci" / "slurm")], check=True, stdout=subprocess.DEVNULL)
        yield folder
    finally:
        _stop(folder)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(folder, ignore_errors=True)


def _stop(folder: Path) -> None:
    """The daemons this sweep started, by their pid files (no name matching:
    the shared cluster's daemons have the same names)."""
    pids = []
    for pidfile in folder.glob("*.pid"):
        with contextlib.suppress(ValueError, OSError):
            pids.append(int(pidfile.read_text().strip()))
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 15
    for pid in pids:
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def _srun(job: str, script: str, nodes: int, port: int, per_node: int = 1) -> float:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SRUN_")) or k == "SLURM_CONF"}
    env.update(BENCH_NODE_ADDR="127.0.0.1", BENCH_PORT=str(port))
    t = time.perf_counter()
    subprocess.run(["srun", f"--jobid={job}", "--overlap", f"--nodes={nodes}", f"--ntasks-per-node={per_node}",
                    "--kill-on-bad-exit=1", sys.executable, script, "srun"],
                   check=True, env=env, stdin=subprocess.DEVNULL)
    return time.perf_counter() - t


def _nblaunch(job: str, nodes: int, fn, per_node: int = 1) -> float:
    import nblaunch

    t = time.perf_counter()
    out = nblaunch.notebook_launcher(fn, num_processes=per_node, cluster=nblaunch.Slurm(job=job, nodes=nodes),
                                     display="none")
    took = time.perf_counter() - t
    assert list(out) == [float(nodes * per_node)] * (nodes * per_node), out
    return took


def sweep(sizes, rounds: int, train: str, fn, per_node: int = 1) -> dict:
    """On a private cluster of ``max(sizes)`` nodes: srun and nblaunch at
    each size, ``per_node`` ranks on each node (srun: that many tasks, each
    its own Python importing torch; nblaunch: one agent forking them)."""
    times: dict = {"srun": {n: [] for n in sizes}, "nblaunch": {n: [] for n in sizes}}
    with private_cluster(max(sizes)), tempfile.TemporaryDirectory() as tmp:
        out = subprocess.run(["salloc", "--no-shell", f"--nodes={max(sizes)}", f"--ntasks-per-node={per_node}",
                              "--job-name=nblaunch-bench-sweep"], capture_output=True, text=True, check=True)
        job = re.search(r"job allocation (\d+)", out.stdout + out.stderr).group(1)
        try:
            script = os.path.join(tmp, "train.py")
            Path(script).write_text(train)
            _srun(job, script, min(sizes), 29700, per_node)  # warm-up: the nodes' first step, file caches
            _nblaunch(job, min(sizes), fn, per_node)
            port = 29701
            for r in range(rounds):
                for n in sizes:
                    pair = [("srun", lambda: _srun(job, script, n, port, per_node)),
                            ("nblaunch", lambda: _nblaunch(job, n, fn, per_node))]
                    for name, call in (pair if r % 2 == 0 else pair[::-1]):
                        times[name][n].append(call())
                    port += 1
                    print(f"round {r + 1}, {n} nodes: srun {times['srun'][n][-1]:.2f} s, "
                          f"nblaunch {times['nblaunch'][n][-1]:.2f} s", flush=True)
        finally:
            subprocess.run(["scancel", job], check=False)
    med = {name: {n: statistics.median(v) for n, v in by.items()} for name, by in times.items()}
    fits = {name: fit(m) for name, m in med.items()}
    return {"scenario": f"N nodes x {per_node} rank(s) (gloo, one all_reduce), call -> every rank done, private cluster",
            "ranks_per_node": per_node,
            "rounds": rounds, "raw_s": times, "median_s": med, "fit": fits,
            "nblaunch/srun per added node": fits["nblaunch"]["per_rank_s"] / fits["srun"]["per_rank_s"]}


def table(result: dict) -> str:
    med = result["median_s"]
    lines = [f"| nodes ({result.get('ranks_per_node', 1)} rank(s) each) | srun (s) | nblaunch (s) |", "|---|---|---|"]
    for n in med["srun"]:
        lines.append(f"| {n} | {med['srun'][n]:.2f} | {med['nblaunch'][n]:.2f} |")
    f = result["fit"]
    lines.append(f"| per added node (fit) | **{1000 * f['srun']['per_rank_s']:.0f} ms** | "
                 f"**{1000 * f['nblaunch']['per_rank_s']:.0f} ms** |")
    return "\n".join(lines)
