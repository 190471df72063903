"""Input pipeline for the torch trainer (twin of ``jaxattn.data``): the numpy batches of ``twincore.data``
through a ``torch.utils.data.DataLoader`` (worker processes, pinned memory).

    ds = Dataset.from_source("synthetic", seq_len=128, batch_size=8, seed=0)
    for batch in loader(ds, start=0, stop=100, num_workers=1, pin_memory=True):   # int32 CPU tensors
        batch = {k: v.to("cuda", non_blocking=True) for k, v in batch.items()}

Each DataLoader item is one whole batch (``batch_size=None``: the numpy side already batches, packs and pads),
so the batches are exactly those of the JAX trainer for the same seed, in the same order.
"""

from __future__ import annotations

import sys

import torch
from torch.utils.data import DataLoader

from twincore.data import PACKING, SYNTHETIC, ByteTokenizer, Dataset, HFTokenizer, bucket_lengths, load_tokenizer

__all__ = [
    "Dataset",
    "BatchDataset",
    "loader",
    "load_tokenizer",
    "ByteTokenizer",
    "HFTokenizer",
    "bucket_lengths",
    "PACKING",
    "SYNTHETIC",
]


class BatchDataset(torch.utils.data.Dataset):
    """Map-style view: item ``i`` is batch ``i`` as int32 tensors."""

    def __init__(self, ds: Dataset):
        self.ds = ds

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {k: torch.from_numpy(v) for k, v in self.ds.batch(int(i)).items()}


def loader(ds: Dataset, start: int, stop: int, *, num_workers: int = 1, pin_memory: bool = False) -> DataLoader:
    """A DataLoader over batches ``start .. stop - 1`` of ``ds``, in order."""
    if num_workers < 0:
        raise ValueError(f"num_workers={num_workers!r} must be >= 0")
    # fork is unsafe once a multithreaded runtime (jax, in a process that loaded both twins) is up
    context = "spawn" if num_workers and "jax" in sys.modules else None
    return DataLoader(
        BatchDataset(ds),
        batch_size=None,
        sampler=range(start, stop),
        num_workers=num_workers,
        pin_memory=pin_memory,
        prefetch_factor=2 if num_workers else None,
        persistent_workers=False,
        multiprocessing_context=context,
    )
