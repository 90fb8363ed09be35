"""FedDyn (Acar, Zhao, Matas, Mattina, Whatmough, Saligrama, ICLR 2021): a dynamic regulariser
that aligns the clients' stationary points with the global loss's.

Algorithm 1 of the paper, with m clients in all, P_t the round's participants and alpha > 0:

    client k in P_t:   theta_k^t = argmin_theta  L_k(theta) - <grad L_k(theta_k^{t-1}), theta>
                                                 + (alpha/2) ||theta - theta^{t-1}||^2
                       grad L_k(theta_k^t) = grad L_k(theta_k^{t-1}) - alpha (theta_k^t - theta^{t-1})
    server:            h^t = h^{t-1} - alpha (1/m) sum_{k in P_t} (theta_k^t - theta^{t-1})
                       theta^t = (1/|P_t|) sum_{k in P_t} theta_k^t - (1/alpha) h^t

The argmin is the run's local SGD (E epochs) on `feddyn_loss`; the gradient state update is the
first-order condition of that argmin, applied to the trained model as the paper does. The server
averages its participants UNIFORMLY (not by n_i), as the paper does; h's sum is normalised by the
number of ALL clients m. h and the gradient states start at 0. The reply carries no n_i.
client_alpha=by_size gives client k alpha_k = alpha * mean_j n_j / n_k in its objective and its
gradient state, as the authors' code and FL-bench do [code]; the server is unchanged (h / alpha
does not depend on alpha).

alpha -> 0 is not FedAvg: h^t / alpha does not depend on alpha (h is alpha times the summed drifts),
so theta^1 = mean_k theta_k^1 + (1/m) sum_k (theta_k^1 - theta^0) for every alpha.

Client state: grad L_k(theta_k^{t-1}) (one model-sized tensor set; 0 at the start). Server state:
theta and h. Communication: the model down, the model up. Evaluated model: the server's theta^t.
Docs: docs/algorithms/feddyn.md.
"""
from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any, Literal

import torch
from pydantic import Field

from pfedkit.algorithms.fedavg import FedAvg
from pfedkit.algorithms.fedprox import proximal_loss
from pfedkit.algorithms.registry import register
from pfedkit.core.contract import Algorithm, ClientData, ClientUpdate, Fit, Forward, HyperParams, Message
from pfedkit.core.params import Params, WeightedSum, clone, weighted_mean
from pfedkit.core.search import float_range


def feddyn_loss(out: Forward, y: torch.Tensor, params: Params, context: Mapping[str, Any], *,
                alpha: float) -> torch.Tensor:
    """L_k(theta) - <g_k, theta> + (alpha/2) ||theta - theta^{t-1}||^2 (Algorithm 1's local objective):
    context["gradient"] = g_k = grad L_k(theta_k^{t-1}), context["anchor"] = theta^{t-1}."""
    gradient = context["gradient"]
    linear = sum((params[name] * gradient[name]).sum() for name in gradient)
    return proximal_loss(out, y, params, context, mu=alpha) - linear


def updated_gradient(gradient: Params, trained: Params, received: Params, alpha: float) -> Params:
    """grad L_k(theta_k^t) = grad L_k(theta_k^{t-1}) - alpha (theta_k^t - theta^{t-1})."""
    return {name: gradient[name] - alpha * (trained[name] - received[name]) for name in gradient}


@register
class FedDyn(Algorithm):
    name = "feddyn"
    description = "FedDyn: dynamic linear + quadratic regulariser per client, server state h (uniform mean)"
    evaluated_model = "custom"  # the uniform mean of the participants minus h / alpha

    class Hyper(HyperParams):
        """alpha = 0.01 [the authors' code's CIFAR-10 example; the paper searches {0.1, 0.01, 0.001}];
        one alpha for every client [paper]; by_size: alpha_k = alpha * mean_j n_j / n_k [code: the
        authors', FL-bench]."""
        alpha: float = Field(0.01, gt=0, description="regularisation alpha of the dynamic regulariser",
                             json_schema_extra=float_range(0.001, 0.1, log=True))
        client_alpha: Literal["equal", "by_size"] = Field(
            "equal", description="the clients' alpha: equal (paper) or alpha * mean_j n_j / n_k (authors' code)")

    def init_server(self, params: Params) -> dict[str, Params]:
        return {"params": clone(params), "h": {name: torch.zeros_like(v) for name, v in params.items()}}

    def init_client(self, cid: int, params: Params) -> dict[str, Params]:
        return {"gradient": {name: torch.zeros_like(v) for name, v in params.items()}}

    broadcast = FedAvg.broadcast        # theta^{t-1} down
    client_model = FedAvg.client_model  # the server's theta^t

    def client_update(self, rnd: int, cid: int, client: dict, message: Message, data: ClientData) -> ClientUpdate:
        received, gradient, alpha = message["params"], client["gradient"], self.client_alpha(cid)
        trained = yield Fit(received, loss=partial(feddyn_loss, alpha=alpha),
                            context={"anchor": received, "gradient": gradient})
        return {"gradient": updated_gradient(gradient, trained, received, alpha)}, {"params": trained}

    def client_alpha(self, cid: int) -> float:
        """alpha_k of client k's objective and gradient state: alpha, or with client_alpha=by_size
        alpha * mean_j n_j / n_k over all clients (the authors' code: a client's L_k is its mean loss,
        so a small client's regulariser weighs more). The server's h^t / alpha does not depend on it."""
        if self.hyper.client_alpha == "equal":
            return self.hyper.alpha
        sizes = self.setup.train_counts.sum(axis=1)
        return self.hyper.alpha * float(sizes.mean()) / float(max(sizes[cid], 1))

    def aggregate(self, rnd: int, server: dict, replies: dict[int, Message]) -> dict[str, Params]:
        """h^t and theta^t of Algorithm 1 (module docstring)."""
        if not replies:
            return server
        alpha, previous = self.hyper.alpha, server["params"]
        models = [replies[cid]["params"] for cid in sorted(replies)]
        drift = WeightedSum()  # (alpha / m) sum_k (theta_k^t - theta^{t-1})
        for model in models:
            drift.add({name: model[name] - previous[name] for name in previous}, alpha / self.setup.num_clients)
        h = {name: value - drift.total[name] for name, value in server["h"].items()}
        mean = weighted_mean(models, [1.0] * len(models))
        return {"params": {name: mean[name] - h[name] / alpha for name in mean}, "h": h}
