"""FedUV (Son, Kim, Chung, Huang, Liu, CVPR 2024): FedAvg with uniformity and variance regularisers.

Round: FedAvg's (broadcast w^t, E local epochs from w^t, n_i-weighted average), with the local loss
CE + mu * L_var + lam * L_unif on each mini-batch of B samples:
  L_var  = mean_c ReLU(gamma - std_b softmax(z_b)_c), unbiased std over the batch, gamma = 1/sqrt(C)
           (the std of a one-hot column): keeps every class's predicted probability varying;
  L_unif = mean_{b<b'} exp(-||h_b - h_b'||^2 / sigma_u), h = body output (not normalised), sigma_u =
           median of the batch's non-zero pairwise squared distances: spreads the representations.
Code: sonhamin/FedUV (`algs/feduv.py`). Client state: none. Evaluated model: the global model.
Communication: the model down, the model + n_i up (2 Sigma).
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from pydantic import Field

from pfedkit.algorithms.fedavg import FedAvg
from pfedkit.algorithms.registry import register
from pfedkit.core.contract import cross_entropy, Fit, Forward, HyperParams, Message
from pfedkit.core.params import Params
from pfedkit.core.search import float_range


def variance_loss(logits: torch.Tensor) -> torch.Tensor:
    """L_var = (1/C) sum_c ReLU(gamma - std_b p_bc), p = softmax(logits) [B, C], unbiased std over
    the batch, gamma = 1/sqrt(C). 0 for a batch of one sample [ours: the std is undefined]."""
    batch, classes = logits.shape
    if batch < 2:
        return logits.sum() * 0.0
    std = F.softmax(logits, dim=1).std(dim=0, correction=1)
    return F.relu(1.0 / math.sqrt(classes) - std).mean()


def pairwise_squared_distances(h: torch.Tensor) -> torch.Tensor:
    """||h_b - h_b'||^2 for the B(B-1)/2 pairs b < b' (row-major order), from explicit differences
    (no sqrt, so the gradient is defined at coinciding points; runs under torch.vmap)."""
    h = h.flatten(1)
    rows, cols = torch.triu_indices(h.shape[0], h.shape[0], offset=1, device=h.device)
    return ((h[rows] - h[cols]) ** 2).sum(dim=1)


def uniformity_loss(features: torch.Tensor) -> torch.Tensor:
    """L_unif = mean_{b<b'} exp(-||h_b - h_b'||^2 / sigma_u), sigma_u = median of the non-zero
    pairwise squared distances (the lower middle value for an even count, as torch.median; not
    detached, as in FedUV's code). All distances 0: sigma_u = 1 [ours] (every term is 1 anyway).
    0 for a batch of one sample [ours: no pair]."""
    if features.shape[0] < 2:
        return features.sum() * 0.0
    distances = pairwise_squared_distances(features)
    sigma = torch.nanmedian(torch.where(distances > 0, distances, torch.nan))
    sigma = torch.where(torch.isnan(sigma), torch.ones_like(sigma), sigma)
    return torch.exp(-distances / sigma).mean()


def feduv_loss(out: Forward, y: torch.Tensor, params: Params, context: Mapping[str, Any], *,
               mu: float, lam: float) -> torch.Tensor:
    """CE + mu * L_var(logits) + lam * L_unif(features); exactly CE when mu = lam = 0."""
    loss = cross_entropy(out, y, params, context)
    if mu:
        loss = loss + mu * variance_loss(out.logits)
    if lam:
        loss = loss + lam * uniformity_loss(out.features)
    return loss


@register
class FedUV(FedAvg):
    name = "feduv"
    description = "FedUV: FedAvg with class-probability variance and representation uniformity regularisers"

    class Hyper(HyperParams):
        """FedUV options.

        mu: weight of L_var, 2.5 [code: FedUV `std_coeff`; cwFedAvg Table 5].
        lam: weight of L_unif, 0.5 [code: FedUV `unif_coeff`; cwFedAvg Table 5].
        gamma = 1/sqrt(C) [code: std of the identity matrix's columns] and sigma_u = the batch's
        median non-zero squared distance [code] are not options.
        """
        mu: float = Field(2.5, ge=0, description="weight of the variance regulariser L_var",
                          json_schema_extra=float_range(0.25, 10.0, log=True))
        lam: float = Field(0.5, ge=0, description="weight of the uniformity regulariser L_unif",
                           json_schema_extra=float_range(0.05, 2.0, log=True))

    def local_fit(self, message: Message) -> Fit:
        return Fit(message["params"], loss=partial(feduv_loss, mu=self.hyper.mu, lam=self.hyper.lam))
