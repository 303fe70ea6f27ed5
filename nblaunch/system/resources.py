"""What each rank uses, for its row in the view: CPU and memory of its whole
process tree (the rank and what it started, DataLoader workers included),
and its GPU's memory and utilisation.

Sampled in the kernel, by the watch loop, at most once a second: nothing runs
on a rank's training thread. CPU and memory come from psutil. GPUs are read
through NVML (``nvidia-ml-py``, an optional dependency: ``pip install
nblaunch[gpu]``), which never initialises CUDA in the kernel (that would rule
out forking ranks); where NVML is absent, a rank that uses CUDA reports the
memory torch holds on its device itself (``progress.send_gpu_memory``), without utilisation. A rank's
memory is flagged when the machine's available memory falls under
``LOW_MEMORY_FRACTION`` of the total, before the out-of-memory killer acts.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Optional

import psutil

__all__ = ["Usage", "Sampler", "gpu_devices", "children_of", "tree_of"]

INTERVAL_S = 1.0
# A rank's process that is not running nor waiting as processes do, in words (psutil's status):
# what "no progress" alone would hide.
STATES = {psutil.STATUS_STOPPED: "stopped (SIGSTOP)", psutil.STATUS_TRACING_STOP: "stopped by a tracer",
          psutil.STATUS_DISK_SLEEP: "in uninterruptible sleep (D: waiting on a disk, a mount or a driver)"}
RANKS_PER_S = 64  # at most this many ranks' trees sampled a second (above 16 the view shows few ranks' rows)
LOW_MEMORY_FRACTION = 0.10


@dataclass(frozen=True)
class Usage:
    cpu_percent: float  # over the rank's process tree; 100 = one core
    rss: int  # bytes, summed over the tree (shared pages counted in each process)
    memory_low: bool  # the machine is close to running out, and this rank is among the largest
    gpu: Optional[tuple] = None  # (device, used bytes, total bytes, utilisation % or None)
    state: str = ""  # the rank's process, when it cannot run: STATES' words ("stopped (SIGSTOP)")

    def text(self) -> str:
        parts = [self.state] if self.state else []
        parts += [f"cpu {self.cpu_percent:.0f}%", f"mem {_size(self.rss)}" + (" (memory low!)" if self.memory_low else "")]
        if self.gpu is not None:
            device, used, total, util = self.gpu
            parts.append(f"gpu{device} {_size(used)}/{_size(total)}" + (f" {util}%" if util is not None else ""))
        return " ".join(parts)


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


class Sampler:
    """``sample(pids)`` at most every ``INTERVAL_S``; None between samples."""

    def __init__(self, devices: dict[int, int], first_after: float = INTERVAL_S):
        """``devices``: local rank -> the GPU index it uses (empty on CPU).
        The first sample is due ``first_after`` seconds in (by default a
        second: a short launch never pays for one)."""
        self._procs: dict[int, psutil.Process] = {}
        self._last = time.monotonic() - INTERVAL_S + first_after
        self._devices = devices
        self._nvml = _nvml() if devices else None
        self.reported: dict[int, tuple] = {}  # local rank -> its own GPU reading, without NVML

    def sample(self, pids: dict[int, int]) -> Optional[dict[int, Usage]]:
        now = time.monotonic()
        # A rank's sample costs the kernel about 0.3 ms: with hundreds of
        # ranks, the samples come less often rather than cost more.
        if now - self._last < max(INTERVAL_S, len(pids) / RANKS_PER_S):
            return None
        self._last = now
        children = children_of(list(pids.values()))
        usage = {}
        for rank, pid in pids.items():
            cpu = rss = 0.0
            state = ""
            for proc in self._tree(pid, children):
                try:
                    with proc.oneshot():
                        cpu += proc.cpu_percent(None)  # since the last sample (0 the first time)
                        rss += proc.memory_info().rss
                        if proc.pid == pid:
                            state = STATES.get(proc.status(), "")
                except psutil.Error:
                    pass
            usage[rank] = (cpu, int(rss), state)
        vm = psutil.virtual_memory()
        low = vm.available < LOW_MEMORY_FRACTION * vm.total
        biggest = max((rss for _, rss, _ in usage.values()), default=0)
        return {rank: Usage(cpu, rss, low and rss >= 0.5 * biggest, self._gpu(rank), state)
                for rank, (cpu, rss, state) in usage.items()}

    def _tree(self, pid: int, children: dict[int, list[int]]) -> list[psutil.Process]:
        pids, todo = [], [pid]
        while todo:
            p = todo.pop()
            pids.append(p)
            todo += children.get(p, [])
        procs = []
        for p in pids:
            # Reuse Process objects: cpu_percent measures since that object's last call.
            proc = self._procs.get(p)
            if proc is None:
                try:
                    proc = self._procs[p] = psutil.Process(p)
                except psutil.Error:
                    continue
            procs.append(proc)
        return procs

    def _gpu(self, rank: int) -> Optional[tuple]:
        device = self._devices.get(rank)
        if self._nvml is None or device is None:
            return self.reported.get(rank)
        try:
            handle = self._nvml.nvmlDeviceGetHandleByIndex(device)
            memory = self._nvml.nvmlDeviceGetMemoryInfo(handle)
            util = self._nvml.nvmlDeviceGetUtilizationRates(handle).gpu
            return device, int(memory.used), int(memory.total), int(util)
        except Exception:
            return None


def children_of(pids: list[int]) -> dict[int, list[int]]:
    """Parent pid -> its children's, for the trees under ``pids``: from
    Linux's ``/proc/PID/task/TID/children``, whose cost grows with the
    ranks' trees rather than with every process on the machine (a scan of
    the process table took 70 ms a sample on a busy machine); else that scan."""
    if not os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/children"):
        return _children_by_parent()
    children: dict[int, list[int]] = {}
    todo = list(pids)
    while todo:
        pid = todo.pop()
        found: list[int] = []
        try:
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                    found += map(int, f.read().split())
        except OSError:  # it ended while it was read: so did its part of the tree
            pass
        if found:
            children[pid] = found
            todo += found
    return children


def tree_of(pid: int) -> list[int]:
    """``pid`` and every process under it, parents before their children."""
    children = children_of([pid])
    tree, at = [pid], 0
    while at < len(tree):
        tree += children.get(tree[at], [])
        at += 1
    return tree


def _children_by_parent() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for proc in psutil.process_iter(["ppid"]):
        children.setdefault(proc.info["ppid"], []).append(proc.pid)
    return children


def gpu_devices(local_ranks: list[int]) -> dict[int, int]:
    """Local rank -> the NVML index of the GPU it uses (the rank sets device
    ``local_rank`` when it has one), through ``CUDA_VISIBLE_DEVICES``; empty
    without GPUs. Counting GPUs this way does not initialise CUDA."""
    import os
    import sys

    if "torch" not in sys.modules:
        return {}
    import torch  # waits if another thread is still importing it

    count = torch.cuda.device_count()
    if not count:
        return {}
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    physical = list(range(count))
    if visible:
        try:
            physical = [int(v) for v in visible.split(",") if v.strip()][:count]
        except ValueError:  # GPU UUIDs: not mapped here
            return {}
    return {rank: physical[rank] for rank in local_ranks if rank < len(physical)}


def _nvml():
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml
    except Exception:  # not installed, no driver, no GPU
        return None
