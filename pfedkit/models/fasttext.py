"""fastText-style text classifier (cwFedAvg's AG News table; the layer shapes of PFLlib's fastText).

    embedding: mean of the token embeddings (padding id 0 left out) -> fc1: Linear(E, E) -> fc: Linear(E, C)

Input: integer token ids (B, L), 0 = padding (pfedkit/data/text.py). The mean is taken over the
row's non-padding tokens (an EmbeddingBag in mean mode with per-sample weights 1/length would
give the same; the masked sum keeps it a plain Embedding, which torch.func.vmap batches); a row
of padding only gives the zero vector. No activation between fc1 and fc (as PFLlib).

head="last": body = embedding mean + fc1 (feature_dim E), head = fc.
head="fc":   body = embedding mean (feature_dim E), head = fc1 + fc.
Options: `embed_dim` (E, default 64 [ours]; PFLlib passes its feature_dim), `vocab_size`
(default 50,000, the ids `pfedkit data fetch ag_news` produces at most).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from pfedkit.models.base import BodyHeadModel, check_num_classes, head_start

NAME = "fasttext"
PAD_ID = 0


class MeanEmbedding(nn.Module):
    """(B, L) ids -> (B, E): the mean embedding of each row's non-padding tokens."""

    def __init__(self, vocab_size: int, embed_dim: int):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, embed_dim, padding_idx=PAD_ID)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        present = (ids != PAD_ID).to(self.embedding.weight.dtype)               # (B, L)
        summed = (self.embedding(ids) * present.unsqueeze(-1)).sum(dim=1)       # (B, E)
        return summed / present.sum(dim=1, keepdim=True).clamp(min=1.0)


class FastText(BodyHeadModel):
    HEAD_SPLITS = {"last": "fc", "fc": "fc1"}

    def __init__(self, input_shape: Sequence[int], num_classes: int, head: str = "last",
                 embed_dim: int = 64, vocab_size: int = 50_000):
        shape = tuple(input_shape)
        if len(shape) != 1 or not isinstance(shape[0], int) or shape[0] < 1:
            raise ValueError(f"model {NAME!r} needs token-id inputs of shape (length,), got {shape}; "
                             "use it with a text dataset (ag_news)")
        for option, value in (("embed_dim", embed_dim), ("vocab_size", vocab_size)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"model {NAME!r}: {option} must be a positive int, got {value!r}")
        layers = [
            ("embedding", MeanEmbedding(vocab_size, embed_dim)),
            ("fc1", nn.Linear(embed_dim, embed_dim)),
            ("fc", nn.Linear(embed_dim, check_num_classes(num_classes))),
        ]
        super().__init__(layers, head_start(head, self.HEAD_SPLITS, NAME))
