"""FedAvg (McMahan et al., AISTATS 2017): train the global model locally, average by sample count.

Client state: none. Evaluated model: the global model (baselines.md, settings.md §4.1).
"""
from __future__ import annotations

from typing import Any

from pfedkit.algorithms.registry import register
from pfedkit.core.aggregation import MeanOfUploads
from pfedkit.core.contract import Algorithm, ClientData, ClientUpdate, Fit, Message
from pfedkit.core.params import Params, clone


@register
class FedAvg(MeanOfUploads, Algorithm):
    """The server averages the whole model (`MeanOfUploads`, key "params")."""
    name = "fedavg"
    description = "FedAvg: one global model, sample-weighted averaging"
    evaluated_model = "global"

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

    def client_model(self, cid: int, server: dict, client: Any) -> Params:
        return server["params"]
