"""Class prototypes: per-class mean body features of a client's data, shared by every method that
uploads or aligns to class means (pFedPM, FedReMa, FedPAC, FedGH, FedProto...)."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch
import torch.nn.functional as F

from pfedkit.core.contract import Forward, cross_entropy
from pfedkit.core.params import Params


# (table [C, d], present [C] bool): one row per class, `present` marks the rows that hold a value.
FeatureTable = tuple[torch.Tensor, torch.Tensor]


def table_to_message(features: torch.Tensor, present: torch.Tensor) -> dict[int, torch.Tensor]:
    """{class label: feature [d]} for the present classes (labels are the dict keys, not counted
    as payload, like parameter names in a weight message)."""
    return {int(label): features[label].clone() for label in present.nonzero().squeeze(1).tolist()}


def message_to_table(features: Mapping[int, torch.Tensor], num_classes: int, feature_dim: int) -> FeatureTable:
    table = torch.zeros(num_classes, feature_dim)
    present = torch.zeros(num_classes, dtype=torch.bool)
    for label, feature in features.items():
        table[int(label)] = feature
        present[int(label)] = True
    return table, present


def class_means(features: torch.Tensor, labels: torch.Tensor, num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """C_i^(c) = (1/n_{i,c}) sum_{y=c} f(x) for every class -> (means [C, d], counts [C] int64).

    Rows of classes without samples are zero; counts tell which classes exist. Sums in float64.
    """
    counts = torch.bincount(labels, minlength=num_classes)
    sums = torch.zeros(num_classes, features.shape[1], dtype=torch.float64)
    sums.index_add_(0, labels, features.double())
    return means_from_sums(sums, counts).to(features.dtype), counts


def means_from_sums(sums: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Row c of `sums` [C, d] divided by counts[c] [C]; rows with no sample stay zero."""
    return sums / counts.clamp(min=1).unsqueeze(1)


def present_class_means(features: torch.Tensor, labels: torch.Tensor,
                        num_classes: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The class means of the classes the client has: (classes [k] int64, means [k, d], counts [k])."""
    means, counts = class_means(features, labels, num_classes)
    classes = torch.nonzero(counts).reshape(-1)
    return classes, means[classes], counts[classes]


def global_prototypes(uploads: Sequence[Mapping[str, torch.Tensor]], num_classes: int, dim: int,
                      weighting: Literal["uniform", "count"] = "uniform") -> torch.Tensor:
    """c̄_c = mean over the uploading clients that have class c (§1.7), as [C, d] float32.

    weighting="uniform" [code] weighs every client alike; "count" weighs by n_{i,c} (FedPAC).
    Classes nobody uploaded are rows of NaN (no prototype).
    """
    sums = torch.zeros(num_classes, dim, dtype=torch.float64)
    totals = torch.zeros(num_classes, dtype=torch.float64)
    for upload in uploads:
        classes = upload["prototype_classes"]
        weights = (upload["prototype_counts"].double() if weighting == "count"
                   else torch.ones(classes.shape[0], dtype=torch.float64))
        sums.index_add_(0, classes, upload["prototypes"].double() * weights[:, None])
        totals.index_add_(0, classes, weights)
    return (sums / totals[:, None]).float()  # 0 / 0 = NaN marks absent classes


def alignment_loss(out: Forward, y: torch.Tensor, params: Params, context: Mapping[str, Any], *,
                   lambda_f: float) -> torch.Tensor:
    """CE + λ · MSE(h_b, c̄_{y_b}) (FedReMa eq. 11, FedPAC, FedProto) over the batch (mean over batch and features).

    context["prototypes"] is [C, d] with NaN rows for classes without a global prototype; those
    samples contribute 0 (their target is their own detached feature). No prototypes: plain CE.
    """
    loss = cross_entropy(out, y, params, context)
    prototypes = context.get("prototypes")
    if prototypes is None or lambda_f == 0:
        return loss
    targets = prototypes[y]
    known = ~torch.isnan(targets).any(dim=1, keepdim=True)
    targets = torch.where(known, targets, out.features.detach())
    return loss + lambda_f * F.mse_loss(out.features, targets)
