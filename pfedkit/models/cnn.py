"""PFLlib's FedAvgCNN, the "4-layer CNN" / "2 conv + 2 FC" (settings spec §3.1).

    conv1: Conv2d(in_ch, 32, 5) -> ReLU -> MaxPool2d(2)
    conv2: Conv2d(32, 64, 5)    -> ReLU -> MaxPool2d(2)
    flatten (dim = 64 * h * w, computed from the input shape: 1024 on 28x28, 1600 on 32x32)
    fc1:   Linear(dim, 512) -> ReLU
    fc:    Linear(512, C)

head="last": head = fc, feature_dim 512 (PFLlib, cwFedAvg, PFedCS, most baselines).
head="fc":   head = fc1 + fc, feature_dim = dim (FedReMa).
Parameters: 582,026 (1x28x28, C=10); 878,538 (3x32x32, C=10); 924,708 (3x32x32, C=100).
"""
from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from pfedkit.models.base import (BodyHeadModel, check_num_classes, head_start, image_shape,
                                 spatial_size)

NAME = "cnn"
CONV_WINDOWS = [(5, 1, 0), (2, 2, 0), (5, 1, 0), (2, 2, 0)]  # (kernel, stride, padding)


def fedavg_cnn_layers(input_shape: Sequence[int], num_classes: int, name: str,
                      batchnorm: bool = False) -> list[tuple[str, nn.Module]]:
    """FedAvgCNN's named layers; with `batchnorm`, a BatchNorm (bn1, bn2, bn3) after each
    convolution and after fc1, before the ReLU (cnn_bn). BatchNorm layers draw no random numbers,
    so both variants initialise their shared layers identically from the same seed."""
    in_channels, height, width = image_shape(input_shape, name)
    flat_dim = (64 * spatial_size(height, CONV_WINDOWS, name)
                * spatial_size(width, CONV_WINDOWS, name))

    def norm(layer_name: str, layer: nn.Module) -> list[tuple[str, nn.Module]]:
        return [(layer_name, layer)] if batchnorm else []

    return [
        ("conv1", nn.Conv2d(in_channels, 32, kernel_size=5)), *norm("bn1", nn.BatchNorm2d(32)),
        ("relu1", nn.ReLU()),
        ("pool1", nn.MaxPool2d(2)),
        ("conv2", nn.Conv2d(32, 64, kernel_size=5)), *norm("bn2", nn.BatchNorm2d(64)),
        ("relu2", nn.ReLU()),
        ("pool2", nn.MaxPool2d(2)),
        ("flatten", nn.Flatten()),
        ("fc1", nn.Linear(flat_dim, 512)), *norm("bn3", nn.BatchNorm1d(512)),
        ("relu3", nn.ReLU()),
        ("fc", nn.Linear(512, check_num_classes(num_classes))),
    ]


class FedAvgCNN(BodyHeadModel):
    HEAD_SPLITS = {"last": "fc", "fc": "fc1"}

    def __init__(self, input_shape: Sequence[int], num_classes: int, head: str = "last"):
        super().__init__(fedavg_cnn_layers(input_shape, num_classes, NAME),
                         head_start(head, self.HEAD_SPLITS, NAME))
