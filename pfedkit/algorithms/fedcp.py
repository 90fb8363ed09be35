"""FedCP (Zhang, Hua, Wang, Song, Xue, Ma, Guan, *FedCP: Separating Feature Information for
Personalized Federated Learning via Conditional Policy*, KDD 2023).

Client i's model: the shared body f, a conditional policy network CPN (shared), a global head
phi_G (shared, frozen during local training) and its own personalised head phi_i (all heads one
Linear layer). For each sample the CPN splits the features h = f(x) element-wise into a
personalised and a global part, conditioned on a client-specific input c_i:

    c_i = normalize(sum_c W_i[c, :])               (the column sums of phi_i's weight, L2-normalised)
    [s_P; s_G] = GumbelSoftmax_tau(ReLU(LN(W_cpn (h ⊙ c_i) + b_cpn)) viewed as [2, d]), over the pair
    logits = phi_i(h ⊙ s_P) + phi_G(h ⊙ s_G)                        (s_P + s_G = 1 element-wise)

and trains body, phi_i and CPN (one SGD step per batch, tau = 1, soft samples) on

    L_i = CE(logits, y) + lam * MMD^2(h, f^0(x))                                    (FedCP loss)

with f^0 the received body (frozen: its features are computed once per request, eval mode, and
read by sample position) and MMD^2 the biased estimate with the kernel
k(a, b) = sum_{s in (10, 15, 20, 50)} exp(-||a - b||^2 / (2 s)) (the authors' `MMD(..., "rbf")`).
It uploads body, CPN and a global-head update a * phi_i + (1 - a) * phi_G (a = `head_upload_share`,
0.5 in the authors' code); the server averages the three (FedAvg, n_i weights; `MeanOfUploads`).
CPN and the frozen global head travel as "fedcp_cpn.*" / "fedcp_head.*" (the CPN as `Fit.extra`,
the global head as request context), initialised from the run's seed / the initial head.

Evaluated: the global body, CPN and global head with the client's own head and c_i, predicting
with the noise-free policy softmax(...) instead of a Gumbel sample (`predict`, [ours]).
Communication: body + CPN + global head down; the same + n_i up. docs/algorithms/fedcp.md.
"""
from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from pydantic import Field

from pfedkit.algorithms.evaluated_head import HeadFromEvaluatedModel
from pfedkit.algorithms.extra_layers import (check_linear_head, head_linear, layer_norm, layer_norm_init, linear,
                                             linear_init, with_prefix)
from pfedkit.algorithms.registry import register
from pfedkit.core.aggregation import MeanOfUploads
from pfedkit.core.contract import Algorithm, ClientData, ClientUpdate, Fit, Forward, HyperParams, Message
from pfedkit.core.params import Params, clone, merge, select
from pfedkit.core.search import float_range
from pfedkit.core.seeds import SERVER, torch_generator

CPN = "fedcp_cpn"            # the policy network: CPN.linear.*, CPN.norm.*
GLOBAL_HEAD = "fedcp_head"   # the global head phi_G: GLOBAL_HEAD.weight, GLOBAL_HEAD.bias
GUMBEL_TAU = 1.0             # the authors' temperature (soft samples)
MMD_BANDWIDTHS = (10.0, 15.0, 20.0, 50.0)
FEATURE_CHUNK = 512          # samples per forward for the reference features (memory bound only)


# ---------------------------------------------------------------------------------------------
# The math (pure functions)


def initial_policy_network(feature_dim: int, generator: torch.Generator) -> Params:
    """CPN: Linear(d, 2d) + LayerNorm(2d), PyTorch's default initial values drawn from `generator`."""
    return {**linear_init(f"{CPN}.linear", feature_dim, 2 * feature_dim, generator),
            **layer_norm_init(f"{CPN}.norm", 2 * feature_dim)}


def conditional_input(head: Params) -> torch.Tensor:
    """c_i = normalize(sum over classes of phi_i's weight rows), [d]."""
    weight, _ = head_linear(head)
    return F.normalize(weight.detach().sum(dim=0), dim=0)


def policy_scores(params: Params, features: torch.Tensor, condition: torch.Tensor) -> torch.Tensor:
    """ReLU(LN(W_cpn (h ⊙ c) + b)) viewed as [B, 2, d]: row 0 scores the personalised part, row 1 the global."""
    scores = F.relu(layer_norm(params, f"{CPN}.norm", linear(params, f"{CPN}.linear", features * condition)))
    return scores.view(features.shape[0], 2, -1)


def separated_logits(features: torch.Tensor, policy: torch.Tensor, personal: Params, global_head: Params) -> torch.Tensor:
    """phi_i(h ⊙ s_P) + phi_G(h ⊙ s_G) for policy [B, 2, d] = [s_P; s_G]."""
    weight, bias = head_linear(personal)
    return (F.linear(features * policy[:, 0], weight, bias)
            + linear(global_head, GLOBAL_HEAD, features * policy[:, 1]))


def rbf_mmd(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Biased MMD^2 estimate mean(K_xx + K_yy - 2 K_xy), k(a, b) = sum_s exp(-||a - b||^2 / (2 s))."""
    def kernel(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        distances = a.pow(2).sum(1)[:, None] + b.pow(2).sum(1)[None, :] - 2.0 * a @ b.T
        return sum(torch.exp(-0.5 * distances / s) for s in MMD_BANDWIDTHS)
    return (kernel(x, x) + kernel(y, y) - 2.0 * kernel(x, y)).mean()


def fedcp_loss(out: Forward, y: torch.Tensor, params: Params, context: Mapping[str, Any], *, lam: float) -> torch.Tensor:
    """The FedCP loss (module docstring). context: "condition" c_i, the frozen global head
    (GLOBAL_HEAD.*), "reference" f^0(x) for every training sample (read at out.index)."""
    scores = policy_scores(params, out.features, context["condition"])
    policy = F.gumbel_softmax(scores, tau=GUMBEL_TAU, hard=False, dim=1)  # torch's generator: seeded per request
    logits = separated_logits(out.features, policy, params, context)
    loss = F.cross_entropy(logits, y)
    if lam:
        loss = loss + lam * rbf_mmd(out.features, context["reference"][out.index])
    return loss


# ---------------------------------------------------------------------------------------------
# The algorithm


@register
class FedCP(HeadFromEvaluatedModel, MeanOfUploads, Algorithm):
    """The server averages body + CPN + global-head uploads (`MeanOfUploads`, key "shared")."""
    name = "fedcp"
    description = "FedCP: a policy network splits each sample's features between a global and a personalised head"
    evaluated_model = "custom"  # global body, CPN and global head + own head, predicting through the policy
    averaged = "shared"

    class Hyper(HyperParams):
        lam: float = Field(5.0, ge=0, description="weight of the MMD between the local and the received body's features",
                           json_schema_extra=float_range(0.1, 10.0, log=True))
        head_upload_share: float = Field(0.5, ge=0, le=1, description="a: the global-head upload is a * own head "
                                         "+ (1 - a) * received global head (the authors' code: 0.5)")

    def check(self) -> None:
        check_linear_head(self.setup, self.name, needs_bias=True)

    def init_server(self, params: Params) -> dict[str, Any]:
        """Global body, the initial head as the global head, a seeded CPN."""
        weight, bias = head_linear(params)
        generator = torch_generator(self.setup.seed, 0, SERVER, "fedcp-init")
        cpn = initial_policy_network(int(self.setup.ops.template.feature_dim), generator)
        head = {f"{GLOBAL_HEAD}.weight": weight, f"{GLOBAL_HEAD}.bias": bias}
        return {"shared": clone(merge(select(params, "body"), head, cpn))}

    def init_client(self, cid: int, params: Params) -> dict[str, Any]:
        return {"head": clone(select(params, "head"))}

    def broadcast(self, rnd: int, server: dict, cids: list[int]) -> dict[int, Message]:
        return {cid: {"params": server["shared"]} for cid in cids}

    def reference_features(self, body: Params, data: ClientData) -> torch.Tensor:
        """f^0(x) of every training sample: the received body, eval mode, the client's BatchNorm statistics."""
        return self.setup.ops.features(body, data.x_train, data.buffers, chunk=FEATURE_CHUNK).reshape(data.n_train, -1)

    def client_update(self, rnd: int, cid: int, client: dict, message: Message, data: ClientData) -> ClientUpdate:
        shared = message["params"]
        body, global_head = select(shared, "body"), with_prefix(shared, GLOBAL_HEAD)
        context = {**global_head, "condition": conditional_input(client["head"]),
                   "reference": self.reference_features(body, data)}
        trained = yield Fit(merge(body, client["head"]), loss=partial(fedcp_loss, lam=self.hyper.lam),
                            context=context, extra=with_prefix(shared, CPN))
        head = select(trained, "head")
        share = self.hyper.head_upload_share
        weight, bias = head_linear(head)
        upload = {f"{GLOBAL_HEAD}.weight": share * weight + (1.0 - share) * global_head[f"{GLOBAL_HEAD}.weight"],
                  f"{GLOBAL_HEAD}.bias": share * bias + (1.0 - share) * global_head[f"{GLOBAL_HEAD}.bias"]}
        uploaded = merge(select(trained, "body"), with_prefix(trained, CPN), upload)
        return {"head": head}, {"params": uploaded, "weight": data.n_train}

    def client_model(self, cid: int, server: dict, client: dict) -> Params:
        """Global body + own head; `predict` adds the policy and the global head."""
        return merge(select(server["shared"], "body"), client["head"])

    def predict(self, cid: int, server: dict, client: dict, features: torch.Tensor) -> torch.Tensor:
        """phi_i(h ⊙ s_P) + phi_G(h ⊙ s_G) with the noise-free policy softmax over the pair."""
        shared = server["shared"]
        policy = torch.softmax(policy_scores(shared, features, conditional_input(client["head"])), dim=1)
        return separated_logits(features, policy, client["head"], shared)
