"""MOON (Li, He, Song, CVPR 2021): FedAvg with a model-contrastive term in the local loss.

Round: the server broadcasts the global model w^t; the participant computes, once, the
representations z_g (w^t) and z_p (its own model from its previous participation) of all its
training samples (eval mode, no gradient), then trains w^t for E epochs on
CE + mu * l_con(z, z_g, z_p) and uploads it; the server averages (FedAvg, n_i weights).
Representation = the body output (PFLlib's reading; MOON's projection head is not built in).

Client state: its model at the end of its previous participation (initially the initial model).
Evaluated model: the global model. Communication: the model down, the model + n_i up (2 Sigma).
"""
from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from pydantic import Field

from pfedkit.algorithms.fedavg import FedAvg
from pfedkit.algorithms.registry import register
from pfedkit.core.contract import ClientData, ClientUpdate, cross_entropy, Fit, Forward, HyperParams, Message
from pfedkit.core.params import Params, clone
from pfedkit.core.search import float_range

CHUNK = 1000  # samples per eval-mode forward when computing z_g and z_p (bounded memory)


def contrastive_loss(z: torch.Tensor, z_global: torch.Tensor, z_prev: torch.Tensor, tau: float) -> torch.Tensor:
    """MOON's l_con, averaged over the batch:

        l_con = -log( e^{cos(z, z_g)/tau} / (e^{cos(z, z_g)/tau} + e^{cos(z, z_p)/tau}) )
              = logaddexp(cos(z, z_g)/tau, cos(z, z_p)/tau) - cos(z, z_g)/tau

    per sample (rows of [B, d] tensors, flattened after the batch axis); log 2 when z_g = z_p."""
    z, z_global, z_prev = z.flatten(1), z_global.flatten(1), z_prev.flatten(1)
    positive = F.cosine_similarity(z, z_global, dim=1) / tau
    negative = F.cosine_similarity(z, z_prev, dim=1) / tau
    return (torch.logaddexp(positive, negative) - positive).mean()


def moon_loss(out: Forward, y: torch.Tensor, params: Params, context: Mapping[str, Any], *,
              mu: float, tau: float) -> torch.Tensor:
    """CE + mu * l_con(h, z_g[index], z_p[index]): h = the trained model's body output on the batch,
    context["z_global"] / ["z_prev"] = the frozen models' representations of the client's whole
    training set, read at the batch's positions `out.index`."""
    z_global = context["z_global"][out.index]
    z_prev = context["z_prev"][out.index]
    return cross_entropy(out, y, params, context) + mu * contrastive_loss(out.features, z_global, z_prev, tau)


def representations(ops: Any, params: Params, data: ClientData) -> torch.Tensor:
    """Eval-mode body output of `params` on every training sample of the client (its own BatchNorm
    statistics), [n_train, d], no gradient."""
    return ops.features(params, data.x_train, data.buffers, chunk=CHUNK).flatten(1)


@register
class MOON(FedAvg):
    name = "moon"
    description = "MOON: FedAvg with a model-contrastive loss (global vs previous local representation)"

    class Hyper(HyperParams):
        """MOON options.

        mu: weight of l_con. Paper: 5 (CIFAR-10), 1 (CIFAR-100, Tiny-ImageNet); FL-bench 5. Default 1
            [ours: FedReMa's setting, paper's CIFAR-100 value].
        tau: temperature of the cosine similarities, 0.5 [paper].
        The representation is the body output [ours: PFLlib-comparable]; MOON's 2-layer projection
        head (output 256) is not built in (use a model whose body ends with such an MLP).
        """
        mu: float = Field(1.0, ge=0, description="weight of the model-contrastive term",
                          json_schema_extra=float_range(0.1, 10.0, log=True))
        tau: float = Field(0.5, gt=0, description="temperature of the cosine similarities",
                           json_schema_extra=float_range(0.1, 1.0))

    def init_client(self, cid: int, params: Params) -> dict[str, Any]:
        return {"params": clone(params)}

    def client_update(self, rnd: int, cid: int, client: dict, message: Message, data: ClientData) -> ClientUpdate:
        received = message["params"]
        ops = self.setup.ops_for(cid)
        context = {"z_global": representations(ops, received, data),
                   "z_prev": representations(ops, client["params"], data)}
        trained = yield Fit(received, loss=partial(moon_loss, mu=self.hyper.mu, tau=self.hyper.tau), context=context)
        return {"params": trained}, {"params": trained, "weight": data.n_train}
