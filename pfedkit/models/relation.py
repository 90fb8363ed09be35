"""R-pFedPM's relation module (settings spec §3.5, seed spec §2.6 [recon]): scores (feature, class
feature) pairs, after Sung et al., *Learning to Compare*, CVPR 2018.

    pair [h ; C] in R^{2 x d} -> Conv1d(2, 64, 3, padding 1) -> BatchNorm1d(64) -> ReLU -> flatten
    -> Linear(64 d, 8) -> ReLU -> Linear(8, 1) -> Sigmoid          score in (0, 1)

26,193 parameters for d = 50, 262,737 for d = 512. It is not part of the engine's model: the
algorithm keeps one per client as a plain dict of tensors (`relation_params`,
`relation_buffers`) and runs it with the functional `relation_scores`, which computes exactly
what `RelationModule.forward` computes but from explicit tensors, so the module can be trained
in a hand-written loop, used frozen inside a loss, or evaluated without owning an nn.Module.
Only the paper's 1-D (fc1 feature) variant is provided; the Conv2d variant on conv maps
(seed spec §2.10, `feature_layer="conv"`) is not.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

CHANNELS = 64  # Conv1d output channels (Sung et al.'s width)
HIDDEN = 8     # hidden units of the first Linear (Sung et al.)
BN_EPS = 1e-5
BN_MOMENTUM = 0.1  # PyTorch's BatchNorm default


class RelationModule(nn.Module):
    """Maps pairs [M, 2, d] to relation scores [M] in (0, 1)."""

    def __init__(self, feature_dim: int, channels: int = CHANNELS, hidden: int = HIDDEN) -> None:
        super().__init__()
        if not isinstance(feature_dim, int) or feature_dim < 1:
            raise ValueError(f"relation module: feature_dim must be a positive int, got {feature_dim!r}")
        self.feature_dim = feature_dim
        self.conv = nn.Conv1d(2, channels, kernel_size=3, padding=1)
        self.bn = nn.BatchNorm1d(channels, eps=BN_EPS, momentum=BN_MOMENTUM)
        self.fc1 = nn.Linear(channels * feature_dim, hidden)
        self.fc2 = nn.Linear(hidden, 1)

    def forward(self, pairs: torch.Tensor) -> torch.Tensor:
        z = F.relu(self.bn(self.conv(pairs))).flatten(1)
        return torch.sigmoid(self.fc2(F.relu(self.fc1(z)))).squeeze(1)


def relation_params(module: RelationModule) -> dict[str, torch.Tensor]:
    """The module's trainable parameters as a detached dict (names as in `named_parameters`)."""
    return {name: value.detach().clone() for name, value in module.named_parameters()}


def relation_buffers(module: RelationModule) -> dict[str, torch.Tensor]:
    """BatchNorm running statistics (running_mean, running_var; num_batches_tracked dropped)."""
    return {name: value.detach().clone() for name, value in module.named_buffers()
            if not name.endswith("num_batches_tracked")}


def make_pairs(features: torch.Tensor, class_features: torch.Tensor) -> torch.Tensor:
    """All (sample, class) pairs as 2-channel signals: [B, d] x [K, d] -> [B*K, 2, d] (row b*K + k).

    Paper Fig. 2: each feature is replicated K times and concatenated with every class feature.
    """
    batch, classes = features.shape[0], class_features.shape[0]
    left = features.unsqueeze(1).expand(batch, classes, -1)
    right = class_features.unsqueeze(0).expand(batch, classes, -1)
    return torch.stack([left, right], dim=2).reshape(batch * classes, 2, features.shape[1])


def relation_scores(params: dict[str, torch.Tensor], features: torch.Tensor, class_features: torch.Tensor,
                    *, training: bool, buffers: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """r_{b,k} = R_psi(concat(h_b, C_k)) for every sample b and class feature k -> [B, K]
    (seed spec eq. (12) [recon]).

    training=True normalises with the batch's statistics (and updates `buffers` in place when
    given, as BatchNorm does in train mode); training=False uses `buffers`' running statistics.
    Differentiable in `params` and `features`.
    """
    if not training and buffers is None:
        raise ValueError("relation_scores(training=False) needs the BatchNorm running statistics (buffers)")
    pairs = make_pairs(features, class_features)
    z = F.conv1d(pairs, params["conv.weight"], params["conv.bias"], padding=1)
    running_mean = buffers["bn.running_mean"] if buffers is not None else None
    running_var = buffers["bn.running_var"] if buffers is not None else None
    z = F.batch_norm(z, running_mean, running_var, params["bn.weight"], params["bn.bias"],
                     training=training, momentum=BN_MOMENTUM, eps=BN_EPS)
    z = F.relu(z).flatten(1)
    z = F.relu(F.linear(z, params["fc1.weight"], params["fc1.bias"]))
    scores = torch.sigmoid(F.linear(z, params["fc2.weight"], params["fc2.bias"]))
    return scores.reshape(features.shape[0], class_features.shape[0])
