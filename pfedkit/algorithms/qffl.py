"""q-FFL / q-FedAvg (Li, Sanjabi, Beirami, Smith, ICLR 2020, "Fair Resource Allocation in Federated
Learning"): minimise f_q(w) = sum_k p_k F_k(w)^{q+1} / (q + 1), which weighs clients with a high
loss more (q = 0: the usual objective).

Round t, participant k (the paper's q-FedAvg; its algorithm and equation numbers not checked here):
  F_k = F_k(w^t): the mean cross-entropy of the received model on the client's whole training set
      (the official code: "loss on the whole training data, with respect to the global model"),
      eval mode, computed before training;
  w_k = E epochs of local SGD from w^t (the config's epochs, batch and lr);
  the client uploads w_k and F_k. The server, with L the Lipschitz estimate (the paper: 1/lr):
      Delta w_k = L (w^t - w_k)
      Delta_k   = F_k^q Delta w_k
      h_k       = q F_k^{q-1} ||Delta w_k||^2 + L F_k^q
      w^{t+1}   = w^t - sum_k Delta_k / sum_k h_k
F_k is offset by 1e-10 before the powers (the official code's guard against F_k = 0). With q = 0,
Delta_k = L (w^t - w_k) and h_k = L, so w^{t+1} is the plain (uniform) mean of the participants'
models, not FedAvg's n_k-weighted one. Clients are sampled as the config says (uniformly) [ours:
the official code can also sample them with probability n_k / n].

The paper's clients upload Delta_k and h_k; here they upload w_k and F_k (the same bytes: a model
and a number) and the server computes both, so it can record each participant's F_k
(diagnostic "qffl_loss", {client: F_k}: the quantity q-FFL equalises). L is an option because the
algorithm does not see the run's lr: set `qffl.lipschitz` to 1/lr (default 20 = 1/0.05, the
config's default lr). Server state: the global model. Evaluated model: the global model.
Communication: the model down, the model + F_k up. Not a mean of uploads, so client-level DP
refuses it.
"""
from __future__ import annotations

from typing import Any

from pydantic import Field

from pfedkit.algorithms.registry import register
from pfedkit.algorithms.scoring import mean_loss
from pfedkit.core.contract import Algorithm, ClientData, ClientUpdate, Fit, HyperParams, Message
from pfedkit.core.params import Params, clone
from pfedkit.core.search import float_range

LOSS_GUARD = 1e-10  # F_k + 1e-10 before the powers (official code): F_k = 0 with q < 1 stays finite


def qffl_terms(received: Params, trained: Params, loss: float, q: float, lipschitz: float) -> tuple[Params, float]:
    """(Delta_k, h_k) of one participant (float64): Delta w_k = L (w^t - w_k), Delta_k = F^q Delta w_k,
    h_k = q F^{q-1} ||Delta w_k||^2 + L F^q, F = loss + 1e-10."""
    delta_w = {name: lipschitz * (received[name].double() - trained[name].double()) for name in received}
    f = loss + LOSS_GUARD
    squared_norm = float(sum((d ** 2).sum() for d in delta_w.values()))
    h = (q * f ** (q - 1) * squared_norm if q != 0 else 0.0) + lipschitz * f ** q
    return {name: f ** q * d for name, d in delta_w.items()}, h


def qffl_update(received: Params, terms: list[tuple[Params, float]]) -> Params:
    """w^{t+1} = w^t - sum_k Delta_k / sum_k h_k (summed in float64 in the given order, cast back)."""
    total_h = sum(h for _, h in terms)
    return {name: (value.double() - sum(delta[name] for delta, _ in terms) / total_h).to(value.dtype)
            for name, value in received.items()}


@register
class QFFL(Algorithm):
    name = "qffl"
    description = "q-FFL (q-FedAvg): fair aggregation weighting clients by their loss^q, step sum Delta / sum h"
    evaluated_model = "custom"  # the q-FedAvg update of the global model, not a mean of the uploads

    class Hyper(HyperParams):
        """q-FFL options.

        q: fairness strength; 0 is the uniform mean of the participants' models. Default 0.1 [code:
            Flower's QFedAvg; the paper tunes q per dataset, its values not retrieved here].
        lipschitz: L, the Lipschitz estimate; the paper sets L = 1/lr [paper]: the default 20 is
            1/0.05, the config's default lr (set it when you change lr).
        """
        q: float = Field(0.1, ge=0, description="fairness parameter q (0: uniform mean of the local models)",
                         json_schema_extra=float_range(0.001, 10.0, log=True))
        lipschitz: float = Field(20.0, gt=0, description="L, the Lipschitz estimate of the paper: set it to 1/lr "
                                 "(default 1/0.05, the config's default lr)")

    def init_server(self, params: Params) -> dict[str, Any]:
        return {"params": clone(params)}

    def broadcast(self, rnd: int, server: dict, cids: list[int]) -> dict[int, Message]:
        return {cid: {"params": server["params"]} for cid in cids}

    def client_update(self, rnd: int, cid: int, client: Any, message: Message, data: ClientData) -> ClientUpdate:
        received = message["params"]
        loss = mean_loss(self.setup.ops_for(cid), received, data.x_train, data.y_train, data.buffers)
        trained = yield Fit(received)
        return client, {"params": trained, "loss": loss}

    def aggregate(self, rnd: int, server: dict, replies: dict[int, Message]) -> dict[str, Any]:
        if not replies:
            return server
        received, cids = server["params"], sorted(replies)
        terms = [qffl_terms(received, replies[cid]["params"], float(replies[cid]["loss"]), self.hyper.q,
                            self.hyper.lipschitz) for cid in cids]
        self.record(rnd, "qffl_loss", {cid: float(replies[cid]["loss"]) for cid in cids})
        return {"params": qffl_update(received, terms)}

    def client_model(self, cid: int, server: dict, client: Any) -> Params:
        return server["params"]
