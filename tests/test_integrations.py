"""Libraries that read the torchrun environment work inside a launch unchanged."""
from __future__ import annotations

import pytest

from nblaunch import notebook_launcher


def accelerate_gather():
    import torch
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    both = acc.gather(torch.tensor([acc.process_index * 10.0 + 1]))
    return acc.num_processes, acc.process_index, both.tolist(), acc.distributed_type.value


@pytest.mark.parametrize("method", ["fork", "forkserver"])
def test_accelerator_inside_fn_sees_the_launch(method):
    results = notebook_launcher(accelerate_gather, num_processes=2, start_method=method, display="none")
    assert [r[0] for r in results] == [2, 2]
    assert [r[1] for r in results] == [0, 1]
    assert all(r[2] == [1.0, 11.0] for r in results)
    assert {r[3] for r in results} == {"MULTI_CPU"}
