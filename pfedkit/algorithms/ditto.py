"""Ditto (Li, Hu, Beirami, Smith, ICML 2021): a personal model pulled towards the global one.

Each participant first trains its personal model v_i for `personal_epochs` epochs on
F_i(v) + (lam/2)||v - w^t||^2 (w^t: the received global model, fixed during the round; the
proximal term of FedProx), then trains the global model E epochs on F_i from w^t and uploads it;
the server averages (FedAvg, n_i weights). Personal first, as PFLlib's server does. The two
models have their own optimizers ("personal", "global"; kept across rounds with
`keep_optimizer_state`). lam = 1 (FL-bench; the paper tunes {0.01, 0.1, 1, 2}).
Evaluated: v_i. Communication: the model up and down. lam = 0: v_i is Local training.
"""
from __future__ import annotations

from functools import partial
from typing import Any

from pydantic import Field

from pfedkit.algorithms.fedavg import FedAvg
from pfedkit.algorithms.fedprox import proximal_loss
from pfedkit.algorithms.registry import register
from pfedkit.core.contract import ClientData, ClientUpdate, Fit, HyperParams, Message
from pfedkit.core.params import Params, clone
from pfedkit.core.search import float_range


@register
class Ditto(FedAvg):
    name = "ditto"
    description = "Ditto: personal model with a proximal pull lam to the global model, both trained each round"
    evaluated_model = "custom"  # the personal model v_i (the first Fit's answer)

    class Hyper(HyperParams):
        lam: float = Field(1.0, ge=0, description="proximal coefficient of the personal objective",
                           json_schema_extra=float_range(0.01, 10.0, log=True))
        personal_epochs: int = Field(1, ge=0, description="plocal: epochs on the personal model per round")

    def init_client(self, cid: int, params: Params) -> dict[str, Any]:
        return {"personal": clone(params)}

    def client_update(self, rnd: int, cid: int, client: dict, message: Message, data: ClientData) -> ClientUpdate:
        received = message["params"]
        personal = yield Fit(client["personal"], loss=partial(proximal_loss, mu=self.hyper.lam),
                             context={"anchor": received}, epochs=self.hyper.personal_epochs, optimizer="personal")
        trained = yield Fit(received, optimizer="global")
        return {"personal": personal}, {"params": trained, "weight": data.n_train}

    def client_model(self, cid: int, server: dict, client: dict) -> Params:
        return client["personal"]

    def joining_model(self, cid: int, server: dict, client: dict, data: ClientData) -> Params:
        """A newcomer has no personal model: it receives the global model (PFLlib's new clients)."""
        return server["params"]
