"""One "node" of a multi-node launch, run as its own process by test_nodes.py.

Usage: python node_launch.py SCENARIO ENDPOINT BACKEND RDZV_ID [NODE_RANK] [extra json kwargs]
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

    fn = {"ok": reduce_ranks, "raise": fail_on_rank3, "flaky": flaky_rank3, "forever": forever}[scenario]
    try:
        results = nblaunch.notebook_launcher(
            fn, num_processes=2, num_nodes=2, node_rank=node_rank, rdzv_endpoint=endpoint,
            rdzv_backend=backend, rdzv_id=rdzv_id, display="text", **extra)
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
