"""ResNet-18 with a CIFAR or an ImageNet stem (settings spec §3.3).

    stem "cifar" (default, for 32x32 from scratch):
        conv1: Conv2d(in_ch, 64, 3, stride 1, padding 1, bias=False) -> bn1 -> ReLU   (no max-pool)
    stem "imagenet" (torchvision's layout):
        conv1: Conv2d(in_ch, 64, 7, stride conv_stride=2, padding 3, bias=False) -> bn1 -> ReLU
        -> maxpool: MaxPool2d(3, stride pool_stride=2, padding 1)
    layer1..layer4: 2 BasicBlocks each, widths 64/128/256/512, first-block strides 1/2/2/2,
        1x1-conv + BN shortcut where the shape changes
    avgpool: global average pooling -> flatten (feature_dim 512)
    fc: Linear(512, C)

The body ends with the pooled 512-d feature; the head is fc. The model has a single fully
connected layer, so head="fc" and head="last" are the same split.
pFedPM-mh varies the ImageNet stem per client with (conv_stride, pool_stride) = (1, 4) or (2, 2).
Parameters (C=10, 3 channels): CIFAR stem 11,173,962 (body 11,168,832);
ImageNet stem 11,181,642 (body 11,176,512). BatchNorm running statistics are buffers, not
parameters; whether they are aggregated is the algorithm's and engine's business.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from pfedkit.models.base import (BodyHeadModel, check_num_classes, head_start, image_shape,
                                 spatial_size)

NAME = "resnet18"
STAGE_WIDTHS = (64, 128, 256, 512)
STAGE_STRIDES = (1, 2, 2, 2)
BLOCKS_PER_STAGE = 2
STEMS = ("cifar", "imagenet")


class BasicBlock(nn.Module):
    """relu(bn2(conv2(relu(bn1(conv1(x))))) + shortcut(x)) with 3x3 convolutions."""

    def __init__(self, in_channels: int, out_channels: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )
        else:
            self.shortcut = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


def stage(in_channels: int, out_channels: int, stride: int) -> nn.Sequential:
    blocks = [BasicBlock(in_channels, out_channels, stride)]
    blocks += [BasicBlock(out_channels, out_channels, 1) for _ in range(BLOCKS_PER_STAGE - 1)]
    return nn.Sequential(*blocks)


def stem_layers(stem: str, in_channels: int, conv_stride: int | None,
                pool_stride: int | None) -> tuple[list[tuple[str, nn.Module]], list[tuple]]:
    """Stem layers and their (kernel, stride, padding) windows, for the image-size check."""
    if stem not in STEMS:
        raise ValueError(f"resnet18 stem must be one of {STEMS}, got {stem!r}")
    if stem == "cifar":
        if conv_stride is not None or pool_stride is not None:
            raise ValueError("conv_stride and pool_stride apply to the ImageNet stem only; "
                             "pass stem='imagenet' to use them")
        conv = nn.Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
        return [("conv1", conv), ("bn1", nn.BatchNorm2d(64)), ("relu", nn.ReLU())], [(3, 1, 1)]
    conv_stride = 2 if conv_stride is None else conv_stride
    pool_stride = 2 if pool_stride is None else pool_stride
    for option, value in (("conv_stride", conv_stride), ("pool_stride", pool_stride)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{option} must be a positive int, got {value!r}")
    conv = nn.Conv2d(in_channels, 64, kernel_size=7, stride=conv_stride, padding=3, bias=False)
    layers = [("conv1", conv), ("bn1", nn.BatchNorm2d(64)), ("relu", nn.ReLU()),
              ("maxpool", nn.MaxPool2d(kernel_size=3, stride=pool_stride, padding=1))]
    return layers, [(7, conv_stride, 3), (3, pool_stride, 1)]


class ResNet18(BodyHeadModel):
    HEAD_SPLITS = {"last": "fc", "fc": "fc"}

    def __init__(self, input_shape: Sequence[int], num_classes: int, head: str = "last",
                 stem: str = "cifar", conv_stride: int | None = None,
                 pool_stride: int | None = None):
        in_channels, height, width = image_shape(input_shape, NAME)
        layers, windows = stem_layers(stem, in_channels, conv_stride, pool_stride)
        windows += [(3, stride, 1) for stride in STAGE_STRIDES[1:]]
        spatial_size(min(height, width), windows, NAME)
        stage_inputs = (64,) + STAGE_WIDTHS[:-1]
        for index, (width_in, width_out, stride) in enumerate(
                zip(stage_inputs, STAGE_WIDTHS, STAGE_STRIDES), start=1):
            layers.append((f"layer{index}", stage(width_in, width_out, stride)))
        layers += [
            ("avgpool", nn.AdaptiveAvgPool2d(1)),
            ("flatten", nn.Flatten()),
            ("fc", nn.Linear(STAGE_WIDTHS[-1], check_num_classes(num_classes))),
        ]
        super().__init__(layers, head_start(head, self.HEAD_SPLITS, NAME))
