"""A sharded DataLoader in one call, thin over torch's DistributedSampler."""
from __future__ import annotations

__all__ = ["sharded_loader"]


def sharded_loader(dataset, batch_size: int = 1, shuffle: bool = True, seed: int = 0,
                   drop_last: bool = False, **loader_kwargs):
    """A ``DataLoader`` over this rank's disjoint shard of ``dataset``.

    Call inside a launch (the process group gives rank and world size). The
    dataset itself is not copied per rank: under fork the ranks read the
    kernel's memory copy-on-write, under spawn/forkserver its tensors travel
    through shared memory. Call ``loader.sampler.set_epoch(epoch)`` each epoch
    for a new shuffle, as with DistributedSampler.
    """
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    sampler = DistributedSampler(dataset, shuffle=shuffle, seed=seed, drop_last=drop_last)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last, **loader_kwargs)
