"""L2GD (Hanzely, Richtarik, arXiv:2002.05516, 2020): a mixture of global and local models.

Objective (1/N) sum_i F_i(x_i) + (lam/(2N)) sum_i ||x_i - mean x||^2, solved by a loopless
scheme: each step is, with probability 1 - p, a local step on every client and, with
probability p, an aggregation step x_i <- (1 - theta) x_i + theta * mean_j x_j.

Round-based form [ours, baselines.md]: one seeded coin per round (the same in every runtime and
on resume) decides the round's kind. A local round = E epochs of SGD per participant, nothing
sent. An aggregation round = participants upload x_i before the broadcast (`client_report`), the
server broadcasts their unweighted mean (the objective's 1/N), each moves towards it; no
training that round. theta = eta*lam/(N p) is given directly (<= 1). Every aggregation round
counts a fresh upload (the paper skips it after a previous aggregation step: not modelled).
Defaults p = 0.2, theta = 0.1 [our reading of the FedEM code's loopless local SGD].
Evaluated: x_i. Communication: the model up and down on aggregation rounds, 0 otherwise.
"""
from __future__ import annotations

from typing import Any

from pydantic import Field

from pfedkit.algorithms.registry import register
from pfedkit.core.contract import Algorithm, ClientData, ClientUpdate, Fit, HyperParams, Message
from pfedkit.core.params import Params, clone, interpolate, weighted_mean
from pfedkit.core.seeds import SERVER, numpy_rng
from pfedkit.core.search import float_range


def is_aggregation_round(seed: int, rnd: int, p: float) -> bool:
    """The round's coin: True (aggregation) with probability p, from a generator of its own."""
    return bool(numpy_rng(seed, rnd, SERVER, "l2gd-coin").random() < p)


@register
class L2GD(Algorithm):
    name = "l2gd"
    description = "L2GD: local SGD rounds and, with probability p, rounds mixing every model towards the mean"
    evaluated_model = "custom"  # the local model, mixed towards the mean on an aggregation round

    class Hyper(HyperParams):
        p: float = Field(0.2, ge=0, le=1, description="probability that a round is an aggregation round",
                         json_schema_extra=float_range(0.05, 0.5))
        theta: float = Field(0.1, ge=0, le=1, description="mixing weight towards the mean (eta*lam/(N p))",
                             json_schema_extra=float_range(0.01, 1.0, log=True))

    def aggregating(self, rnd: int) -> bool:
        return rnd >= 1 and is_aggregation_round(self.setup.seed, rnd, self.hyper.p)

    def init_client(self, cid: int, params: Params) -> dict[str, Any]:
        return {"params": clone(params)}

    def client_report(self, rnd: int, cid: int, client: dict, data: ClientData) -> Message | None:
        return {"params": client["params"]} if self.aggregating(rnd) else None

    def collect(self, rnd: int, server: Any, reports: dict[int, Message]) -> dict[str, Any]:
        ordered = sorted(reports)
        return {"mean": weighted_mean([reports[c]["params"] for c in ordered], [1.0] * len(ordered))}

    def broadcast(self, rnd: int, server: Any, cids: list[int]) -> dict[int, Message]:
        if self.aggregating(rnd):
            return {cid: {"mean": server["mean"]} for cid in cids}
        return {cid: {} for cid in cids}

    def client_update(self, rnd: int, cid: int, client: dict, message: Message, data: ClientData) -> ClientUpdate:
        if "mean" in message:
            return {"params": interpolate(client["params"], message["mean"], self.hyper.theta)}, {}
        params = yield Fit(client["params"])
        return {"params": params}, {}

    def aggregate(self, rnd: int, server: Any, replies: dict[int, Message]) -> None:
        return None  # the mean was only for this round

    def client_model(self, cid: int, server: Any, client: dict) -> Params:
        return client["params"]
