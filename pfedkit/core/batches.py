"""Mini-batch order: the one rule by which every runtime and algorithm draws an epoch's batches."""
from __future__ import annotations

import torch


def batch_order(n: int, batch_size: int, drop_last: bool, generator: torch.Generator) -> list[torch.Tensor]:
    """One epoch's mini-batch index tensors, from a seeded permutation."""
    order = torch.randperm(n, generator=generator)
    stop = n - n % batch_size if drop_last else n
    return [order[i:i + batch_size] for i in range(0, stop, batch_size)]
