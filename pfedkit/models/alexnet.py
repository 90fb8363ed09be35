"""FedReMa's simplified AlexNet for CIFAR-10 (settings spec §3.2), layer order as in its code.

    features:
      conv1: Conv2d(3, 32, 3, padding 1)    -> MaxPool2d(2, 2) -> ReLU
      conv2: Conv2d(32, 64, 3, padding 1)   -> MaxPool2d(2, 2) -> ReLU
      conv3: Conv2d(64, 128, 3, padding 1)                       (no activation)
      conv4: Conv2d(128, 256, 3, padding 1)                      (no activation)
      conv5: Conv2d(256, 256, 3, padding 1) -> MaxPool2d(3, stride 2) -> ReLU
    flatten (2304 on 32x32)
    classifier: fc1: Linear(2304, 1024), fc2: Linear(1024, 512)  (no activation, no dropout)
    fc: Linear(512, C)

The missing ReLUs (conv3-conv5, between the FC layers) are part of the reference model.
head="fc":   body = features (feature_dim 2304), head = fc1, fc2, fc (FedReMa's split).
head="last": head = fc (feature_dim 512).
Parameters (C=10): body (features) 978,496; head (FC layers) 2,890,250; total 3,868,746.
"""
from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from pfedkit.models.base import (BodyHeadModel, check_num_classes, head_start, image_shape,
                                 spatial_size)

NAME = "alexnet"
FEATURE_WINDOWS = [(3, 1, 1), (2, 2, 0), (3, 1, 1), (2, 2, 0), (3, 1, 1), (3, 1, 1), (3, 1, 1),
                   (3, 2, 0)]  # (kernel, stride, padding) of every conv and pool, in order


class AlexNet(BodyHeadModel):
    HEAD_SPLITS = {"last": "fc", "fc": "fc1"}

    def __init__(self, input_shape: Sequence[int], num_classes: int, head: str = "last"):
        in_channels, height, width = image_shape(input_shape, NAME)
        flat_dim = (256 * spatial_size(height, FEATURE_WINDOWS, NAME)
                    * spatial_size(width, FEATURE_WINDOWS, NAME))
        layers = [
            ("conv1", nn.Conv2d(in_channels, 32, kernel_size=3, padding=1)),
            ("pool1", nn.MaxPool2d(kernel_size=2, stride=2)),
            ("relu1", nn.ReLU()),
            ("conv2", nn.Conv2d(32, 64, kernel_size=3, padding=1)),
            ("pool2", nn.MaxPool2d(kernel_size=2, stride=2)),
            ("relu2", nn.ReLU()),
            ("conv3", nn.Conv2d(64, 128, kernel_size=3, padding=1)),
            ("conv4", nn.Conv2d(128, 256, kernel_size=3, padding=1)),
            ("conv5", nn.Conv2d(256, 256, kernel_size=3, padding=1)),
            ("pool5", nn.MaxPool2d(kernel_size=3, stride=2)),
            ("relu5", nn.ReLU()),
            ("flatten", nn.Flatten()),
            ("fc1", nn.Linear(flat_dim, 1024)),
            ("fc2", nn.Linear(1024, 512)),
            ("fc", nn.Linear(512, check_num_classes(num_classes))),
        ]
        super().__init__(layers, head_start(head, self.HEAD_SPLITS, NAME))
