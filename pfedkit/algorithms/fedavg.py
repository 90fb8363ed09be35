"""FedAvg (McMahan et al., AISTATS 2017): train the global model locally, average by sample count.

Client state: none. Evaluated model: the global model (baselines.md, settings.md §4.1).
"""
from __future__ import annotations

from typing import Any

from pfedkit.algorithms.aggregation import Aggregation, params_mean_aggregation
from pfedkit.algorithms.base import Algorithm, ClientData, ClientUpdate, Fit, Message, register
from pfedkit.algorithms.params import Params, clone, weighted_mean


def fedavg_aggregate(replies: dict[int, Message], key: str = "params") -> Params:
    """w = sum_i n_i w_i / sum_i n_i over the replies (each carries `key` and `weight` = n_i)."""
    ordered = sorted(replies)
    return weighted_mean([replies[c][key] for c in ordered], [replies[c]["weight"] for c in ordered])


@register
class FedAvg(Algorithm):
    name = "fedavg"
    description = "FedAvg: one global model, sample-weighted averaging"

    def init_server(self, params: Params) -> dict[str, Any]:
        return {"params": clone(params)}

    def broadcast(self, rnd: int, server: dict, cids: list[int]) -> dict[int, Message]:
        return {cid: {"params": server["params"]} for cid in cids}

    def local_fit(self, message: Message) -> Fit:
        """The training request; subclasses (FedProx) change only the loss."""
        return Fit(message["params"])

    def client_update(self, rnd: int, cid: int, client: Any, message: Message, data: ClientData) -> ClientUpdate:
        params = yield self.local_fit(message)
        return client, {"params": params, "weight": data.n_train}

    def aggregate(self, rnd: int, server: dict, replies: dict[int, Message]) -> dict[str, Any]:
        if not replies:
            return server
        return {"params": fedavg_aggregate(replies)}

    def start_aggregation(self, rnd: int, server: dict, cids: list[int]) -> Aggregation:
        return params_mean_aggregation(self, FedAvg, rnd, server, cids, "params")  # a running sum

    def client_model(self, cid: int, server: dict, client: Any) -> Params:
        return server["params"]
