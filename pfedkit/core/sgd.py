"""Functional SGD on parameter dicts, the rules of torch.nn.utils.clip_grad_norm_ and
torch.optim.SGD (no dampening), for updates a method makes outside the trainer: a server
optimiser (FedAvgM), a hypernetwork on the server (pFedHN), a custom local step (StepTools.sgd_step)."""
from __future__ import annotations

import torch

from pfedkit.core.params import Params

CLIP_EPS = 1e-6  # torch's clip_grad_norm_: coef = max_norm / (total_norm + 1e-6)


def clip_by_total_norm(grads: Params, max_norm: float) -> Params:
    """grads * min(1, max_norm / (||grads||_2 + 1e-6)), the norm over every tensor together."""
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()]))
    scale = torch.clamp(max_norm / (total + CLIP_EPS), max=1.0)
    return {name: grad * scale for name, grad in grads.items()}


def sgd_momentum_step(params: Params, grads: Params, buffers: Params, *, lr: float, momentum: float,
                      weight_decay: float = 0.0, nesterov: bool = False) -> tuple[Params, Params]:
    """torch.optim.SGD's step: d = g + wd p; buf = momentum buf + d (buffers start at 0, so the
    first buf is d, as torch's); p <- p - lr buf, or p - lr (d + momentum buf) with Nesterov.
    Returns (new params, new buffers); without momentum the buffers come back unchanged."""
    new_params, new_buffers = {}, dict(buffers)
    for name, value in params.items():
        step = grads[name] + weight_decay * value if weight_decay else grads[name]
        if momentum:
            new_buffers[name] = momentum * buffers[name] + step
            step = step + momentum * new_buffers[name] if nesterov else new_buffers[name]
        new_params[name] = value - lr * step
    return new_params, new_buffers
