"""FedGH (Yi, Wang, Liu, Shi, Yu, *FedGH: Heterogeneous Federated Learning with Generalized Global
Header*, ACM MM 2023; baselines.md "FedGH").

Each client keeps its whole model; only the head (the last Linear, d -> C) is global. Round:
the client replaces its head with the received global head, trains the whole model E epochs on
cross-entropy, then computes the mean body output of each class it has (eval mode, its own
BatchNorm statistics) and uploads {class means, their labels}; its body never leaves it. The
server trains the global head on the uploaded (mean, label) pairs with cross-entropy for one
pass of mini-batch SGD (`train_global_head`: batch `server_batch_size`, lr `server_lr`, no
momentum, order from `torch_generator(seed, round, SERVER, "fedgh")`) and broadcasts it.

Clients may use different bodies (config `client_model_options`) as long as every architecture
has the same head (names and shapes, hence the same feature size d): only d-dimensional
features and the head travel (`check`). Evaluated: own body + global head.
Paper-vs-code table: docs/algorithms/fedgh.md.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from pydantic import Field
from torch.func import functional_call

from pfedkit.algorithms.prototypes import present_class_means
from pfedkit.algorithms.registry import register
from pfedkit.core.batches import batch_order
from pfedkit.core.contract import Algorithm, ClientData, ClientUpdate, Fit, HyperParams, Message
from pfedkit.core.errors import ConfigError
from pfedkit.core.params import Params, clone, merge, select, unprefixed
from pfedkit.core.seeds import SERVER, torch_generator

FEATURE_CHUNK = 512  # samples per forward when computing class means (memory bound only)


# ---------------------------------------------------------------------------------------------
# The math (pure functions)


def train_global_head(head_module: torch.nn.Module, head: Params, features: torch.Tensor, labels: torch.Tensor, *,
                      lr: float, batch_size: int, generator: torch.Generator) -> Params:
    """One pass of plain SGD on mean CE(g(features[b]), labels[b]) over shuffled mini-batches
    (`batch_order`, last batch possibly smaller): phi <- phi - lr * grad, per batch.

    head_module: the architecture of the head (its own parameters are not used); head: its
    parameters by model name (`head.*`). Returns the new head (same names)."""
    live = {name: value.detach().clone().requires_grad_(True) for name, value in head.items()}
    features, labels = features.detach(), labels.detach()
    for batch in batch_order(len(labels), batch_size, False, generator):
        logits = functional_call(head_module, unprefixed(live, "head"), (features[batch],))
        loss = F.cross_entropy(logits, labels[batch])
        grads = torch.autograd.grad(loss, list(live.values()))
        with torch.no_grad():
            for value, grad in zip(live.values(), grads):
                value.sub_(lr * grad)
    return {name: value.detach() for name, value in live.items()}


# ---------------------------------------------------------------------------------------------
# The algorithm


@register
class FedGH(Algorithm):
    name = "fedgh"
    description = "FedGH: private bodies, a global head trained by the server on uploaded class-mean features"
    evaluated_model = "custom"  # own body + the head the server trained
    head = "last"
    supports_heterogeneous_models = True  # only class-mean features and the head travel

    class Hyper(HyperParams):
        """server_batch_size: the paper/PFLlib use the run's batch size, which algorithms cannot read;
        default 10 [ours] (PFLlib's default batch size). Set it to the config's batch_size to match."""
        server_lr: float = Field(1.0, gt=0, description="SGD learning rate of the server's head training "
                                 "(PFLlib's default 1.0)")
        server_batch_size: int = Field(10, ge=1, description="mini-batch size of the server's head training "
                                       "(the paper uses the clients' batch size; set it to match)")

    def check(self) -> None:
        """Every client's head must be the default architecture's head (names and shapes)."""
        def shapes(ops) -> dict[str, tuple[int, ...]]:
            return {name: tuple(value.shape) for name, value in ops.template.head.named_parameters(prefix="head")}

        reference = shapes(self.setup.ops)
        odd = [cid for cid in range(self.setup.num_clients)
               if self.setup.ops_for(cid) is not self.setup.ops and shapes(self.setup.ops_for(cid)) != reference]
        if odd:
            raise ConfigError(
                f"client_model_options: fedgh shares one head, so every client's model needs the head of "
                f"model_options' model ({reference}); clients {odd[:5]} differ; give them the same feature "
                f"size and number of classes")

    def init_server(self, params: Params) -> dict[str, Any]:
        return {"head": clone(select(params, "head"))}

    def init_client(self, cid: int, params: Params) -> dict[str, Any]:
        """The client's whole model: its body never leaves it."""
        return {"params": clone(params)}

    def broadcast(self, rnd: int, server: dict, cids: list[int]) -> dict[int, Message]:
        return {cid: {"head": server["head"]} for cid in cids}

    def client_update(self, rnd: int, cid: int, client: dict, message: Message, data: ClientData) -> ClientUpdate:
        params = yield Fit(merge(client["params"], message["head"]))
        ops = self.setup.ops_for(cid)
        features = ops.features(params, data.x_train, data.buffers, chunk=FEATURE_CHUNK).reshape(data.n_train, -1)
        classes, means, _ = present_class_means(features, data.y_train, self.setup.num_classes)
        return {"params": params}, {"features": means.float(), "classes": classes}

    def aggregate(self, rnd: int, server: dict, replies: dict[int, Message]) -> dict[str, Any]:
        if not replies:
            return server
        ordered = sorted(replies)
        features = torch.cat([replies[c]["features"] for c in ordered])
        labels = torch.cat([replies[c]["classes"] for c in ordered])
        head = train_global_head(self.setup.ops.template.head, server["head"], features, labels,
                                 lr=self.hyper.server_lr, batch_size=self.hyper.server_batch_size,
                                 generator=torch_generator(self.setup.seed, rnd, SERVER, "fedgh"))
        return {"head": head}

    def client_model(self, cid: int, server: dict, client: dict) -> Params:
        """Own body + global head."""
        return merge(select(client["params"], "body"), server["head"])
