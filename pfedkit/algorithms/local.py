"""Local: every client trains only its own model; nothing is communicated (0 bytes)."""
from __future__ import annotations

from typing import Any

from pfedkit.algorithms.registry import register
from pfedkit.core.contract import Algorithm, ClientData, ClientUpdate, Fit, Message
from pfedkit.core.params import Params, clone


@register
class Local(Algorithm):
    name = "local"
    description = "Local: each client trains alone, no communication"
    evaluated_model = "own"
    supports_heterogeneous_models = True

    def init_client(self, cid: int, params: Params) -> dict[str, Any]:
        return {"params": clone(params)}

    def broadcast(self, rnd: int, server: Any, cids: list[int]) -> dict[int, Message]:
        return {cid: {} for cid in cids}

    def client_update(self, rnd: int, cid: int, client: dict, message: Message, data: ClientData) -> ClientUpdate:
        params = yield Fit(client["params"])
        return {"params": params}, {}

    def client_model(self, cid: int, server: Any, client: dict) -> Params:
        return client["params"]
