"""FedProto's CNN for MNIST / FEMNIST, used by pFedPM (settings spec §3.4).

    conv1: Conv2d(in_ch, 10, kernel)  -> MaxPool2d(2) -> ReLU            kernel 5 (FEMNIST: 3)
    conv2: Conv2d(10, c2, 5) -> Dropout2d(0.5) -> MaxPool2d(2) -> ReLU    c2 = 20 (18/20/22 for -mh)
    flatten (16 * c2 on 28x28; 841 * c2 on FEMNIST's 128x128 with kernel 3)
    fc1: Linear(flat, 50) -> ReLU       -> the 50-d feature / prototype
    dropout: Dropout(0.5)
    fc2: Linear(50, C)                   logits (FedProto applies log_softmax in the loss instead)

head="last" (FedProto/pFedPM split): body = conv1 .. ReLU after fc1 (feature_dim 50),
head = dropout + fc2, so prototypes are the un-dropped fc1 activations as in FedProto's code.
head="fc": head = fc1 .. fc2, feature_dim = flat.
Parameters (1x28x28, C=10): 19,738 (c2=18), 21,840 (c2=20), 23,942 (c2=22).
"""
from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from pfedkit.models.base import (BodyHeadModel, check_num_classes, head_start, image_shape,
                                 spatial_size)

NAME = "cnn_proto"
FEATURE_DIM = 50


class ProtoCNN(BodyHeadModel):
    HEAD_SPLITS = {"last": "dropout", "fc": "fc1"}

    def __init__(self, input_shape: Sequence[int], num_classes: int, head: str = "last",
                 c2: int = 20, kernel: int = 5):
        """``c2``: conv2 output channels; ``kernel``: conv1 kernel size (3 for FEMNIST)."""
        for option, value in (("c2", c2), ("kernel", kernel)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{NAME} option {option} must be a positive int, got {value!r}")
        in_channels, height, width = image_shape(input_shape, NAME)
        windows = [(kernel, 1, 0), (2, 2, 0), (5, 1, 0), (2, 2, 0)]
        flat_dim = c2 * spatial_size(height, windows, NAME) * spatial_size(width, windows, NAME)
        layers = [
            ("conv1", nn.Conv2d(in_channels, 10, kernel_size=kernel)),
            ("pool1", nn.MaxPool2d(2)),
            ("relu1", nn.ReLU()),
            ("conv2", nn.Conv2d(10, c2, kernel_size=5)),
            ("conv2_drop", nn.Dropout2d(0.5)),
            ("pool2", nn.MaxPool2d(2)),
            ("relu2", nn.ReLU()),
            ("flatten", nn.Flatten()),
            ("fc1", nn.Linear(flat_dim, FEATURE_DIM)),
            ("relu3", nn.ReLU()),
            ("dropout", nn.Dropout(0.5)),
            ("fc2", nn.Linear(FEATURE_DIM, check_num_classes(num_classes))),
        ]
        super().__init__(layers, head_start(head, self.HEAD_SPLITS, NAME))
