"""One "node" of a multi-node launch, run as its own process by test_nodes.py.

Usage: python node_launch.py SCENARIO ENDPOINT BACKEND RDZV_ID [NODE_RANK] [extra json kwargs]
(``args`` among the kwargs: fn's arguments; ``num_processes``/``num_nodes``: 2 and 2 unless given.)
Prints one JSON line: {"results": [...]} or {"error": type, "rank": r, "node": n, "text": str(exc)}.
"""
import json
import os
import signal
import sys

# A node's launcher is started from a terminal, where Ctrl-C is a
# KeyboardInterrupt. Tests left running detached (`nohup ... &` from a
# script) start everything with SIGINT ignored, which Python then keeps.
signal.signal(signal.SIGINT, signal.default_int_handler)


def _note_pid():
    """Rank pids go to a file the test reads, to check none outlives its launch."""
    with open(os.environ["NODE_TEST_PIDS"], "a") as f:
        f.write(f"{os.getpid()}\n")


def reduce_ranks():
    _note_pid()
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    env = {k: int(os.environ[k]) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                                            "GROUP_RANK", "NODE_RANK", "GROUP_WORLD_SIZE")}
    return {"sum": t.item(), "rank": dist.get_rank(), "world": dist.get_world_size(), **env}


def fail_on_rank3():
    _note_pid()
    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    if dist.get_rank() == 3:
        raise ValueError("rank three gives up")
    for _ in range(100):  # the others wait in collectives the failed rank never joins
        dist.all_reduce(t)
    return "not reached"


def forever():
    _note_pid()
    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    while True:
        dist.all_reduce(t)


def flaky_rank3():
    """Fails on rank 3 in the first attempt only."""
    if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
        return fail_on_rank3()
    return reduce_ranks() | {"restart": int(os.environ["TORCHELASTIC_RESTART_COUNT"])}


def train_dcp(folder, until=60, every=4):
    """A training loop whose weight is sharded over the ranks (a DTensor, as FSDP2 makes), saved by
    torch.distributed.checkpoint every ``every`` steps and resumed from the last whole save: DCP
    reshards it when the next generation has fewer ranks. The first generation steps slowly (the
    test kills a node mid-run); each generation's first step is noted in ``first-RESTART-RANK``."""
    _note_pid()
    import time

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import nblaunch

    entered = time.time()  # the rank's set-up (its process group) is done
    restart, rank, world = int(os.environ["TORCHELASTIC_RESTART_COUNT"]), dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    state = {"weight": distribute_tensor(torch.zeros(12, 4), mesh, [Shard(0)]), "step": torch.tensor(0)}
    latest = os.path.join(folder, "latest")
    if os.path.exists(latest):
        with open(latest) as f:
            dcp.load(state, checkpoint_id=f.read())
    start = int(state["step"])
    bar = nblaunch.progress(total=until, desc="train")
    bar.update(start)
    for step in range(start, until):
        state["weight"] = state["weight"] + 1  # a training step
        state["step"] = torch.tensor(step + 1)
        bar.update(1)
        if step == start:
            with open(os.path.join(folder, f"first-{restart}-{rank}"), "w") as f:
                json.dump({"time": time.time(), "entered": entered, "world": world}, f)
        if restart == 0:
            time.sleep(0.2)  # the first generation waits to be cut short
        if (step + 1) % every == 0:
            path = os.path.join(folder, f"step{step + 1}")
            dcp.save(state, checkpoint_id=path)
            if rank == 0:  # the pointer moves once the save is whole
                with open(latest + ".tmp", "w") as f:
                    f.write(path)
                os.replace(latest + ".tmp", latest)
            dist.barrier()
    bar.close()
    env = {k: int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE")}
    return {"restart": restart, "resumed_at": start, "step": int(state["step"]),
            "rows": state["weight"].to_local().shape[0], "mean": state["weight"].full_tensor().mean().item(), **env}


def train_grow(folder, until=200, every=5):
    """Steps that save a plain checkpoint every ``every`` and on a notice (a resize is one), then
    return; slow (0.2 s a step) until the run has been on two nodes and is on three again (the
    test kills a node, then starts a launcher again). Each generation's first step is noted in
    ``first-PHASE-RANK``: ``a`` three nodes at first, ``b`` two, ``c`` three again."""
    _note_pid()
    import time

    import torch
    import torch.distributed as dist

    import nblaunch

    rank, world = dist.get_rank(), dist.get_world_size()
    shrunk = os.path.join(folder, "shrunk")
    if world == 2 and rank == 0:
        open(shrunk, "w").close()
    phase = "b" if world == 2 else ("c" if os.path.exists(shrunk) else "a")
    ckpt = os.path.join(folder, "ckpt")
    start = int(open(ckpt).read()) if os.path.exists(ckpt) else 0

    def save(step):
        if rank == 0:
            with open(ckpt + ".tmp", "w") as f:
                f.write(str(step))
            os.replace(ckpt + ".tmp", ckpt)
        dist.barrier()

    t = torch.ones(1)
    for step in nblaunch.progress(range(start, until), desc="train"):
        dist.all_reduce(t)
        if step == start:
            with open(os.path.join(folder, f"first-{phase}-{rank}"), "w") as f:
                json.dump({"time": time.time(), "world": world, "start": start, "pid": os.getpid()}, f)
        if nblaunch.preempted(agree=True):
            save(step)
            with open(os.path.join(folder, f"notice-{phase}-{rank}"), "w") as f:
                f.write(nblaunch.preempt_reason())
            return {"phase": phase, "resized_at": step}
        if (step + 1) % every == 0:
            save(step + 1)
        if phase != "c":
            time.sleep(0.2)
    return {"phase": phase, "world": world, "start": start, "step": until, "RANK": rank,
            "restart": int(os.environ["TORCHELASTIC_RESTART_COUNT"])}


def main():
    scenario, endpoint, backend, rdzv_id = sys.argv[1:5]
    node_rank = int(sys.argv[5]) if len(sys.argv) > 5 and sys.argv[5] != "-" else None
    extra = json.loads(sys.argv[6]) if len(sys.argv) > 6 else {}
    import torch

    # A fake, stated: this CPU machine cannot initialise CUDA, so the check is
    # that nothing on the launch path even asks torch to.
    def no_cuda(*a, **k):
        raise AssertionError("the launcher tried to initialise CUDA in the parent")

    torch.cuda._lazy_init = no_cuda
    torch.randn(256, 256).sum()  # the parent has used OpenMP, as a notebook would have
    import nblaunch

    fn = {"ok": reduce_ranks, "raise": fail_on_rank3, "flaky": flaky_rank3, "forever": forever,
          "dcp": train_dcp, "grow": train_grow}[scenario]
    args = extra.pop("args", ())
    sizes = {"num_processes": 2, "num_nodes": 2} | extra
    try:
        results = nblaunch.notebook_launcher(
            fn, args, node_rank=node_rank, rdzv_endpoint=endpoint,
            rdzv_backend=backend, rdzv_id=rdzv_id, display="text", **sizes)
        out = {"results": results}
    except KeyboardInterrupt:
        out = {"error": "KeyboardInterrupt"}
    except Exception as exc:
        out = {"error": type(exc).__name__, "rank": getattr(exc, "rank", None),
               "node": getattr(exc, "node", None), "text": str(exc)}
    out["cuda_initialized"] = torch.cuda.is_initialized()
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
