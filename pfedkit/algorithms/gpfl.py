"""GPFL (Zhang, Hua, Wang, Song, Xue, Ma, Cao, Guan, *GPFL: Simultaneously Learning Global and
Personalized Feature Information for Personalized Federated Learning*, ICCV 2023).

Client i's model: the shared body f, a conditional valve CoV (shared), a global category
embedding layer GCE (shared: one embedding e_c in R^d per class) and its own Linear head. The
valve turns the body's features h = f(x) into two routes with a conditional input c:

    gamma(c) = LN(ReLU(W_g c + b_g)),  beta(c) = LN(ReLU(W_b c + b_b))
    CoV(h, c) = ReLU(h ⊙ (gamma(c) + 1) + beta(c))                                   (CoV)
    f_G = CoV(h, g),  g = (1/C) sum_c e_c        (global guidance route)
    f_P = CoV(h, p_i), p_i = sum_c alpha_ic e_c  (personalised task route, alpha_ic = n_ic / n_i)

trained jointly (body, head, CoV and GCE, one SGD step per batch) on

    L_i = CE(head(f_P), y)                                          (personalised task)
        + CE(cos(f_G, e_.), y)                                      (angle-level guidance, GCE)
        + lam * || f_G - e^0_y ||_F                                 (magnitude-level guidance)
        + (mu/2) (||theta_CoV||^2 + ||theta_GCE||^2)                 (= weight decay mu on CoV and GCE)

with cos(f_G, e_c) the cosine logits (no scale), e^0 the received (frozen) embeddings and the
Frobenius norm taken over the batch's [B, d] difference (the authors' code). g and p_i are read
off the received GCE at the start of the round (`conditional_inputs="received"`), or, as the
authors' code, off the GCE the client trained in its last round ("trained"; zeros before its first
training). The server averages body, CoV and GCE (FedAvg, n_i weights; `MeanOfUploads`); heads
stay private. CoV and GCE travel as `Fit.extra` (named "gpfl_cov.*", "gpfl_gce.embedding"),
initialised from a generator seeded by the run's seed.

Evaluated: prediction head_i(CoV(f(x), p_i)) with the global body, CoV and GCE and the client's
own head (`predict`). Communication: body + CoV + GCE down; the same + n_i up.
Paper-vs-code table: docs/algorithms/gpfl.md.
"""
from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field

from pfedkit.algorithms.evaluated_head import HeadFromEvaluatedModel
from pfedkit.algorithms.extra_layers import (check_linear_head, head_linear, layer_norm, layer_norm_init, linear,
                                             linear_init, with_prefix)
from pfedkit.algorithms.registry import register
from pfedkit.core.aggregation import MeanOfUploads
from pfedkit.core.contract import Algorithm, ClientData, ClientUpdate, Fit, Forward, HyperParams, Message
from pfedkit.core.params import Params, merge, select
from pfedkit.core.search import float_range
from pfedkit.core.seeds import SERVER, torch_generator

COV = "gpfl_cov"                     # prefix of the conditional valve's tensors
GCE = "gpfl_gce.embedding"           # the class embeddings e_c, [C, d]
BRANCHES = ("gamma", "beta")         # the valve's two branches: COV.gamma.linear.*, COV.gamma.norm.*, ...


# ---------------------------------------------------------------------------------------------
# The math (pure functions)


def initial_valve_and_embeddings(feature_dim: int, num_classes: int, generator: torch.Generator) -> Params:
    """CoV (two Linear(d, d) + LayerNorm(d) branches) and the GCE's embeddings, PyTorch's default
    initial values drawn from `generator`."""
    params = {GCE: torch.randn(num_classes, feature_dim, generator=generator)}
    for branch in BRANCHES:
        params.update(linear_init(f"{COV}.{branch}.linear", feature_dim, feature_dim, generator))
        params.update(layer_norm_init(f"{COV}.{branch}.norm", feature_dim))
    return params


def conditional_valve(params: Params, features: torch.Tensor, condition: torch.Tensor) -> torch.Tensor:
    """CoV(h, c) = ReLU(h ⊙ (gamma(c) + 1) + beta(c)), gamma/beta = LN(ReLU(Linear(c)))."""
    gamma, beta = (layer_norm(params, f"{COV}.{b}.norm", F.relu(linear(params, f"{COV}.{b}.linear", condition)))
                   for b in BRANCHES)
    return F.relu(features * (gamma + 1.0) + beta)


def conditional_inputs(embeddings: torch.Tensor, class_counts: np.ndarray | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(g, p_i): the plain mean of the class embeddings and their mean weighted by the client's
    class proportions alpha_ic = n_ic / n_i."""
    counts = torch.as_tensor(np.asarray(class_counts), dtype=embeddings.dtype)
    return embeddings.mean(dim=0), (counts / counts.sum()) @ embeddings


def angle_loss(global_features: torch.Tensor, embeddings: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """CE over the cosine similarities cos(f_G, e_c) (angle-level guidance)."""
    return F.cross_entropy(F.normalize(global_features, dim=1) @ F.normalize(embeddings, dim=1).T, y)


def gpfl_loss(out: Forward, y: torch.Tensor, params: Params, context: Mapping[str, Any], *,
              lam: float, mu: float) -> torch.Tensor:
    """L_i of the module docstring. context: "generic" g, "personal" p_i, "frozen" e^0 [C, d]."""
    personal = conditional_valve(params, out.features, context["personal"])
    generic = conditional_valve(params, out.features, context["generic"])
    weight, bias = head_linear(params)
    embeddings = params[GCE]
    loss = F.cross_entropy(F.linear(personal, weight, bias), y) + angle_loss(generic, embeddings, y)
    loss = loss + lam * torch.linalg.norm(generic - context["frozen"][y])
    if mu:
        penalty = embeddings.pow(2).sum() + sum(value.pow(2).sum() for value in with_prefix(params, COV).values())
        loss = loss + 0.5 * mu * penalty
    return loss


def personal_logits(shared: Params, head: Params, features: torch.Tensor, personal_input: torch.Tensor) -> torch.Tensor:
    """head_i(CoV(h, p_i)): the personalised route, what a GPFL client predicts with."""
    weight, bias = head_linear(head)
    return F.linear(conditional_valve(shared, features, personal_input), weight, bias)


# ---------------------------------------------------------------------------------------------
# The algorithm


@register
class GPFL(HeadFromEvaluatedModel, MeanOfUploads, Algorithm):
    """The server averages body + CoV + GCE (`MeanOfUploads`, key "shared")."""
    name = "gpfl"
    description = "GPFL: conditional valve splits features into a GCE-guided global route and a personalised route"
    evaluated_model = "custom"  # global body, CoV and GCE + own head, predicting through the valve
    averaged = "shared"

    class Hyper(HyperParams):
        lam: float = Field(0.01, ge=0, description="weight of the magnitude-level guidance ||f_G - e_y||",
                           json_schema_extra=float_range(0.0001, 1.0, log=True))
        mu: float = Field(0.1, ge=0, description="L2 regularisation (weight decay) of CoV and GCE",
                          json_schema_extra=float_range(0.001, 1.0, log=True))
        conditional_inputs: Literal["received", "trained"] = Field(
            "received", description="g and p_i from the received GCE, or (the authors' code) from the GCE the "
            "client trained in its last round (zeros before its first)")

    def check(self) -> None:
        check_linear_head(self.setup, self.name)

    def init_server(self, params: Params) -> dict[str, Any]:
        generator = torch_generator(self.setup.seed, 0, SERVER, "gpfl-init")
        extra = initial_valve_and_embeddings(int(self.setup.ops.template.feature_dim), self.setup.num_classes, generator)
        return {"shared": merge(select(params, "body"), extra)}

    def init_client(self, cid: int, params: Params) -> dict[str, Any]:
        state = {"head": {n: v.detach().clone() for n, v in select(params, "head").items()}}
        if self.hyper.conditional_inputs == "trained":
            feature_dim = int(self.setup.ops.template.feature_dim)
            state["inputs"] = {"generic": torch.zeros(feature_dim), "personal": torch.zeros(feature_dim)}
        return state

    def broadcast(self, rnd: int, server: dict, cids: list[int]) -> dict[int, Message]:
        return {cid: {"params": server["shared"]} for cid in cids}

    def inputs(self, cid: int, shared: Params, client: dict) -> dict[str, torch.Tensor]:
        """{"generic": g, "personal": p_i} as `conditional_inputs` says."""
        if self.hyper.conditional_inputs == "trained":
            return client["inputs"]
        generic, personal = conditional_inputs(shared[GCE], self.setup.train_counts[cid])
        return {"generic": generic, "personal": personal}

    def client_update(self, rnd: int, cid: int, client: dict, message: Message, data: ClientData) -> ClientUpdate:
        shared = message["params"]
        body, extra = select(shared, "body"), {n: v for n, v in shared.items() if not n.startswith("body.")}
        context = {**self.inputs(cid, shared, client), "frozen": shared[GCE]}
        trained = yield Fit(merge(body, client["head"]), loss=partial(gpfl_loss, lam=self.hyper.lam, mu=self.hyper.mu),
                            context=context, extra=extra)
        state = {"head": select(trained, "head")}
        if self.hyper.conditional_inputs == "trained":
            generic, personal = conditional_inputs(trained[GCE], data.class_counts)
            state["inputs"] = {"generic": generic, "personal": personal}
        return state, {"params": {name: trained[name] for name in shared}, "weight": data.n_train}

    def client_model(self, cid: int, server: dict, client: dict) -> Params:
        """Global body + own head; `predict` adds the valve between them."""
        return merge(select(server["shared"], "body"), client["head"])

    def predict(self, cid: int, server: dict, client: dict, features: torch.Tensor) -> torch.Tensor:
        personal_input = self.inputs(cid, server["shared"], client)["personal"]
        return personal_logits(server["shared"], client["head"], features, personal_input)
