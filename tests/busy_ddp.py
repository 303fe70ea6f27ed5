"""A compute-bound DDP loop on live ranks, for the stop button: shared by
tests/test_real_code_traps.py and bench/live.py (run as a cell's code).

``BUSY_DDP`` starts 2 live ranks as ``ranks`` and builds each rank's model;
``ranks.run(train, kind, attempt)`` then loops with no sleep until stopped,
over ``nblaunch.progress`` (``kind="progress"``), a tqdm bar (``"tqdm"``) or
a plain ``range`` (``"plain"``), printing ``looping <attempt>`` on rank 0
once it is well under way. Each rank counts its steps in ``steps_done``."""

BUSY_DDP = """
import nblaunch
ranks = nblaunch.start(2)

def setup():
    global model, opt, steps_done
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    steps_done = 0

def train(kind, attempt):
    global steps_done
    import torch
    from tqdm import tqdm
    from nblaunch import progress
    bar = {"progress": progress, "tqdm": tqdm, "plain": iter}[kind]
    x = torch.randn(32, 64)
    for i in bar(range(10**9)):          # compute-bound, no sleep: runs until stopped
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()                  # DDP's all-reduce
        opt.step()
        steps_done += 1
        if i == 20 and torch.distributed.get_rank() == 0:
            print(f"looping {attempt}", flush=True)

ranks.run(setup)
"""
