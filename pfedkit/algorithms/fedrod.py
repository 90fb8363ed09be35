"""FedRoD (Chen & Chao, *On Bridging Generic and Personalized Federated Learning for Image
Classification*, ICLR 2022; baselines.md "FedRoD").

Model: the shared body f and generic head g_G (the model's last Linear, averaged by the server)
plus a personal head g_P (same shape as g_G) that never leaves the client. Per mini-batch, one
SGD step on the sum of two losses whose gradients do not overlap:

    L_G = CE(z_G + gamma * log n_{i,.}, y)                   balanced softmax, trains f and g_G
    L_P = CE(z_G.detach() + g_P(f(x).detach()), y)           trains g_P only

with z_G = g_G(f(x)) and n_{i,c} the client's training counts (`data.class_counts`). A class the
client lacks has log 0 = -inf in the paper; it is replaced by ABSENT_LOG_COUNT, a large finite
negative number [ours], so the softmax gives it ~0 probability without NaN (its labels never
occur locally, so no sample is ever trained towards it).

g_P travels with the request as `Fit.extra` ("personal.weight", "personal.bias"), so the engine's
SGD step trains it beside the model (the vectorized runtime runs such requests with the
sequential trainer). Initialised as a copy of the initial generic head [ours]. Upload: body +
g_G with n_i (FedAvg). Prediction: argmax(z_G + z_P), evaluated as one Linear head with
W_G + W_P and b_G + b_P (`with_personal_head`; exact, both heads read the same features).

Paper-vs-code table: docs/algorithms/fedrod.md.
"""
from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field

from pfedkit.algorithms.registry import register
from pfedkit.core.aggregation import MeanOfUploads
from pfedkit.core.contract import Algorithm, ClientData, ClientUpdate, Fit, Forward, HyperParams, Message
from pfedkit.core.errors import ConfigError
from pfedkit.core.params import Params, clone, linear_layer_names, select
from pfedkit.core.search import float_range

ABSENT_LOG_COUNT = -1.0e4  # stands for log 0 = -inf: exp(-1e4) underflows to 0, no NaN
PERSONAL = "personal"      # prefix of the personal head's names in Fit.extra / client state


# ---------------------------------------------------------------------------------------------
# The math (pure functions)


def log_class_counts(counts: np.ndarray | torch.Tensor) -> torch.Tensor:
    """log n_{i,c} per class as float32 [C]; classes with n_{i,c} = 0 get ABSENT_LOG_COUNT."""
    counts = torch.as_tensor(np.asarray(counts), dtype=torch.float64)
    logs = torch.where(counts > 0, counts.clamp(min=1.0).log(), torch.full_like(counts, ABSENT_LOG_COUNT))
    return logs.float()


def linear_part(params: Params, prefix: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight [C, d], bias [C] or None) of the single Linear layer stored under `prefix.`."""
    weight, bias = linear_layer_names(params, prefix)
    return params[weight], (params[bias] if bias is not None else None)


def personal_head_from(head: Params) -> Params:
    """A personal head g_P with the generic head's shapes and values, named `personal.*`."""
    weight, bias = linear_part(head, "head")
    personal = {f"{PERSONAL}.weight": weight.detach().clone()}
    if bias is not None:
        personal[f"{PERSONAL}.bias"] = bias.detach().clone()
    return personal


def with_personal_head(params: Params, personal: Params) -> Params:
    """The model with head g_G + g_P: both heads are Linear maps of the same features, so
    (W_G + W_P) h + (b_G + b_P) = z_G + z_P, the paper's prediction, as one ordinary head (every
    runtime evaluates it like any model, whichever `eval_point`)."""
    weight_p, bias_p = linear_part(personal, PERSONAL)
    summed = dict(params)
    for name, value in select(params, "head").items():  # one Linear: a 2-d weight, a 1-d bias
        summed[name] = value + (weight_p if value.dim() == 2 else bias_p)
    return summed


def personal_logits(params: Params, features: torch.Tensor) -> torch.Tensor:
    """z_P = g_P(h) = W_P h + b_P."""
    weight, bias = linear_part(params, PERSONAL)
    return F.linear(features, weight, bias)


def balanced_softmax_loss(logits: torch.Tensor, y: torch.Tensor, log_counts: torch.Tensor,
                          gamma: float) -> torch.Tensor:
    """L_G = CE(z_G + gamma * log n_{i,.}, y), mean over the batch. Its gradient with respect to
    z_G is softmax(z_G + gamma log n) - onehot(y) (per sample, divided by the batch size)."""
    return F.cross_entropy(logits + gamma * log_counts.to(logits.dtype), y)


def fedrod_loss(out: Forward, y: torch.Tensor, params: Params, context: Mapping[str, Any], *,
                gamma: float) -> torch.Tensor:
    """L_G + L_P (module docstring). context["log_counts"]: `log_class_counts` of the client.

    L_P sees z_G and h only through .detach(), so the personal head's gradient comes from L_P
    alone and the body/generic head's from L_G alone: one SGD step on the sum is the paper's two
    updates (momentum and weight decay are per tensor; gradient clipping, if set, clips the
    joint norm)."""
    generic = balanced_softmax_loss(out.logits, y, context["log_counts"], gamma)
    personal = F.cross_entropy(out.logits.detach() + personal_logits(params, out.features.detach()), y)
    return generic + personal


# ---------------------------------------------------------------------------------------------
# The algorithm


@register
class FedRoD(MeanOfUploads, Algorithm):
    """The server averages body + generic head (`MeanOfUploads`, key "params")."""
    name = "fedrod"
    description = "FedRoD: shared body + generic head on balanced softmax, private personal head on top"
    evaluated_model = "custom"  # global body + generic head + the personal head
    head = "last"

    class Hyper(HyperParams):
        gamma: float = Field(1.0, ge=0, description="balanced-softmax exponent: CE(z + gamma log n_{i,c}, y); "
                             "0 = plain CE for the generic head", json_schema_extra=float_range(0.0, 2.0))

    def check(self) -> None:
        head = select(self.setup.ops.initial_params(), "head")
        try:
            linear_part(head, "head")
        except ValueError as error:
            raise ConfigError(f"fedrod needs the model's head to be one Linear layer (head='last'): {error}") from None

    def init_server(self, params: Params) -> dict[str, Any]:
        return {"params": clone(params)}

    def init_client(self, cid: int, params: Params) -> dict[str, Any]:
        """The personal head g_P: a copy of the initial generic head [ours]."""
        return {"personal": personal_head_from(select(params, "head"))}

    def broadcast(self, rnd: int, server: dict, cids: list[int]) -> dict[int, Message]:
        return {cid: {"params": server["params"]} for cid in cids}

    def client_update(self, rnd: int, cid: int, client: dict, message: Message, data: ClientData) -> ClientUpdate:
        trained = yield Fit(message["params"], loss=partial(fedrod_loss, gamma=self.hyper.gamma),
                            context={"log_counts": log_class_counts(data.class_counts)},
                            extra=client["personal"])
        personal = {name: trained[name] for name in client["personal"]}
        shared = {name: value for name, value in trained.items() if name.startswith(("body.", "head."))}
        return {"personal": personal}, {"params": shared, "weight": data.n_train}

    def client_model(self, cid: int, server: dict, client: dict) -> Params:
        """Global body + (generic head + personal head), see `with_personal_head`."""
        return with_personal_head(server["params"], client["personal"])

    def trained_model(self, cid: int, client: dict, params: Params) -> Params:
        """After local training: the trained body and generic head with the new personal head."""
        return with_personal_head({n: t for n, t in params.items() if n.startswith(("body.", "head."))},
                                  client["personal"])
