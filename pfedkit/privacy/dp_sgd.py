"""Sample-level DP-SGD for local training (Abadi et al., CCS 2016): per-sample gradients clipped
to C = `dp.sample_clip`, summed, plus N(0, (z C)^2 I) with z = `dp.sample_noise_multiplier`,
divided by the batch size; then the ordinary SGD update (momentum and weight decay act on the
noisy gradient: post-processing).

Per-sample gradients come from `torch.func.vmap(grad(loss of one sample))`, not from Opacus'
GradSampleModule / DPOptimizer: pfedkit's losses are functions of (forward output, labels, live
parameters, context) that read tensors outside the module (`Fit.extra`: FedRoD's personal head,
APFL's mixing weight) and regularisers of the parameters themselves (FedProx's proximal term);
GradSampleModule computes per-sample gradients only for the wrapped module's own layers by
hooks, so it would miss those tensors. vmap differentiates the whole loss with respect to every
trainable tensor. Opacus is used for the accounting (`accounting.py`) and, like it, we refuse
BatchNorm (it mixes the samples of a batch) unless `dp.replace_batchnorm` turns it into GroupNorm.
A loss is evaluated on each sample alone (a batch of one): a loss with batch-level terms would
change meaning; the shipped losses are per-sample means.
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn
from torch.func import grad_and_value, vmap

from pfedkit.core.params import Params


def per_sample_norms(grads: Params) -> torch.Tensor:
    """||g_i||_2 over all tensors together, one per sample ([B])."""
    squares = [g.reshape(g.shape[0], -1).double().pow(2).sum(dim=1) for g in grads.values()]
    return torch.stack(squares).sum(dim=0).sqrt()


def privatize(grads: Params, clip: float, noise_multiplier: float, generator: torch.Generator | None) -> Params:
    """(sum_i g_i min(1, C / ||g_i||) + N(0, (z C)^2 I)) / B from per-sample gradients [B, ...]."""
    batch = next(iter(grads.values())).shape[0]
    factors = (clip / (per_sample_norms(grads) + 1e-6)).clamp(max=1.0)  # Opacus' clip factor
    private = {}
    for name, g in grads.items():
        summed = torch.einsum("b,b...->...", factors.to(g.dtype), g)
        if noise_multiplier > 0:
            summed = summed + noise_multiplier * clip * torch.randn(
                summed.shape, generator=generator, dtype=summed.dtype, device=summed.device)
        private[name] = summed / batch
    return private


def per_sample_gradients(sample_loss: Callable, params: Params, x: torch.Tensor, y: torch.Tensor,
                         index: torch.Tensor) -> tuple[Params, torch.Tensor]:
    """({name: [B, ...] gradients of each sample's loss}, [B] losses); `sample_loss(params, x_i,
    y_i, index_i)` is one sample's loss. Dropout masks differ per sample (randomness="different")."""
    return vmap(grad_and_value(sample_loss), in_dims=(None, 0, 0, 0), randomness="different")(params, x, y, index)


def batchnorm_layers(model: nn.Module) -> list[str]:
    """Names of the model's BatchNorm layers."""
    return [name for name, module in model.named_modules() if isinstance(module, nn.modules.batchnorm._BatchNorm)]


def batchnorm_to_groupnorm(model: nn.Module) -> nn.Module:
    """Every BatchNorm(C) becomes GroupNorm(gcd(32, C), C) in place (Opacus' replacement), keeping
    the layer's name, so parameter names stay `body.bn1.weight`... The running statistics go."""
    for name, module in list(model.named_children()):
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            channels = module.num_features
            setattr(model, name, nn.GroupNorm(math.gcd(32, channels), channels, eps=module.eps,
                                              affine=module.affine))
        else:
            batchnorm_to_groupnorm(module)
    return model
