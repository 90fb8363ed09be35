"""Losses of given models on a client's own data, computed on the client (IFCA's cluster choice,
FedSoft's importance weights, FedFomo's validation losses). Eval mode, no gradient, the client's
own BatchNorm statistics (`data.buffers`)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pfedkit.core.params import Params

CHUNK = 1000  # samples per forward: bounded memory on large clients


def sample_losses(ops, params: Params, x: torch.Tensor, y: torch.Tensor,
                  buffers: Params | None = None) -> torch.Tensor:
    """[n] cross-entropy of each sample under the model `params` (float64)."""
    if len(y) == 0:
        return torch.zeros(0, dtype=torch.float64)
    logits = ops.logits(params, x, buffers, chunk=CHUNK)
    return F.cross_entropy(logits.double(), y, reduction="none")


def mean_loss(ops, params: Params, x: torch.Tensor, y: torch.Tensor, buffers: Params | None = None) -> float:
    """Mean cross-entropy of the model `params` over (x, y); 0 for no samples."""
    losses = sample_losses(ops, params, x, y, buffers)
    return float(losses.mean()) if len(losses) else 0.0
