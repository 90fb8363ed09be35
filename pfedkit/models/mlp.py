"""FedAvg's "2NN" multilayer perceptron (settings spec §3.6, DA-PFL's FEMNIST MLP).

    flatten -> fc1: Linear(D, 200) -> ReLU -> fc2: Linear(200, 200) -> ReLU -> fc: Linear(200, C)

head="last": body = flatten .. ReLU after fc2 (feature_dim 200), head = fc.
head="fc":   body = flatten only (feature_dim = D), head = fc1 .. fc.
199,210 parameters for D = 784, C = 10.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

from torch import nn

from pfedkit.models.base import BodyHeadModel, check_num_classes, head_start

HIDDEN = 200


class MLP(BodyHeadModel):
    HEAD_SPLITS = {"last": "fc", "fc": "fc1"}

    def __init__(self, input_shape: Sequence[int], num_classes: int, head: str = "last"):
        shape = tuple(input_shape)
        if not shape or not all(isinstance(size, int) and size > 0 for size in shape):
            raise ValueError(f"model 'mlp' needs an input_shape of positive ints, got {shape}")
        input_dim = math.prod(shape)
        layers = [
            ("flatten", nn.Flatten()),
            ("fc1", nn.Linear(input_dim, HIDDEN)),
            ("relu1", nn.ReLU()),
            ("fc2", nn.Linear(HIDDEN, HIDDEN)),
            ("relu2", nn.ReLU()),
            ("fc", nn.Linear(HIDDEN, check_num_classes(num_classes))),
        ]
        super().__init__(layers, head_start(head, self.HEAD_SPLITS, "mlp"))
