#!/usr/bin/env bash
# The GPU path on a machine with GPUs, in one command (under 5 minutes):
# tests/test_gpu.py in real kernels, then a short DDP training on every
# visible GPU (NCCL), timed. Run after `bash .ci/setup` (a CUDA build of
# torch is needed: `pip install torch` without the CPU constraint), e.g.
#     bash bench/gpu_check.sh 2>&1 | tee gpu-check.txt
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
"$PY" -m pip install -q 'nvidia-ml-py' || true   # GPU columns in the view; optional
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv || true
"$PY" - <<'PYEOF'
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "GPUs", torch.cuda.device_count())
PYEOF
timeout 240 "$PY" -m pytest -p no:cacheprovider -q -rs tests/test_gpu.py
timeout 120 "$PY" - <<'PYEOF'
import time
import torch
from nblaunch import notebook_launcher

def ddp(steps):
    import time, torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    model = DDP(torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.ReLU(),
                                    torch.nn.Linear(4096, 4096)).cuda())
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(256, 4096, device="cuda")
    for _ in range(5):                                   # warm-up
        model(x).square().mean().backward(); opt.step(); opt.zero_grad()
    torch.cuda.synchronize(); dist.barrier()
    t = time.perf_counter()
    for _ in range(steps):
        model(x).square().mean().backward(); opt.step(); opt.zero_grad()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / steps

n = torch.cuda.device_count()
t = time.perf_counter()
per_step = notebook_launcher(ddp, args=(50,), num_processes=n, display="text")
print(f"DDP on {n} GPU(s), backend nccl: launch+train {time.perf_counter() - t:.1f} s, "
      f"{1e3 * max(per_step):.1f} ms/step (slowest rank)")
PYEOF
