"""FedRep (Collins et al., ICML 2021): head epochs with the body frozen, then body epochs with the
head frozen; the server averages bodies, heads stay private.

`head_epochs` = tau_h = 10 (the authors' scripts; FedNH's default), `body_epochs` = tau_b (None: the
config's local_epochs; the authors use 1). Head and body have separate optimizers (named "head" and
"body", kept across rounds with `keep_optimizer_state`), same lr. With `head_epochs=0` no head
request is made: the round is FedAvg on the body with every head frozen at its initial value.
Evaluated: global body + own head. Communication: |body| up and down.
"""
from __future__ import annotations

from pydantic import Field

from pfedkit.algorithms.fedper import FedPer
from pfedkit.algorithms.registry import register
from pfedkit.core.contract import ClientUpdate, Fit, HyperParams
from pfedkit.core.params import Params
from pfedkit.core.search import int_range


@register
class FedRep(FedPer):
    name = "fedrep"
    description = "FedRep: train the private head (body frozen), then the shared body (head frozen)"
    quick_test_options = {"head_epochs": 1}  # (10 head epochs per round by default)

    class Hyper(HyperParams):
        head_epochs: int = Field(10, ge=0, description="tau_h: head epochs per round, body frozen",
                                 json_schema_extra=int_range(1, 10))
        body_epochs: int | None = Field(None, ge=0, description="tau_b: body epochs per round, head frozen "
                                        "(None: the config's local_epochs)")

    def local_training(self, params: Params) -> ClientUpdate:
        if self.hyper.head_epochs > 0:
            params = yield Fit(params, trainable="head", epochs=self.hyper.head_epochs, optimizer="head")
        return (yield Fit(params, trainable="body", epochs=self.hyper.body_epochs, optimizer="body"))
