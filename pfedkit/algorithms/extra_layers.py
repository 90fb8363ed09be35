"""Small layers trained beside the model as `Fit.extra` tensors (GPFL's conditional valve and
category embeddings, FedCP's policy network), and the model's one Linear head read functionally:
seeded initial values as plain parameter dicts, and the forwards a loss or a `predict` computes
from them. Registers no algorithm.

Initial values follow PyTorch's defaults, drawn from a generator instead of the global one: a
Linear layer's weight and bias ~ U(-1/sqrt(in), 1/sqrt(in)) (`nn.Linear`'s kaiming-uniform with
a = sqrt(5) has that bound), an embedding ~ N(0, 1), a LayerNorm's weight 1 and bias 0.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pfedkit.core.contract import Setup
from pfedkit.core.errors import ConfigError
from pfedkit.core.params import Params, linear_layer_names, select


def linear_init(prefix: str, in_features: int, out_features: int, generator: torch.Generator) -> Params:
    """{prefix.weight [out, in], prefix.bias [out]} ~ U(-1/sqrt(in), 1/sqrt(in))."""
    bound = 1.0 / in_features ** 0.5

    def uniform(*shape: int) -> torch.Tensor:
        return (torch.rand(*shape, generator=generator) * 2.0 - 1.0) * bound
    return {f"{prefix}.weight": uniform(out_features, in_features), f"{prefix}.bias": uniform(out_features)}


def layer_norm_init(prefix: str, size: int) -> Params:
    return {f"{prefix}.weight": torch.ones(size), f"{prefix}.bias": torch.zeros(size)}


def linear(params: Params, prefix: str, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, params[f"{prefix}.weight"], params[f"{prefix}.bias"])


def layer_norm(params: Params, prefix: str, x: torch.Tensor) -> torch.Tensor:
    weight = params[f"{prefix}.weight"]
    return F.layer_norm(x, weight.shape, weight, params[f"{prefix}.bias"])


def with_prefix(params: Params, prefix: str) -> Params:
    """The entries of `params` named `prefix.*`."""
    return {name: value for name, value in params.items() if name.startswith(prefix + ".")}


def head_linear(params: Params) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(W [C, d], b [C] or None) of the model's one Linear head, read from any parameter dict
    holding its `head.*` entries (a loss's live params, a client state)."""
    weight, bias = linear_layer_names(select(params, "head"), "head")
    return params[weight], (params[bias] if bias is not None else None)


def check_linear_head(setup: Setup, method: str, needs_bias: bool = False) -> None:
    """ConfigError (one line) unless the run's model has one Linear head (with a bias if asked)."""
    try:
        _, bias = head_linear(setup.ops.initial_params())
    except ValueError as error:
        raise ConfigError(f"{method} needs the model's head to be one Linear layer (head_split=last): {error}") from None
    if needs_bias and bias is None:
        raise ConfigError(f"{method} needs the model's Linear head to have a bias; use a model whose last layer has one")
