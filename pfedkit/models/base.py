"""The body + head shape every pfedkit model shares, and small helpers for building one.

A model is written once as an ordered list of named layers (the whole forward pass, first layer
first). The head choice only says at which layer the head begins: the layers before it form
``model.body`` (x -> features of shape [B, feature_dim]) and the rest form ``model.head``
(features -> logits). Moving the split therefore cannot change the computed function or the
parameter count, and a layer keeps its name in either split (``body.fc1.weight`` with
head="last" is ``head.fc1.weight`` with head="fc"), so weights can be copied between splits by
layer name (`layer_state_dict`, `load_layer_state_dict`).

Head choices (settings spec §3.7):
  * "last": head = the last Linear layer (FedPer, FedRep, FedBABU, ... and most baselines).
  * "fc":   head = all fully connected layers (FedReMa).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence

import torch
from torch import nn

HEAD_CHOICES = ("last", "fc")
PART_PREFIXES = ("body.", "head.")


class BodyHeadModel(nn.Module):
    """``forward(x) = head(body(x))`` over named layers split at ``head_starts_at``.

    Subclasses build the layer list and pass the name of the first head layer. ``feature_dim``
    is read off the first Linear layer of the head (its ``in_features``), so it always agrees
    with what the body produces.
    """

    def __init__(self, layers: Sequence[tuple[str, nn.Module]], head_starts_at: str):
        super().__init__()
        names = [name for name, _ in layers]
        if len(set(names)) != len(names):
            raise ValueError(f"layer names must be unique, got {names}")
        if head_starts_at not in names:
            raise ValueError(f"head must start at one of the layers {names}, got {head_starts_at!r}")
        split = names.index(head_starts_at)
        self.body = nn.Sequential(OrderedDict(layers[:split]))
        self.head = nn.Sequential(OrderedDict(layers[split:]))
        self.feature_dim: int = first_linear(self.head).in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def first_linear(module: nn.Module) -> nn.Linear:
    """The first ``nn.Linear`` inside ``module`` (in registration order)."""
    for layer in module.modules():
        if isinstance(layer, nn.Linear):
            return layer
    raise ValueError(f"no Linear layer in {type(module).__name__}")


def last_linear(model: nn.Module) -> nn.Linear:
    """The final classifier layer (the last ``nn.Linear``) of a model or of its head."""
    linears = [layer for layer in model.modules() if isinstance(layer, nn.Linear)]
    if not linears:
        raise ValueError(f"no Linear layer in {type(model).__name__}")
    return linears[-1]


def head_start(head: str, splits: Mapping[str, str], model_name: str) -> str:
    """Name of the first head layer for a head choice; ValueError for a choice not in ``splits``."""
    if head not in splits:
        raise ValueError(
            f"model {model_name!r} does not support head={head!r}; it supports "
            f"{', '.join(repr(choice) for choice in splits)} "
            "('last' = last Linear layer, 'fc' = all fully connected layers)"
        )
    return splits[head]


def image_shape(input_shape: Sequence[int], model_name: str) -> tuple[int, int, int]:
    """Check that ``input_shape`` is (C, H, W) with positive sizes and return it as a tuple."""
    shape = tuple(input_shape)
    if len(shape) != 3 or not all(isinstance(size, int) and size > 0 for size in shape):
        raise ValueError(
            f"model {model_name!r} needs an image input_shape (C, H, W) of positive ints, "
            f"got {shape}; for flat vectors use the 'mlp' model"
        )
    return shape


def conv_output_size(size: int, kernel: int, stride: int = 1, padding: int = 0) -> int:
    """Spatial size after a convolution or pooling window: ``(size + 2p - k) // s + 1``."""
    return (size + 2 * padding - kernel) // stride + 1


def spatial_size(size: int, windows: Sequence[tuple[int, int, int]], model_name: str) -> int:
    """Apply (kernel, stride, padding) windows in turn; ValueError when the image gets too small."""
    for kernel, stride, padding in windows:
        size = conv_output_size(size, kernel, stride, padding)
        if size < 1:
            raise ValueError(
                f"input image is too small for model {model_name!r}: a {kernel}x{kernel} window "
                f"(stride {stride}, padding {padding}) leaves no pixels; use larger images "
                "or another model"
            )
    return size


def check_num_classes(num_classes: int) -> int:
    if not isinstance(num_classes, int) or num_classes < 1:
        raise ValueError(f"num_classes must be a positive int, got {num_classes!r}")
    return num_classes


def layer_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` keyed by layer name, without the ``body.`` / ``head.`` prefix.

    The keys are the same for every head choice of an architecture, so a state saved under one
    split loads into another with `load_layer_state_dict`.
    """
    state = {}
    for key, value in model.state_dict().items():
        for prefix in PART_PREFIXES:
            if key.startswith(prefix):
                key = key[len(prefix):]
                break
        state[key] = value
    return state


def load_layer_state_dict(model: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Load a `layer_state_dict` (from any head choice) into ``model``; keys must match exactly."""
    own_keys = model.state_dict().keys()
    by_layer = {}
    for key in own_keys:
        layer_key = key.split(".", 1)[1] if key.startswith(PART_PREFIXES) else key
        by_layer[layer_key] = key
    missing = sorted(set(by_layer) - set(state))
    unexpected = sorted(set(state) - set(by_layer))
    if missing or unexpected:
        raise ValueError(
            f"layer state does not fit {type(model).__name__}: missing {missing}, "
            f"unexpected {unexpected}; was it saved from the same architecture?"
        )
    model.load_state_dict({by_layer[key]: value for key, value in state.items()})
