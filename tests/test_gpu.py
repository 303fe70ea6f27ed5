"""The GPU path on a real GPU, in real kernels. Skipped where CUDA is not
available (CI has no GPU); `bash bench/gpu_check.sh` runs these and a DDP
timing on a machine with GPUs. With one GPU, what one GPU allows runs (1-rank
NCCL, 2 ranks on gloo with CUDA tensors); the NCCL failure test needs two."""
from __future__ import annotations

import json
import textwrap

import pytest
import torch

from conftest import Kernel

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [pytest.mark.skipif(GPUS == 0, reason="needs CUDA: no GPU on this machine"),
              pytest.mark.timeout(600)]


@pytest.fixture
def gpu_kernel():
    k = Kernel()
    try:
        assert k.execute("import json, torch\nfrom nblaunch import notebook_launcher, WorkerError").error is None
        yield k
    finally:
        k.shutdown()


def _json(reply):
    assert reply.error is None, "\n".join(reply.error.get("traceback", []))
    return json.loads(reply.stdout.strip().splitlines()[-1])


def test_cuda_in_the_kernel_means_forkserver_said_so_and_the_kernel_context_untouched(gpu_kernel):
    reply = gpu_kernel.execute(textwrap.dedent("""
        mine = torch.ones(4, device="cuda")            # CUDA initialised in an earlier cell
        def where():
            import torch
            return torch.cuda.current_device(), (torch.ones(2, device="cuda") * 2).sum().item()
        out = notebook_launcher(where, num_processes=1, display="text", backend="gloo")
        print(json.dumps([out, mine.sum().item(), torch.cuda.is_initialized()]))
    """))
    assert "CUDA is initialised in this kernel; starting ranks with forkserver" in reply.stdout
    assert _json(reply) == [[[0, 4.0]], 4.0, True]


def test_fork_after_cuda_is_refused_with_the_fix_named(gpu_kernel):
    reply = gpu_kernel.execute(textwrap.dedent("""
        torch.zeros(1, device="cuda")
        try:
            notebook_launcher(lambda: 1, num_processes=1, start_method="fork")
        except ValueError as e:
            print(json.dumps(str(e)))
    """))
    message = _json(reply)
    assert "CUDA is initialised in this kernel" in message and "start_method='auto'" in message


def test_backend_auto_is_nccl_with_a_gpu_per_rank_and_gloo_otherwise(gpu_kernel):
    reply = gpu_kernel.execute(textwrap.dedent(f"""
        def backend():
            import torch, torch.distributed as dist
            return dist.get_backend(), torch.cuda.current_device() if torch.cuda.is_available() else None
        one_each = notebook_launcher(backend, num_processes={GPUS}, display="none")
        too_many = notebook_launcher(backend, num_processes={GPUS + 1}, display="none")
        print(json.dumps([one_each, too_many]))
    """))
    one_each, too_many = _json(reply)
    assert one_each == [["nccl", i] for i in range(GPUS)]  # each rank on its own GPU: its local rank
    assert {b for b, _ in too_many} == {"gloo"}


def test_a_cuda_tensor_returned_by_a_rank_arrives_usable(gpu_kernel):
    reply = gpu_kernel.execute(textwrap.dedent("""
        def give():
            import torch
            return {"w": torch.arange(6.0, device="cuda").reshape(2, 3)}
        (got,) = notebook_launcher(give, num_processes=1, display="none")
        print(json.dumps([str(got["w"].device), (got["w"] * 2).sum().item()]))
    """))
    assert _json(reply) == ["cuda:0", 30.0]


def test_gpu_out_of_memory_names_the_rank_and_says_so(gpu_kernel):
    reply = gpu_kernel.execute(textwrap.dedent("""
        def hog():
            import torch, torch.distributed as dist
            if dist.get_rank() == 0:
                total = torch.cuda.get_device_properties(0).total_memory
                torch.empty(2 * total, dtype=torch.uint8, device="cuda")
            dist.barrier()
        try:
            notebook_launcher(hog, num_processes=1, display="none")
        except WorkerError as e:
            print(json.dumps([e.rank, str(e).splitlines()[0]]))
    """))
    rank, first = _json(reply)
    assert rank == 0 and "OutOfMemoryError (the GPU ran out of memory)" in first


def test_two_ranks_on_gloo_with_cuda_tensors(gpu_kernel):
    reply = gpu_kernel.execute(textwrap.dedent("""
        def reduce_on_gpu():
            import torch, torch.distributed as dist
            t = torch.ones(3, device="cuda:0") * (dist.get_rank() + 1)   # both ranks on the one GPU
            cpu = t.cpu()
            dist.all_reduce(cpu)   # gloo reduces CPU tensors
            return (cpu.to("cuda:0") + 0).cpu().tolist()
        print(json.dumps(notebook_launcher(reduce_on_gpu, num_processes=2, backend="gloo", display="none")))
    """))
    assert _json(reply) == [[3.0] * 3, [3.0] * 3]


@pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs: an NCCL launch of 2 ranks")
def test_an_nccl_rank_that_raises_stops_the_others_within_seconds(gpu_kernel):
    reply = gpu_kernel.execute(textwrap.dedent("""
        import time
        def fail_while_peer_waits():
            import torch, torch.distributed as dist
            if dist.get_rank() == 1:
                time.sleep(0.5)
                raise ValueError("rank 1 gives up")
            dist.all_reduce(torch.ones(1, device="cuda"))   # NCCL: does not die to SIGTERM
        t = time.monotonic()
        try:
            notebook_launcher(fail_while_peer_waits, num_processes=2, display="none")
        except WorkerError as e:
            print(json.dumps([e.rank, time.monotonic() - t]))
    """))
    rank, took = _json(reply)
    assert rank == 1 and took < 15


def test_rows_show_the_gpu_of_each_rank(gpu_kernel):
    pytest.importorskip("pynvml", reason="GPU columns need nvidia-ml-py (pip install nblaunch[gpu])")
    from conftest import rows_updates

    reply = gpu_kernel.execute(textwrap.dedent("""
        def busy_gpu():
            import time, torch
            x = torch.randn(2048, 2048, device="cuda")
            end = time.monotonic() + 3
            while time.monotonic() < end:
                x = x @ x; x = x / x.norm()
            torch.cuda.synchronize()
        notebook_launcher(busy_gpu, num_processes=1)
    """))
    assert reply.error is None, reply.error
    rows = [row[2] for u in rows_updates(reply.outputs) for row in u.rows]
    assert any("gpu0 " in text for text in rows), rows[-5:]


def test_a_one_rank_nccl_launch_works(gpu_kernel):
    """With a loose bound on a warm kernel's second launch."""
    reply = gpu_kernel.execute(textwrap.dedent("""
        import time
        def nccl_once():
            import torch, torch.distributed as dist
            t = torch.ones(1, device="cuda"); dist.all_reduce(t); return t.item()
        notebook_launcher(nccl_once, num_processes=1, display="none", backend="nccl")
        t = time.monotonic()
        out = notebook_launcher(nccl_once, num_processes=1, display="none", backend="nccl")
        print(json.dumps([out, time.monotonic() - t]))
    """))
    out, took = _json(reply)
    assert out == [1.0] and took < 30


def test_live_ranks_keep_a_cuda_model_across_calls(gpu_kernel):
    """Live ranks on the GPU: a model built on the device in one call is
    trained in the next, and a CUDA tensor pulled arrives on its device."""
    reply = gpu_kernel.execute(textwrap.dedent("""
        import nblaunch
        ranks = nblaunch.start(1, display="text")
        def build():
            global net
            net = torch.nn.Linear(8, 1).cuda()
        def step():
            net.weight.data += 1
            return net.weight.device.type, float(net.weight.sum())
        ranks.run(build)
        first, second = ranks.run(step)[0], ranks.run(step)[0]
        pulled = ranks.pull("net", rank=0).weight
        ranks.close()
        print(json.dumps([first[0], second[1] - first[1], pulled.device.type]))
    """))
    device, grown, pulled = _json(reply)
    # Each weight grew by 1 between the calls: 8 in all, up to float32 rounding of two sums.
    assert (device, pulled) == ("cuda", "cuda") and grown == pytest.approx(8.0, abs=1e-4)
