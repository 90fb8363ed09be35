"""FedPer (Arivazhagan et al., arXiv:1912.00818, 2019): a shared body, a private head.

The server averages one part of the model (FedAvg, n_i weights); the other part never leaves the
client. FedPer shares the body; LG-FedAvg (`lg_fedavg.py`) is the same round with the parts
swapped, and FedRep (`fedrep.py`) changes only the local training. Evaluated model: the global
shared part + the client's own private part. Communication: the shared part up and down.
"""
from __future__ import annotations

from typing import Any, ClassVar

from pfedkit.algorithms.registry import register
from pfedkit.core.aggregation import MeanOfUploads
from pfedkit.core.contract import Algorithm, ClientData, ClientUpdate, Fit, Message
from pfedkit.core.params import Params, clone, merge, select


@register
class FedPer(MeanOfUploads, Algorithm):
    name = "fedper"
    head_splits = ("fc",)  # any split: the head is simply the part kept (or frozen) per client
    description = "FedPer: FedAvg on the body, each client keeps its own head"
    evaluated_model = "shared_body"
    shared: ClassVar[str] = "body"  # the part the server averages; the other one stays private
    averaged = "shared"  # the server key holding the mean of that part (`MeanOfUploads`)

    @property
    def private(self) -> str:
        return "head" if self.shared == "body" else "body"

    def init_server(self, params: Params) -> dict[str, Any]:
        return {"shared": clone(select(params, self.shared))}

    def init_client(self, cid: int, params: Params) -> dict[str, Any]:
        return {"private": clone(select(params, self.private))}

    def broadcast(self, rnd: int, server: dict, cids: list[int]) -> dict[int, Message]:
        return {cid: {"params": server["shared"]} for cid in cids}

    def local_training(self, params: Params) -> ClientUpdate:
        """The client's training from (received shared part + own private part); FedRep overrides it."""
        return (yield Fit(params))

    def client_update(self, rnd: int, cid: int, client: dict, message: Message, data: ClientData) -> ClientUpdate:
        params = yield from self.local_training(merge(message["params"], client["private"]))
        return ({"private": select(params, self.private)},
                {"params": select(params, self.shared), "weight": data.n_train})

    def client_model(self, cid: int, server: dict, client: dict) -> Params:
        return merge(server["shared"], client["private"])
