"""pFedSim (Tan, Zhou, Liu, Wang, Yu, *pFedSim: Similarity-Aware Model Aggregation Towards
Personalized Federated Learning*, arXiv:2305.15706, 2023; the first author's implementation is
FL-bench's `src/server/pfedsim.py`, which this module follows where the paper could not be read).

Warm-up (rounds 1..W, W = int(`warmup` R), R the run's rounds): FedAvg. Personalisation (rounds
> W): the server keeps every client's latest trained model w_j (the warm-up's final global model
for a client that has not trained since) and a similarity matrix S (identity at the start):
after each round, for every pair i != j of the round's participants,

    S_ij = S_ji = max(0, (1/C) sum_c cos(W_i[c], W_j[c]))                                     (1)

W_i[c] the c-th row (class c) of client i's classifier weight. Client i downloads its own model
with the body replaced by

    body_i = sum_j a_ij body_j,   a_ij = l_ij / sum_k l_ik,   l_ij = -log(1 - s_ij)             (2)

s_ij = S_ij for j != i, s_ii = 0.9999 [code: FL-bench], over every client (those with S_ij = 0
weigh nothing), or its own model unchanged while sum_j S_ij <= 1 (no similar client yet). The
classifier (the head) is never mixed: each client's stays its own. All similarities equal to
s_ii (a uniform a_ij) give the unweighted mean of the bodies: FedPer's body average over equal n_i.

Client state: none (the server stores the models, as FL-bench). Evaluated model: the global model
during the warm-up, then the client's own latest trained model (FL-bench's test model); the
warm-up's global model for a client that has not trained since. Communication: the whole model
down and up (the head is needed for (1)), + n_i.
"""
from __future__ import annotations

from typing import Any

import torch
from pydantic import Field

from pfedkit.algorithms.registry import register
from pfedkit.core.aggregation import fedavg_aggregate
from pfedkit.core.contract import Algorithm, ClientData, ClientUpdate, Fit, HyperParams, Message
from pfedkit.core.errors import ConfigError
from pfedkit.core.params import Params, clone, linear_layer_names, merge, select, weighted_mean
from pfedkit.core.search import float_range

SELF_SIMILARITY = 0.9999  # s_ii in (2): FL-bench's constant (log(1 - 1) would be infinite)


def classifier_similarity(weight_i: torch.Tensor, weight_j: torch.Tensor) -> float:
    """(1): max(0, mean over rows c of cos(W_i[c], W_j[c])), rows = classes."""
    rows = torch.nn.functional.cosine_similarity(weight_i.double(), weight_j.double(), dim=-1)
    return max(0.0, float(rows.mean()))


def aggregation_weights(similarities: torch.Tensor, cid: int) -> torch.Tensor:
    """a_i of (2) from row i of S: l_ij = -log(1 - s_ij) with s_ii = 0.9999, normalised."""
    s = similarities[cid].double().clone()
    s[cid] = SELF_SIMILARITY
    logits = -torch.log1p(-s)
    return logits / logits.sum()


def personalised_body(bodies: list[Params], weights: torch.Tensor) -> Params:
    """sum_j a_ij body_j over the clients with a_ij > 0."""
    chosen = [j for j in range(len(bodies)) if weights[j] > 0]
    return weighted_mean([bodies[j] for j in chosen], [float(weights[j]) for j in chosen])


@register
class PFedSim(Algorithm):
    name = "pfedsim"
    description = "pFedSim: FedAvg warm-up, then bodies aggregated over clients with similar classifiers"
    evaluated_model = "custom"  # the global model in the warm-up, the client's own trained model after
    head = "last"
    # No warm-up in the generic tests' short runs, so that their second round downloads mixed bodies.
    quick_test_options = {"warmup": 0.0}

    class Hyper(HyperParams):
        """pFedSim options: the warm-up's share of the rounds, 0.5 [code: FL-bench `warmup_round`]."""
        warmup: float = Field(0.5, ge=0, le=1, description="fraction of the rounds trained as FedAvg "
                              "(W = int(warmup * rounds))", json_schema_extra=float_range(0.1, 0.9))

    def check(self) -> None:
        try:
            self.classifier_weight()
        except ValueError as err:
            raise ConfigError(f"pfedsim: similarities are over the classifier, which must be one Linear layer "
                              f"({err}); use head_split=last") from None

    def classifier_weight(self) -> str:
        return linear_layer_names(select(self.setup.ops.initial_params(), "head"), "head")[0]

    def warming_up(self, rnd: int) -> bool:
        return rnd <= int(self.hyper.warmup * self.setup.rounds)

    # --- state -------------------------------------------------------------------------------

    def init_server(self, params: Params) -> dict[str, Any]:
        """params: the global model (frozen after the warm-up); models: {cid: latest trained model}."""
        n = self.setup.num_clients
        return {"params": clone(params), "models": {}, "similarity": torch.eye(n, dtype=torch.float64)}

    def stored_model(self, server: dict, cid: int) -> Params:
        return server["models"].get(cid, server["params"])

    # --- round -------------------------------------------------------------------------------

    def broadcast(self, rnd: int, server: dict, cids: list[int]) -> dict[int, Message]:
        if self.warming_up(rnd):
            return {cid: {"params": server["params"]} for cid in cids}
        return {cid: {"params": self.download(server, cid)} for cid in cids}

    def download(self, server: dict, cid: int) -> Params:
        """The client's own model with the body of (2); unchanged without a similar client."""
        own = self.stored_model(server, cid)
        if float(server["similarity"][cid].sum()) <= 1:
            return own
        bodies = [select(self.stored_model(server, j), "body") for j in range(self.setup.num_clients)]
        return merge(own, personalised_body(bodies, aggregation_weights(server["similarity"], cid)))

    def client_update(self, rnd: int, cid: int, client: Any, message: Message, data: ClientData) -> ClientUpdate:
        params = yield Fit(message["params"])
        return client, {"params": params, "weight": data.n_train}

    def aggregate(self, rnd: int, server: dict, replies: dict[int, Message]) -> dict[str, Any]:
        if not replies:
            return server
        if self.warming_up(rnd):
            return {**server, "params": fedavg_aggregate(replies)}
        models = {**server["models"], **{cid: reply["params"] for cid, reply in replies.items()}}
        similarity = self.updated_similarity(server["similarity"], models, sorted(replies))
        self.record(rnd, "pfedsim_similarity", similarity.numpy().copy())
        return {**server, "models": models, "similarity": similarity}

    def updated_similarity(self, similarity: torch.Tensor, models: dict[int, Params], cids: list[int]) -> torch.Tensor:
        """(1) for every pair of this round's participants; other entries keep their last value."""
        name, updated = self.classifier_weight(), similarity.clone()
        for k, i in enumerate(cids):
            for j in cids[k + 1:]:
                updated[i, j] = updated[j, i] = classifier_similarity(models[i][name], models[j][name])
        return updated

    def client_model(self, cid: int, server: dict, client: Any) -> Params:
        return self.stored_model(server, cid)

