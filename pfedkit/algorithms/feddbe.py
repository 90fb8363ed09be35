"""FedDBE = FedAvg + DBE (Zhang, Hua, Cao, Wang, Song, Xue, Ma, Guan, *Eliminating Domain Bias for
Federated Learning in Representation Space*, NeurIPS 2023).

The Domain Bias Eliminator has two parts on client i:
  - PRBM (personalised representation bias memory): a learnable vector z̄_i of the feature size d,
    added to the body's output before the head: logits = head(f(x) + z̄_i). It never travels.
  - MR (mean regularisation): the representation mean is pulled towards a global mean z̄^g,

        L_i = CE(head(f(x) + z̄_i), y) + kappa * (1/d) sum_k 0.5 (r_k - z̄^g_k)^2          (DBE loss)
        r <- (1 - m) r.detach() + m * mean_batch f(x)                              (running mean)

    r restarts at 0 with each local training and carries the current batch's mean with its
    gradient (m = `momentum`; m = 1: the batch mean itself, the authors' script).
z̄^g is the consensus of an initialisation period: pfedkit's round 1 is that period, plain FedAvg
(CE on head(f(x)), no PRBM, no MR), in which each participant uploads its running mean r_i after
training; the server sets z̄^g = sum_i n_i r_i / sum_i n_i once, from the first round with replies,
and keeps it. From then on every participant trains the DBE loss from the global model (body
and head, with its own z̄_i) and uploads body + head; the server averages them (FedAvg, n_i
weights). z̄_i starts at 0 and is trained by the same SGD step as the model (`Fit.extra`).

Evaluated model: the global model with z̄_i folded into the head's bias: head(h + z̄_i) =
W h + (W z̄_i + b) for the one Linear head (exact in real arithmetic; `with_bias_memory`).
Communication: the model (+ z̄^g, d floats, once it exists) down; the model + n_i (+ r_i in the
initialisation round) up. Paper-vs-code table: docs/algorithms/feddbe.md.
"""
from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from pydantic import Field

from pfedkit.algorithms.extra_layers import check_linear_head, head_linear
from pfedkit.algorithms.registry import register
from pfedkit.core.aggregation import fedavg_aggregate
from pfedkit.core.contract import Algorithm, ClientData, ClientUpdate, Fit, Forward, HyperParams, Message
from pfedkit.core.params import Params, clone, linear_layer_names, weighted_mean
from pfedkit.core.search import float_range

MEMORY = "dbe_memory"    # z̄_i among a Fit's extra tensors
RUNNING = "dbe_running"  # r, updated in place by the loss (read after training)


# ---------------------------------------------------------------------------------------------
# The math (pure functions)


def dbe_loss(out: Forward, y: torch.Tensor, params: Params, context: Mapping[str, Any], *,
             kappa: float, momentum: float) -> torch.Tensor:
    """The DBE loss (module docstring) with the running mean r kept in params[RUNNING] (updated in
    place through .detach(), so it gets no gradient itself). Without context["global_mean"] (the
    initialisation round): plain CE on the model's logits, r still tracked."""
    running = params[RUNNING]
    current = (1.0 - momentum) * running.detach() + momentum * out.features.mean(dim=0)
    running.detach().copy_(current.detach())
    if "global_mean" not in context:
        return F.cross_entropy(out.logits, y)
    weight, bias = head_linear(params)
    logits = F.linear(out.features + params[MEMORY], weight, bias)
    regulariser = (0.5 * (current - context["global_mean"]) ** 2).mean()
    return F.cross_entropy(logits, y) + kappa * regulariser


def with_bias_memory(params: Params, memory: torch.Tensor) -> Params:
    """The model whose head computes head(h + z̄_i): bias b + W z̄_i (the same logits as adding z̄_i
    to the features, for a Linear head), every other entry as given."""
    weight_name, bias_name = linear_layer_names(params, "head")
    return {**params, bias_name: params[bias_name] + params[weight_name] @ memory}


# ---------------------------------------------------------------------------------------------
# The algorithm


@register
class FedDBE(Algorithm):
    name = "feddbe"
    description = "FedDBE: FedAvg + a private representation bias added to features, mean-regularised to a global mean"
    evaluated_model = "custom"  # the global model with the client's z̄_i folded into the head's bias

    class Hyper(HyperParams):
        kappa: float = Field(50.0, ge=0, description="weight of the mean regularisation (MR) towards the global "
                             "representation mean", json_schema_extra=float_range(1.0, 100.0, log=True))
        momentum: float = Field(1.0, gt=0, le=1, description="m: running mean r <- (1 - m) r + m * batch mean "
                                "(1: the batch mean, the authors' script; PFLlib's default 0.1)")

    def __init__(self, hyper: HyperParams, setup) -> None:
        super().__init__(hyper, setup)
        self.feature_dim = int(setup.ops.template.feature_dim) if setup.ops is not None else None

    def check(self) -> None:
        check_linear_head(self.setup, self.name, needs_bias=True)  # z̄_i is folded into the head's bias

    def init_server(self, params: Params) -> dict[str, Any]:
        """The global model; no global mean until the initialisation round's uploads."""
        return {"params": clone(params), "global_mean": None}

    def init_client(self, cid: int, params: Params) -> dict[str, Any]:
        return {"memory": torch.zeros(self.feature_dim)}

    def broadcast(self, rnd: int, server: dict, cids: list[int]) -> dict[int, Message]:
        message = {"params": server["params"]}
        if server["global_mean"] is not None:
            message["global_mean"] = server["global_mean"]
        return {cid: message for cid in cids}

    def client_update(self, rnd: int, cid: int, client: dict, message: Message, data: ClientData) -> ClientUpdate:
        initialising = "global_mean" not in message
        loss = partial(dbe_loss, kappa=self.hyper.kappa, momentum=self.hyper.momentum)
        context = {} if initialising else {"global_mean": message["global_mean"]}
        trained = yield Fit(message["params"], loss=loss, context=context,
                            extra={MEMORY: client["memory"], RUNNING: torch.zeros(self.feature_dim)})
        reply = {"params": {n: trained[n] for n in message["params"]}, "weight": data.n_train}
        if initialising:
            reply["running_mean"] = trained[RUNNING]
        return {"memory": trained[MEMORY]}, reply

    def aggregate(self, rnd: int, server: dict, replies: dict[int, Message]) -> dict[str, Any]:
        """FedAvg of the models; the first round with replies also fixes z̄^g = the n_i-weighted
        mean of the uploaded running means."""
        if not replies:
            return server
        global_mean = server["global_mean"]
        if global_mean is None:
            ordered = sorted(replies)
            global_mean = weighted_mean([{"mean": replies[c]["running_mean"]} for c in ordered],
                                        [replies[c]["weight"] for c in ordered])["mean"]
        return {"params": fedavg_aggregate(replies), "global_mean": global_mean}

    def client_model(self, cid: int, server: dict, client: dict) -> Params:
        return with_bias_memory(server["params"], client["memory"])

    def trained_model(self, cid: int, client: dict, params: Params) -> Params:
        """After local training: the trained model with the new z̄_i folded in."""
        return with_bias_memory({n: t for n, t in params.items() if n.startswith(("body.", "head."))},
                                client["memory"])
