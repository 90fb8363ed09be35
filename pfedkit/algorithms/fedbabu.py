"""FedBABU (Oh, Kim, Yun, ICLR 2022): train the body with a fixed random head; personalise by
fine-tuning at evaluation time.

The head keeps its random initial value (the same on every client) and is never trained during
federated training: clients train the body only, the server averages bodies (n_i weights).
Evaluation [ours, baselines.md]: at every evaluation point each client fine-tunes a copy of
(global body + fixed head) on its training split, `finetune_epochs` epochs (or exactly
`finetune_steps` mini-batches) of `finetune_part` ("all": body and head, the paper; "head": the
head only), and is evaluated with it; the copy is thrown away (`Algorithm.adapt`), so training is
the same whatever is evaluated. `finetune_epochs=0` evaluates the un-fine-tuned global model.
Communication: |body| up and down (the fixed head is known to every client from the start).
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from pfedkit.algorithms.registry import register
from pfedkit.core.aggregation import MeanOfUploads
from pfedkit.core.contract import Algorithm, ClientData, ClientUpdate, Fit, HyperParams, Message
from pfedkit.core.params import Params, clone, merge, select
from pfedkit.core.search import int_range


@register
class FedBABU(MeanOfUploads, Algorithm):
    name = "fedbabu"
    head_splits = ("fc",)  # any split: the head is simply the part kept (or frozen) per client
    averaged = "body"  # the server averages the bodies (`MeanOfUploads`)
    description = "FedBABU: body-only federated training with a fixed random head, fine-tuned at evaluation"
    evaluated_model = "custom"  # global body + the fixed initial head, fine-tuned before evaluation
    quick_test_options = {"finetune_epochs": 1}  # (5 fine-tuning epochs before each evaluation by default)

    class Hyper(HyperParams):
        finetune_epochs: int = Field(5, ge=0, description="tau_f: fine-tuning epochs before each evaluation "
                                     "(0: evaluate the global model as is)", json_schema_extra=int_range(1, 10))
        finetune_steps: int | None = Field(None, ge=1, description="fine-tune exactly this many mini-batches "
                                           "instead of finetune_epochs")
        finetune_part: Literal["all", "head"] = Field("all", description="what fine-tuning trains: the whole "
                                                      "model (paper) or the head only")

    def init_server(self, params: Params) -> dict[str, Any]:
        return {"body": clone(select(params, "body"))}

    def init_client(self, cid: int, params: Params) -> dict[str, Any]:
        return {"head": clone(select(params, "head"))}  # the fixed random head, identical on all clients

    def broadcast(self, rnd: int, server: dict, cids: list[int]) -> dict[int, Message]:
        return {cid: {"params": server["body"]} for cid in cids}

    def client_update(self, rnd: int, cid: int, client: dict, message: Message, data: ClientData) -> ClientUpdate:
        params = yield Fit(merge(message["params"], client["head"]), trainable="body")
        return client, {"params": select(params, "body"), "weight": data.n_train}

    def client_model(self, cid: int, server: dict, client: dict) -> Params:
        return merge(server["body"], client["head"])

    def adapt(self, cid: int, server: dict, client: dict, params: Params) -> Fit | None:
        if self.hyper.finetune_steps is None and self.hyper.finetune_epochs == 0:
            return None
        if self.hyper.finetune_steps is not None:
            return Fit(params, trainable=self.hyper.finetune_part, steps=self.hyper.finetune_steps)
        return Fit(params, trainable=self.hyper.finetune_part, epochs=self.hyper.finetune_epochs)
