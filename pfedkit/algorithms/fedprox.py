"""FedProx (Li et al., MLSys 2020): FedAvg with the proximal term (mu/2)||w - w^t||^2.

The term is added to the loss, whose gradient is PFLlib's perturbed step grad F_i + mu (w - w^t).
mu = 0 is exactly FedAvg. Default mu = 0.01 [ours, baselines.md].
"""
from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any

import torch
from pydantic import Field

from pfedkit.algorithms.fedavg import FedAvg
from pfedkit.algorithms.registry import register
from pfedkit.core.contract import cross_entropy, Fit, Forward, HyperParams, Message
from pfedkit.core.params import Params, squared_distance
from pfedkit.core.search import float_range


def proximal_loss(out: Forward, y: torch.Tensor, params: Params, context: Mapping[str, Any], *, mu: float) -> torch.Tensor:
    """CE + (mu/2) ||w - anchor||^2, anchor = context["anchor"] (the received global model)."""
    loss = cross_entropy(out, y, params, context)
    if mu == 0:
        return loss
    return loss + 0.5 * mu * squared_distance(params, context["anchor"])


@register
class FedProx(FedAvg):
    name = "fedprox"
    description = "FedProx: FedAvg with a proximal term mu/2 ||w - w_global||^2"

    class Hyper(HyperParams):
        mu: float = Field(0.01, ge=0, description="proximal coefficient",
                          json_schema_extra=float_range(0.0001, 1.0, log=True))

    def local_fit(self, message: Message) -> Fit:
        return Fit(message["params"], loss=partial(proximal_loss, mu=self.hyper.mu),
                   context={"anchor": message["params"]})
