"""A real 2-rank CPU training run: ``python -m nblaunch.demo``.

A small MLP learns a synthetic regression with DistributedDataParallel on
gloo; every rank reports its progress as it trains, and the per-rank final
losses come back to the caller.
"""
from __future__ import annotations

import argparse
import time

from .launcher import notebook_launcher
from .rank.progress import log, progress


def train(epochs: int = 8, steps_per_epoch: int = 25, batch: int = 64) -> float:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    true_w = torch.randn(16, 1)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(1000 + rank)  # each rank sees its own data
    loss = torch.tensor(0.0)
    step = 0
    for epoch in range(1, epochs + 1):
        for _ in progress(range(steps_per_epoch), desc=f"epoch {epoch}/{epochs}"):
            x = torch.randn(batch, 16, generator=gen)
            y = x @ true_w + 0.01 * torch.randn(batch, 1, generator=gen)
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            log(step=step, loss=loss.item())
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        mean /= world
        if rank == 0:
            print(f"epoch {epoch}/{epochs}: loss {mean.item():.4f} (mean over ranks)")
    return round(loss.item(), 4)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("-n", "--num-processes", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=8)
    opts = parser.parse_args(argv)
    start = time.perf_counter()
    from nblaunch.view import text

    text.STATUS_EVERY_S = 1.0  # a short demo: show the status often
    losses = notebook_launcher(train, kwargs={"epochs": opts.epochs}, num_processes=opts.num_processes)
    print(f"final loss per rank: {losses}  ({time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()
