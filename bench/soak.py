"""A week in half an hour (issue 48): a run on three SLURM nodes that keeps its size, then many launches in one kernel.

1. The soak: ``notebook_launcher(train, cluster="slurm", num_processes=1, max_restarts=12,
   min_nodes=2)`` from this process (the kernel), on the three fake nodes of ``.ci/slurm``,
   for ``--minutes`` (30). Every ``--every`` seconds (180) a node is lost, n3 and n2 in turn,
   alternating SIGKILL (its agent and its slurmd) and SIGSTOP (its slurmd and the launch's
   processes there), and ``--down`` seconds later (60) it is back (slurmd started again, or
   SIGCONT; SLURM keeps it in the ``--no-kill`` job for ``SlurmdTimeout``, 300 s on
   ``.ci/slurm`` as by default). Halfway, ``scancel --signal=USR1`` on the agents' step: a preemption notice; the
   launch returns what the ranks saved and is started again from the checkpoint, as a requeued
   job would be. ``train`` adds ``step`` to a sum at each step and saves both every 10 steps
   and on any notice (a resize is one), so the final sum says whether a step was lost or
   counted twice.
   Reported: the right final result, the time spent at each size, the steps lost per event,
   the kernel's memory, open files and threads before, during and after, nothing left.
2. ``--launches`` (1000) launches and ``--runs`` (100) background runs of a trivial job (2
   ranks here, an ``all_reduce``) in this same process: the same resources, before and after.

    python bench/soak.py                       # about 40 minutes
    python bench/soak.py --minutes 10 --every 120 --down 40 --launches 200 --runs 20
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "tests")]

import recovery  # noqa: E402 - the allocation of three nodes
import slurm_cluster  # noqa: E402 - the three-node lock

TRAIN = r'''
import json, os, time, nblaunch
def train(folder, launch, until):
    import torch, torch.distributed as dist
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = f"{launch}-{os.environ['TORCHELASTIC_RESTART_COUNT']}"
    ckpt = os.path.join(folder, "ckpt.json")
    state = json.load(open(ckpt)) if os.path.exists(ckpt) else {"step": 0, "sum": 0}
    step, total = state["step"], state["sum"]

    def note(name, **what):
        if rank == 0:
            with open(os.path.join(folder, f"{name}-{gen}.tmp"), "w") as f:
                json.dump(dict(what, time=time.time(), world=world, step=step), f)
            os.replace(os.path.join(folder, f"{name}-{gen}.tmp"), os.path.join(folder, f"{name}-{gen}.json"))

    def save():
        if rank == 0:
            with open(ckpt + ".tmp", "w") as f:
                json.dump({"step": step, "sum": total}, f)
            os.replace(ckpt + ".tmp", ckpt)

    note("start")
    t = torch.ones(1)
    while time.time() < until:
        dist.all_reduce(t)
        total, step = total + step, step + 1
        note("reached")
        notice = nblaunch.preempted(agree=True)
        if notice or step % 10 == 0:
            save()
        if notice:
            return {"step": step, "sum": total, "world": world, "why": nblaunch.preempt_reason()}
        time.sleep(0.1)
    save()
    return {"step": step, "sum": total, "world": world, "done": True}

def trivial():
    import torch, torch.distributed as dist
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()
'''


def usage() -> dict:
    gc.collect()
    p = psutil.Process()
    return {"time": time.time(), "rss_mb": round(p.memory_info().rss / 2**20, 1), "open_files": p.num_fds(),
            "threads": p.num_threads(), "children": len(p.children(recursive=True))}


def _children() -> list:
    """This process's children, by command (a background run's forkserver stays for the kernel's life)."""
    out = []
    for c in psutil.Process().children(recursive=True):
        try:
            out.append(" ".join(c.cmdline())[:120])
        except psutil.Error:
            pass
    return out


def _agent(job: str, node: str):
    from test_slurm import _agents

    for p in _agents(job):
        try:
            if p.environ().get("SLURMD_NODENAME") == node and p.parent().name() == "slurmstepd":
                return p
        except psutil.Error:
            pass
    return None


def _slurmd(node: str) -> int:
    from test_slurm_resilience import _slurmd_pid

    return _slurmd_pid(node)


class Chaos:
    """Loses a node every ``every`` s, brings it back ``down`` s later, preempts once halfway; samples the kernel."""

    def __init__(self, job: str, t0: float, until: float, every: float, down: float):
        self.job, self.t0, self.until, self.every, self.down = job, t0, until, every, down
        self.events: list = []
        self.samples: list = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self):
        self._thread.start()

    def stop(self):
        self._stop.set()
        self._thread.join()

    def _sleep_until(self, t: float) -> bool:
        while time.time() < t:
            if self._stop.wait(min(10.0, t - time.time())):
                return False
            self.samples.append(usage())
        return True

    def _run(self):
        # Halfway, once that half's node is back and taken back: a notice while a node is
        # down would start the next launch on a node that is not there.
        i, preempt_at = 0, self.t0 + (self.until - self.t0) / 2 + self.down + 45
        while True:
            at = self.t0 + self.every * (i + 1)
            if at + self.down + 30 > self.until:
                break
            if preempt_at is not None and preempt_at < at:
                if not self._sleep_until(preempt_at):
                    return
                self._preempt()
                preempt_at = None
            if not self._sleep_until(at):
                return
            node, how = ("n3", "n2")[(i // 2) % 2], ("SIGKILL", "SIGSTOP")[i % 2]
            stopped = self._lose(node, how)
            try:
                self._sleep_until(at + self.down)
            finally:
                self._back(node, how, stopped)
            i += 1
        self._sleep_until(self.until)

    def _lose(self, node: str, how: str) -> list:
        agent = None
        for _ in range(100):  # between two generations there may be no agent for a moment
            agent = _agent(self.job, node)
            if agent is not None:
                break
            time.sleep(0.1)
        slurmd = _slurmd(node)
        pids = ([agent.pid] + [c.pid for c in agent.children(recursive=True)] if agent else [])
        sig = signal.SIGKILL if how == "SIGKILL" else signal.SIGSTOP
        t = time.time()
        for pid in ([pids[0]] if how == "SIGKILL" and pids else pids) + [slurmd]:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        self.events.append({"time": t, "what": f"{node} lost ({how})", "agent_found": agent is not None})
        return pids + [slurmd] if how == "SIGSTOP" else []

    def _back(self, node: str, how: str, stopped: list):
        if how == "SIGKILL":
            subprocess.run(["slurmd", "-N", node, "-f", os.environ.get("SLURM_CONF", "/etc/slurm/slurm.conf")],
                           timeout=30)
        for pid in stopped:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        self.events.append({"time": time.time(), "what": f"{node} back"})

    def _preempt(self):
        out = subprocess.run(["squeue", "-h", "-s", "-j", self.job, "-o", "%i %j"], capture_output=True, text=True,
                             timeout=20).stdout.split("\n")
        step = [line.split()[0] for line in out if "nblaunch-agents" in line]
        if step:
            subprocess.run(["scancel", "--signal=USR1", step[0]], timeout=20)
        self.events.append({"time": time.time(), "what": "preemption notice (scancel --signal=USR1 on the step)",
                            "sent": bool(step)})


def generations(folder: Path) -> list:
    """Each generation: when and at which step it started, its size, the last step it reached and when."""
    gens = []
    for start in sorted(folder.glob("start-*.json"), key=lambda p: json.loads(p.read_text())["time"]):
        name = start.name[len("start-"):]
        s = json.loads(start.read_text())
        reached = folder / f"reached-{name}"
        r = json.loads(reached.read_text()) if reached.exists() else s
        gens.append({"gen": name[:-5], "world": s["world"], "from_step": s["step"], "to_step": r["step"],
                     "start": s["time"], "end": r["time"]})
    return gens


def soak(opts, ns: dict) -> dict:
    import nblaunch

    folder = Path(tempfile.mkdtemp(prefix="nblaunch-soak-"))
    job, ours = recovery._allocation()  # noqa: SLF001
    os.environ["SLURM_JOB_ID"] = job
    before = usage()
    t0 = time.time()
    until = t0 + opts.minutes * 60
    chaos = Chaos(job, t0, until, opts.every, opts.down)
    chaos.start()
    launches, results = [], None
    try:
        while time.time() < until - 5:
            try:
                res = nblaunch.notebook_launcher(ns["train"], (str(folder), len(launches), until), num_processes=1,
                                                 cluster="slurm", max_restarts=12, min_nodes=2, preempt_grace=30,
                                                 display="none")
                launches.append({"restarts": res.restarts, "returned": list(res)})
                results = list(res)
                if all(r.get("done") for r in res):
                    break
            except (nblaunch.Preempted, nblaunch.WorkerError, nblaunch.LaunchError) as exc:
                launches.append({"error": f"{type(exc).__name__}: {str(exc)[:600]}"})
    finally:
        chaos.stop()
        after_run = usage()
        from test_slurm import _agents
        left_agents = [p.pid for p in _agents(job)]
        if ours:
            subprocess.run(["scancel", job], timeout=30)
        for node in ("n1", "n2", "n3"):  # every slurmd up again, whatever happened
            pid = _slurmd(node)
            if pid is None or not psutil.pid_exists(pid):
                subprocess.run(["slurmd", "-N", node, "-f", os.environ.get("SLURM_CONF", "/etc/slurm/slurm.conf")])
    gens = generations(folder)
    ckpt = json.loads((folder / "ckpt.json").read_text())
    at_size: dict = {}
    for g in gens:
        at_size[g["world"]] = at_size.get(g["world"], 0.0) + g["end"] - g["start"]
    lost_steps = [{"after": a["gen"], "steps_lost": a["to_step"] - b["from_step"],
                   "seconds_without_a_step": round(b["start"] - a["end"], 1), "to_nodes": b["world"]}
                  for a, b in zip(gens, gens[1:])]
    step = results[0]["step"] if results else None
    return {
        "minutes": opts.minutes, "every_s": opts.every, "down_s": opts.down,
        "right_final_result": bool(results) and all(r["sum"] == r["step"] * (r["step"] - 1) // 2 for r in results),
        "final_step": step, "checkpoint": ckpt, "launches": launches, "events": [
            dict(e, at_s=round(e.pop("time") - t0, 1)) for e in chaos.events],
        "seconds_at_size": {f"{k} nodes": round(v, 1) for k, v in sorted(at_size.items())},
        "seconds_without_a_step": round((until - t0) - sum(at_size.values()), 1),
        "per_event": lost_steps, "generations": len(gens),
        "kernel": {"before": before, "during_max": {k: max(s[k] for s in chaos.samples or [before])
                                                     for k in ("rss_mb", "open_files", "threads")},
                   "after": after_run, "rss_growth_mb": round(after_run["rss_mb"] - before["rss_mb"], 1)},
        "left": {"agents": left_agents, "children": _children()},
    }


def many(opts, ns: dict) -> dict:
    import nblaunch

    os.environ.pop("SLURM_JOB_ID", None)
    out = {}
    for what, count in (("launches", opts.launches), ("background runs", opts.runs)):
        if not count:
            continue
        nblaunch.notebook_launcher(ns["trivial"], num_processes=2, display="none")  # warm: first-use costs aside
        before, t0, samples = usage(), time.time(), []
        for i in range(count):
            if what == "launches":
                assert nblaunch.notebook_launcher(ns["trivial"], num_processes=2, display="none") == [2.0, 2.0]
            else:
                assert nblaunch.submit(ns["trivial"], num_processes=2, display="none").result() == [2.0, 2.0]
            if (i + 1) % max(1, count // 10) == 0:
                samples.append(usage())
        after = usage()
        out[what] = {"count": count, "seconds": round(time.time() - t0, 1), "before": before, "after": after,
                     "samples": samples, "rss_growth_mb": round(after["rss_mb"] - before["rss_mb"], 1),
                     "left": _children()}
        print(f"{count} {what}: {out[what]['seconds']} s, RSS {before['rss_mb']} -> {after['rss_mb']} MB, "
              f"open files {before['open_files']} -> {after['open_files']}, "
              f"threads {before['threads']} -> {after['threads']}", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--every", type=float, default=180.0, help="seconds between two losses")
    # Below SlurmdTimeout (300 s on .ci/slurm, SLURM's default): a slurmd silent that long is taken
    # out of a --no-kill job by SLURM for good.
    parser.add_argument("--down", type=float, default=60.0, help="seconds a lost node stays down")
    parser.add_argument("--launches", type=int, default=1000)
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--skip-soak", action="store_true")
    parser.add_argument("--out", default=str(HERE / "results" / "soak.json"))
    opts = parser.parse_args()
    ns: dict = {"__name__": "bench_soak"}  # not importable: fn travels by value
    exec(TRAIN, ns)
    report: dict = {"machine": f"{os.cpu_count()} CPUs", "python": sys.version.split()[0],
                    "torch": __import__("torch").__version__, "date": time.strftime("%Y-%m-%d %H:%M")}
    if not opts.skip_soak:
        with slurm_cluster.losing_a_node():
            report["soak"] = soak(opts, ns)
        print(json.dumps(report["soak"], indent=1, default=str), flush=True)
        Path(opts.out).write_text(json.dumps(report, indent=1, default=str) + "\n")
    report.update(many(opts, ns))
    Path(opts.out).write_text(json.dumps(report, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
