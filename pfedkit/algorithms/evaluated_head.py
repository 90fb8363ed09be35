"""A mixin for methods whose `predict` reads the head from the client state (GPFL's valve, FedCP's
policy, PFedCS's normalisation): at evaluation the state's head is the evaluated model's own, so a
newcomer predicts with the head its fine-tuning trained. Registers no algorithm."""
from __future__ import annotations

from pfedkit.core.contract import ClientData
from pfedkit.core.params import Params, select


class HeadFromEvaluatedModel:
    """`Algorithm.evaluation_state`: the stored state with "head" replaced by the evaluated model's
    head (for a client that trained, the stored head itself: its `client_model` puts it there)."""

    def evaluation_state(self, cid: int, server: dict, client: dict, params: Params, data: ClientData) -> dict:
        return {**client, "head": select(params, "head")}
