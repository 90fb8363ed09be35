"""Model registry: every model is ``body`` (x -> [B, feature_dim]) + ``head`` (features -> logits).

    model = build_model("cnn", input_shape=(1, 28, 28), num_classes=10, head="last")
    features = model.body(x)            # [B, model.feature_dim]
    logits = model.head(features)       # == model(x)

``input_shape`` is (C, H, W) for images or (D,) for flat vectors. ``head`` is "last" (the last
Linear layer; default) or "fc" (all fully connected layers, FedReMa's split); see
`pfedkit.models.base`. Parameters are initialised with PyTorch's defaults from the global RNG:
seed it (or use ``torch.random.fork_rng``) before building.
"""
from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from pfedkit.models.alexnet import AlexNet
from pfedkit.models.base import (HEAD_CHOICES, BodyHeadModel, last_linear, layer_state_dict,
                                 load_layer_state_dict)
from pfedkit.models.cnn import FedAvgCNN
from pfedkit.models.cnn_bn import BatchNormCNN
from pfedkit.models.cnn_cifar import CNNCifar, CNNCifar100
from pfedkit.models.cnn_proto import ProtoCNN
from pfedkit.models.fasttext import FastText
from pfedkit.models.mlp import MLP
from pfedkit.models.resnet import ResNet18

__all__ = [
    "MODELS", "ModelInfo", "build_model", "model_names", "HEAD_CHOICES",
    "BodyHeadModel", "last_linear", "layer_state_dict", "load_layer_state_dict",
]

FIXED_ARGUMENTS = ("self", "input_shape", "num_classes", "head")


@dataclass(frozen=True)
class ModelInfo:
    name: str
    builder: Callable[..., nn.Module]   # builder(input_shape, num_classes, head, **options)
    description: str
    token_ids: bool = False  # reads token ids (text datasets), not images or feature vectors

    @property
    def heads(self) -> tuple[str, ...]:
        """Head choices the model supports."""
        return tuple(self.builder.HEAD_SPLITS)

    @property
    def options(self) -> tuple[str, ...]:
        """Extra keyword options the builder accepts (beyond input_shape, num_classes, head)."""
        parameters = inspect.signature(self.builder).parameters
        return tuple(name for name in parameters if name not in FIXED_ARGUMENTS)


MODELS: dict[str, ModelInfo] = {
    info.name: info for info in [
        ModelInfo("mlp", MLP, "FedAvg 2NN: flatten -> 200 -> 200 -> C with ReLUs (digits, FEMNIST)"),
        ModelInfo("cnn", FedAvgCNN,
                  "PFLlib FedAvgCNN: 2 conv (32, 64, 5x5) + FC 512 + FC C (MNIST, CIFAR)"),
        ModelInfo("cnn_bn", BatchNormCNN,
                  "FedAvgCNN with BatchNorm after each conv and fc1 (FedBN's placement): MNIST, CIFAR"),
        ModelInfo("alexnet", AlexNet,
                  "FedReMa simplified AlexNet: 5 conv + FC 1024, 512, C (CIFAR-10)"),
        ModelInfo("resnet18", ResNet18,
                  "ResNet-18, CIFAR stem or stem='imagenet' (conv_stride, pool_stride options)"),
        ModelInfo("cnn_cifar", CNNCifar,
                  "FedRep/DA-PFL CNNCifar: 2 conv (64, 64) + FC 120, 64, C"),
        ModelInfo("cnn_cifar100", CNNCifar100,
                  "FedRep/DA-PFL CNNCifar100: 2 conv (64, 128) + FC 256, 128, dropout, C"),
        ModelInfo("cnn_proto", ProtoCNN,
                  "FedProto/pFedPM CNN: 2 conv (10, c2) + FC 50 feature + FC C (options c2, kernel)"),
        ModelInfo("fasttext", FastText,
                  "fastText text classifier: mean token embedding + FC E + FC C (options embed_dim, vocab_size)",
                  token_ids=True),
    ]
}

def model_names() -> list[str]:
    return list(MODELS)


def model_info(name: str) -> ModelInfo:
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(model_names())}")
    return MODELS[name]


def build_model(name: str, input_shape: tuple[int, ...], num_classes: int, head: str = "last",
                **options) -> nn.Module:
    """Build model ``name`` for inputs of ``input_shape`` and ``num_classes`` outputs."""
    info = model_info(name)
    if head not in info.heads:
        raise ValueError(
            f"model {name!r} does not support head={head!r}; it supports "
            f"{', '.join(repr(choice) for choice in info.heads)}"
        )
    unknown = sorted(set(options) - set(info.options))
    if unknown:
        allowed = ", ".join(info.options) if info.options else "none"
        raise ValueError(f"model {name!r} has no option(s) {unknown}; its options are: {allowed}")
    return info.builder(tuple(input_shape), num_classes, head=head, **options)

