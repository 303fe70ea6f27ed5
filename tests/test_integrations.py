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


def hf_trainer(outdir):
    import torch
    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

    cfg = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=64, num_labels=2)
    torch.manual_seed(0)
    model = BertForSequenceClassification(cfg)  # built from a config: nothing to download

    class Tokens(torch.utils.data.Dataset):
        def __len__(self):
            return 64

        def __getitem__(self, i):
            ids = torch.randint(0, 100, (16,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": ids, "attention_mask": torch.ones(16, dtype=torch.long), "labels": int(ids[0] % 2)}

    args = TrainingArguments(output_dir=outdir, per_device_train_batch_size=8, per_device_eval_batch_size=8,
                             max_steps=6, report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), eval_dataset=Tokens())
    steps = trainer.train().global_step
    metrics = trainer.evaluate()
    return args.world_size, args.process_index, steps, "eval_loss" in metrics


def test_hf_trainer_trains_and_evaluates_on_two_ranks(tmp_path, monkeypatch):
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.setenv(var, "1")  # any download attempt fails loudly
    results = notebook_launcher(hf_trainer, args=(str(tmp_path),), num_processes=2, display="none")
    assert results == [(2, 0, 6, True), (2, 1, 6, True)]


def shards(n):
    import torch
    from torch.utils.data import TensorDataset

    from nblaunch import sharded_loader

    loader = sharded_loader(TensorDataset(torch.arange(n)), batch_size=4, shuffle=True, seed=1)
    return sorted(int(i) for (batch,) in loader for i in batch)


def test_sharded_loader_gives_disjoint_shards_that_cover_the_dataset():
    a, b = notebook_launcher(shards, args=(40,), num_processes=2, display="none")
    assert len(a) == len(b) == 20 and not set(a) & set(b) and sorted(a + b) == list(range(40))
