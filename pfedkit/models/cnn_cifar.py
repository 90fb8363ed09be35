"""FedRep's CNNs, used by DA-PFL (settings spec §3.6).

CNNCifar (registry name "cnn_cifar"):
    conv1: Conv2d(in_ch, 64, 5) -> ReLU -> MaxPool2d(2) -> conv2: Conv2d(64, 64, 5) -> ReLU
    -> MaxPool2d(2) -> flatten (1600 on 32x32) -> fc1: Linear(1600, 120) -> ReLU
    -> fc2: Linear(120, 64) -> ReLU -> fc: Linear(64, C)             307,842 params (C=10)
CNNCifar100 (registry name "cnn_cifar100"):
    conv1: Conv2d(in_ch, 64, 5) -> ReLU -> MaxPool2d(2) -> conv2: Conv2d(64, 128, 5) -> ReLU
    -> MaxPool2d(2) -> flatten (3200) -> fc1: Linear(3200, 256) -> ReLU
    -> fc2: Linear(256, 128) -> ReLU -> Dropout(0.6) -> fc: Linear(128, C)
                                                                     1,064,724 params (C=20)

head="last" (FedRep's split): head = fc (with CNNCifar100's dropout just before it in the head,
so the features are the un-dropped fc2 activations); feature_dim 64 / 128.
head="fc": head = fc1 .. fc; feature_dim = the flattened conv output.
"""
from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from pfedkit.models.base import (BodyHeadModel, check_num_classes, head_start, image_shape,
                                 spatial_size)

CONV_WINDOWS = [(5, 1, 0), (2, 2, 0), (5, 1, 0), (2, 2, 0)]  # (kernel, stride, padding)


def conv_layers(input_shape: Sequence[int], conv2_channels: int,
                name: str) -> tuple[list[tuple[str, nn.Module]], int]:
    """The two conv blocks and flatten shared by both FedRep CNNs, and the flattened size."""
    in_channels, height, width = image_shape(input_shape, name)
    flat_dim = (conv2_channels * spatial_size(height, CONV_WINDOWS, name)
                * spatial_size(width, CONV_WINDOWS, name))
    layers = [
        ("conv1", nn.Conv2d(in_channels, 64, kernel_size=5)),
        ("relu1", nn.ReLU()),
        ("pool1", nn.MaxPool2d(2)),
        ("conv2", nn.Conv2d(64, conv2_channels, kernel_size=5)),
        ("relu2", nn.ReLU()),
        ("pool2", nn.MaxPool2d(2)),
        ("flatten", nn.Flatten()),
    ]
    return layers, flat_dim


class CNNCifar(BodyHeadModel):
    HEAD_SPLITS = {"last": "fc", "fc": "fc1"}

    def __init__(self, input_shape: Sequence[int], num_classes: int, head: str = "last"):
        layers, flat_dim = conv_layers(input_shape, 64, "cnn_cifar")
        layers += [
            ("fc1", nn.Linear(flat_dim, 120)),
            ("relu3", nn.ReLU()),
            ("fc2", nn.Linear(120, 64)),
            ("relu4", nn.ReLU()),
            ("fc", nn.Linear(64, check_num_classes(num_classes))),
        ]
        super().__init__(layers, head_start(head, self.HEAD_SPLITS, "cnn_cifar"))


class CNNCifar100(BodyHeadModel):
    HEAD_SPLITS = {"last": "dropout", "fc": "fc1"}

    def __init__(self, input_shape: Sequence[int], num_classes: int, head: str = "last"):
        layers, flat_dim = conv_layers(input_shape, 128, "cnn_cifar100")
        layers += [
            ("fc1", nn.Linear(flat_dim, 256)),
            ("relu3", nn.ReLU()),
            ("fc2", nn.Linear(256, 128)),
            ("relu4", nn.ReLU()),
            ("dropout", nn.Dropout(0.6)),
            ("fc", nn.Linear(128, check_num_classes(num_classes))),
        ]
        super().__init__(layers, head_start(head, self.HEAD_SPLITS, "cnn_cifar100"))
