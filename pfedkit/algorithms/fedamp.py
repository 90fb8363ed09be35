"""FedAMP (Huang, Chu, Zhou, Wang, Liu, Pei, Zhang, AAAI 2021): attentive message passing.

The server keeps every client's latest uploaded model w_j (the initial model until j uploads). For
each participant i it builds the cloud model u_i = sum_j xi_ij w_j over ALL stored models:
  xi_ij = alpha_K * exp(-||w_i - w_j||^2 / sigma) / sigma   (j != i),   xi_ii = 1 - sum_{j != i} xi_ij,
so similar models attract each other; if sum_{j != i} xi_ij > 1, the off-diagonal weights are
rescaled to sum to 1 and xi_ii = 0 [ours, spec guard]. The client trains its OWN previous model for
E epochs on F_i(w) + (lam / (2 alpha_K)) ||w - u_i||^2 (FedProx's proximal loss with
mu = lam / alpha_K, anchor u_i) and uploads it; the server stores it.

Client state: its own model. Evaluated model: the client's model. Communication: u_i down, w_i up
(2 Sigma). Server state: the N latest models.
"""
from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import numpy as np
from pydantic import Field

from pfedkit.algorithms.fedprox import proximal_loss
from pfedkit.algorithms.peers import mix, mixing_matrix
from pfedkit.algorithms.registry import register
from pfedkit.core.contract import Algorithm, ClientData, ClientUpdate, Fit, HyperParams, Message
from pfedkit.core.params import Params, clone, squared_distance_f64
from pfedkit.core.search import float_range


def squared_distances_to(models: Sequence[Params], i: int) -> np.ndarray:
    """[N] float64 ||w_i - w_j||^2 over every parameter, for each stored model j (0 at j = i)."""
    anchor = models[i]
    distances = np.zeros(len(models))
    for j, model in enumerate(models):
        if j != i and model is not anchor:
            distances[j] = squared_distance_f64(anchor, model)
    return distances


def attention_row(distances_sq: np.ndarray, i: int, alpha_k: float, sigma: float) -> tuple[np.ndarray, bool]:
    """(xi_i., guarded): xi_ij = alpha_K e^{-d_ij/sigma} / sigma for j != i, xi_ii = 1 - sum_{j != i} xi_ij.

    Guard [ours, spec]: if sum_{j != i} xi_ij > 1 the off-diagonal weights are divided by their sum
    and xi_ii = 0 (guarded = True). float64; e^{-d/sigma} may underflow to 0 (then xi_ii = 1)."""
    off = alpha_k * np.exp(-np.asarray(distances_sq, dtype=np.float64) / sigma) / sigma
    off[i] = 0.0
    total = off.sum()
    if total > 1.0:
        return off / total, True
    off[i] = 1.0 - total
    return off, False


@register
class FedAMP(Algorithm):
    name = "fedamp"
    description = "FedAMP: per-client cloud models from attention weights on model distances, proximal local training"
    evaluated_model = "own"

    class Hyper(HyperParams):
        """FedAMP options (defaults: cwFedAvg Table 5, the seed papers' setting; PFLlib uses
        alpha_k = 1, lam = 1, sigma = 1).

        alpha_k: alpha_K, the step of the attentive message passing: scales every off-diagonal
            xi_ij and divides lam in the proximal term (1000 [cwFedAvg]).
        lam: lambda, weight of the proximal term lam/(2 alpha_K) ||w - u_i||^2 (1 [cwFedAvg, PFLlib]).
        sigma: scale of A'(x) = e^{-x/sigma}/sigma on squared model distances (0.1 [cwFedAvg]).
        """
        alpha_k: float = Field(1000.0, gt=0, description="alpha_K: attention step, scales xi and divides lam",
                               json_schema_extra=float_range(100.0, 10000.0, log=True))
        lam: float = Field(1.0, ge=0, description="lambda: proximal weight lam/(2 alpha_K) ||w - u_i||^2",
                           json_schema_extra=float_range(0.1, 10.0, log=True))
        sigma: float = Field(0.1, gt=0, description="sigma of the attention function e^{-d/sigma}/sigma",
                             json_schema_extra=float_range(0.01, 1.0, log=True))

    def init_server(self, params: Params) -> dict[str, Any]:
        initial = clone(params)  # one shared copy: every client's stored model until it uploads
        return {"models": {cid: initial for cid in range(self.setup.num_clients)}}

    def init_client(self, cid: int, params: Params) -> dict[str, Any]:
        return {"params": clone(params)}

    def broadcast(self, rnd: int, server: dict, cids: list[int]) -> dict[int, Message]:
        """u_i = sum_j xi_ij w_j over all stored models, for each participant i."""
        models = [server["models"][j] for j in range(self.setup.num_clients)]
        rows: dict[int, dict[int, float]] = {}
        messages: dict[int, Message] = {}
        guarded = 0
        for i in cids:
            row, rescaled = attention_row(squared_distances_to(models, i), i, self.hyper.alpha_k, self.hyper.sigma)
            guarded += int(rescaled)
            rows[i] = dict(enumerate(row.tolist()))
            messages[i] = {"params": mix(models, row, "FedAMP xi")}
        self.record(rnd, "xi", mixing_matrix(self.setup.num_clients, rows))
        self.record(rnd, "guarded_rows", guarded)
        return messages

    def client_update(self, rnd: int, cid: int, client: dict, message: Message, data: ClientData) -> ClientUpdate:
        """E epochs from the client's own model on CE + (lam/(2 alpha_K)) ||w - u_i||^2; upload w_i."""
        loss = partial(proximal_loss, mu=self.hyper.lam / self.hyper.alpha_k)
        trained = yield Fit(client["params"], loss=loss, context={"anchor": message["params"]})
        return {"params": trained}, {"params": trained}

    def aggregate(self, rnd: int, server: dict, replies: dict[int, Message]) -> dict[str, Any]:
        """Store each participant's upload as its latest model."""
        models = dict(server["models"])
        for cid in sorted(replies):
            models[cid] = replies[cid]["params"]
        return {"models": models}

    def client_model(self, cid: int, server: dict, client: dict) -> Params:
        return client["params"]

    def new_client_refusal(self) -> str:
        return ("its server stores every client's model and mixes all of them, a newcomer's initial one "
                "included, into each participant's cloud model, so a newcomer would not stay out of training")
