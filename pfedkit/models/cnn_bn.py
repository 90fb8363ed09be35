"""PFLlib's FedAvgCNN (`cnn`) with BatchNorm where FedBN's digits model has it: after every
convolution and after the hidden fully connected layer, before the ReLU (FedBN, ICLR 2021,
`med-air/FedBN` `nets/models.py` DigitModel; its own model is wider: 64/64/128 conv channels,
FC 2048 and 512, 13 M parameters).

    conv1: Conv2d(in_ch, 32, 5) -> bn1: BatchNorm2d(32) -> ReLU -> MaxPool2d(2)
    conv2: Conv2d(32, 64, 5)    -> bn2: BatchNorm2d(64) -> ReLU -> MaxPool2d(2)
    flatten (dim = 64 * h * w: 1024 on 28x28, 1600 on 32x32)
    fc1:   Linear(dim, 512)     -> bn3: BatchNorm1d(512) -> ReLU
    fc:    Linear(512, C)

The layers keep `cnn`'s names (and biases), so the BatchNorm-free parameters are `cnn`'s; the
BatchNorm layers' names contain "bn" (the rule PFLlib and FL-bench use to find them).
head="last": head = fc, feature_dim 512. head="fc": head = fc1 + bn3 + fc, feature_dim = dim.
Parameters: 583,242 (1x28x28, C=10), 879,754 (3x32x32, C=10): `cnn`'s + 2 x (32 + 64 + 512);
BatchNorm running statistics are buffers, kept per client by the engine.
"""
from __future__ import annotations

from collections.abc import Sequence

from pfedkit.models.base import BodyHeadModel, head_start
from pfedkit.models.cnn import fedavg_cnn_layers

NAME = "cnn_bn"


class BatchNormCNN(BodyHeadModel):
    HEAD_SPLITS = {"last": "fc", "fc": "fc1"}

    def __init__(self, input_shape: Sequence[int], num_classes: int, head: str = "last"):
        super().__init__(fedavg_cnn_layers(input_shape, num_classes, NAME, batchnorm=True),
                         head_start(head, self.HEAD_SPLITS, NAME))
