"""The public calls of background runs: ``submit`` and ``runs``
(:mod:`nblaunch.background.in_kernel`: a run in this kernel; :mod:`nblaunch.background.detached`: one
owned by a supervisor, ``attach``)."""
from __future__ import annotations

from typing import Callable, Optional, Sequence

from ..clusters import Spark
from ..config import LaunchConfig, check_call
from .detached import detached_runs, start_detached
from ..errors import refuse_inside_a_rank
from .. import registry
from .in_kernel import Run, new_id, start_here
from .listing import RunList

__all__ = ["submit", "runs"]

def submit(fn: Callable, args: Sequence = (), kwargs: Optional[dict] = None, *, num_processes: int,
           cpus: Optional[Sequence[int]] = None, devices: Optional[Sequence[int]] = None, detach: bool = False,
           **options) -> Run:
    """Start ``fn(*args, **kwargs)`` on ``num_processes`` ranks in the
    background and return its :class:`Run` at once (the ranks still starting).

    Takes every option of ``notebook_launcher``, and: ``cpus`` (CPU numbers
    every rank of this run is pinned to; threads per rank split them) and
    ``devices`` (GPU indices this run's ranks see, as ``CUDA_VISIBLE_DEVICES``),
    so that several runs can split a machine (a run whose ``devices`` overlap
    another running one's is refused); ``detach=True``: the run is owned by
    a supervisor process and survives the kernel (:func:`attach`); a
    cluster's agents then beat with it (``node_lost_after``) as with a kernel.
    The view appears in the calling cell and keeps moving while other cells
    run. Interrupting a cell never stops a run; ``run.stop()`` does."""
    args, kwargs = check_call(fn, args, kwargs)
    if not isinstance(detach, bool):
        raise TypeError(f"detach must be True or False, got {detach!r}")
    config = LaunchConfig(num_processes, cpus=cpus, devices=devices, background=True, **options)
    if detach and isinstance(config.cluster, Spark):
        raise ValueError("detach=True needs the run to outlive this kernel, and a Spark application lives in its "
                         "driver (this kernel): its executors end with it. Submit without detach=True")
    refuse_inside_a_rank("nblaunch.submit")
    with registry.submitting:  # two submits at once cannot both take the same free GPUs
        _check_devices_free(config)
        run = (start_detached if detach else start_here)(new_id(), config, fn, args, kwargs)
        registry.add_run(run)
    return run


def _check_devices_free(config: LaunchConfig) -> None:
    """Refuse GPUs that a running run of this machine uses (this kernel's, or detached)."""
    if config.devices is None:
        return
    for other in runs(all=True):
        if other.done() or other.config.devices is None:
            continue
        taken = sorted(set(config.devices) & set(other.config.devices))
        if taken:
            raise ValueError(f"devices {taken} are used by run {other.id} ({other.status}); "
                             f"give this run other GPUs, or stop that one first (run.stop())")


def runs(all: bool = False) -> RunList:
    """This kernel's runs, oldest first; ``all=True``: with every detached
    run of this machine (from other kernels too, or from before a restart).
    A list, shown in a notebook as a table: each run's id, state, ranks,
    progress, when it started and how long it ran."""
    mine = registry.runs()
    if not all:
        return RunList(mine)
    known = {r.id for r in mine}
    return RunList(mine + [r for r in detached_runs() if r.id not in known])


