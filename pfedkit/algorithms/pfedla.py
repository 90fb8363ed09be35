"""pFedLA (Ma, Zhang, Guo, Xu, *Layer-wised Model Aggregation for Personalized Federated
Learning*, CVPR 2022): a hypernetwork per client on the server learns layer-wise weights with
which the client's personalised model mixes every client's model.

Server state: every client's model theta_j (all start from the initial model) and, per client i,
a hypernetwork HN_i(v_i; phi_i): the embedding v_i in R^e -> [Linear -> ReLU] x `hidden_layers`
(H wide; a ReLU after the last one too [code]) -> feature f_i, then one linear output per layer
l: r_i^l = ReLU(W_i^l f_i + b_i^l) in R^N, normalised (`normalisation`):

    alpha_i^l = r_i^l / sum_j r_ij^l    (`relu` [code]; all zero -> one-hot on i [code: FL-bench])
    alpha_i^l = softmax(W_i^l f_i + b_i^l)                    (`softmax` [ours])            (eq. 1)

so sum_j alpha_ij^l = 1 and alpha_ij^l >= 0. The personalised model, layer by layer:

    theta_bar_i^l = sum_j alpha_ij^l theta_j^l                                               (eq. 2)

Round t (participants P_t, all from the state at the round's start):
  1. the server sends theta_bar_i to each participant;
  2. client i trains it (the run's local epochs) to theta~_i and uploads
     Delta theta_i = theta~_i - theta_bar_i;
  3. the server updates (phi_i, v_i) by the chain rule, a vector-Jacobian product through eq. 2
     and eq. 1, with plain SGD:
        (phi_i, v_i) <- (phi_i, v_i) - eta * (d theta_bar_i / d(phi_i, v_i))^T (-Delta theta_i)   (eq. 3)
     (the step that moves theta_bar_i towards theta~_i: `update_direction="towards_trained"`;
     the pFedLA code and FL-bench use +Delta theta_i: `"fl_bench"`), and stores
        theta_i <- theta_bar_i + Delta theta_i = theta~_i                                      (eq. 4)
     (the other clients' stored models and hypernetworks are unchanged).

Hypernetworks are independent per client, so a round's steps do not depend on their order.
Evaluated model: theta_bar_i from the state after the round (what the client would download
next; `evaluated_model = "custom"`). Communication: theta_bar_i down, Delta theta_i up.
Layers: parameters sharing a module ("body.conv1.weight" and ".bias") share alpha
(`granularity="layer"` [paper: layer-wise]), or one alpha per tensor (`"tensor"` [code: FL-bench]).
"""
from __future__ import annotations

from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field

from pfedkit.algorithms.creff import fresh_linear
from pfedkit.algorithms.registry import register
from pfedkit.core.contract import Algorithm, ClientData, ClientUpdate, Fit, HyperParams, Message
from pfedkit.core.params import Params
from pfedkit.core.search import float_range
from pfedkit.core.seeds import SERVER, torch_generator

# ---------------------------------------------------------------------------------------------
# Layers, hypernetworks and the personalised model (pure functions on plain tensors)


def layer_groups(names: list[str], granularity: str) -> dict[str, list[str]]:
    """{layer: its parameter names}, in model order: a module's tensors together ("layer"), or
    one group per tensor ("tensor")."""
    groups: dict[str, list[str]] = {}
    for name in names:
        groups.setdefault(name.rsplit(".", 1)[0] if granularity == "layer" else name, []).append(name)
    return groups


def init_hypernetworks(num_clients: int, embed_dim: int, hidden_dim: int, hidden_layers: int,
                       layers: list[str], generator: torch.Generator) -> Params:
    """Every client's hypernetwork, stacked on a leading client axis: embeddings ~ N(0, 1), MLP
    Linears PyTorch's default, output Linears W ~ U(0, 1), b = 0 [code: so that the ReLU outputs
    start positive, hence alpha near uniform]."""
    hn = {"embeddings": torch.randn(num_clients, embed_dim, generator=generator)}
    sizes = [embed_dim] + [hidden_dim] * hidden_layers
    for k, (fan_in, fan_out) in enumerate(zip(sizes, sizes[1:])):
        pairs = [fresh_linear(fan_in, fan_out, generator) for _ in range(num_clients)]
        hn[f"mlp.{k}.weight"] = torch.stack([w for w, _ in pairs])
        hn[f"mlp.{k}.bias"] = torch.stack([b for _, b in pairs])
    for layer in layers:
        hn[f"out.{layer}.weight"] = torch.rand(num_clients, num_clients, sizes[-1], generator=generator)
        hn[f"out.{layer}.bias"] = torch.zeros(num_clients, num_clients)
    return hn


def client_hypernetwork(hns: Params, cid: int) -> Params:
    """Client cid's hypernetwork (its rows of the stacked tensors)."""
    return {name: value[cid] for name, value in hns.items()}


def aggregation_weights(hn: Params, cid: int, layers: list[str], normalisation: str) -> dict[str, torch.Tensor]:
    """Eq. (1): alpha_cid^l in R^N for every layer l, from client cid's own hypernetwork `hn`."""
    feature = hn["embeddings"]
    depth = sum(1 for name in hn if name.startswith("mlp.") and name.endswith(".weight"))
    for k in range(depth):
        feature = torch.relu(F.linear(feature, hn[f"mlp.{k}.weight"], hn[f"mlp.{k}.bias"]))
    alpha = {}
    for layer in layers:
        scores = F.linear(feature, hn[f"out.{layer}.weight"], hn[f"out.{layer}.bias"])
        alpha[layer] = torch.softmax(scores, dim=0) if normalisation == "softmax" else relu_normalised(scores, cid)
    return alpha


def relu_normalised(scores: torch.Tensor, cid: int) -> torch.Tensor:
    """r / sum(r) with r = ReLU(scores); all zero: the client's own model alone (one-hot on cid)."""
    r = torch.relu(scores)
    total = r.sum()
    if float(total.detach()) == 0.0:
        return F.one_hot(torch.tensor(cid), r.numel()).to(r.dtype)
    return r / total


def personalised_model(alpha: dict[str, torch.Tensor], models: Params, groups: dict[str, list[str]]) -> Params:
    """Eq. (2): theta_bar^l = sum_j alpha_j^l theta_j^l (models stacked on a leading client axis)."""
    return {name: torch.tensordot(alpha[layer], models[name], dims=1)
            for layer, names in groups.items() for name in names}


# ---------------------------------------------------------------------------------------------
# The algorithm


@register
class PFedLA(Algorithm):
    name = "pfedla"
    description = "pFedLA: per-client server hypernetworks learn layer-wise weights mixing every client's model"
    evaluated_model = "custom"  # theta_bar_i, the hypernetwork's mixture

    class Hyper(HyperParams):
        """pFedLA options (defaults: the pFedLA code [code: KarhouTam/pFedLA], as FL-bench).

        embed_dim, hidden_dim: e, H (100, 100) [code]; hidden_layers: Linear-ReLU blocks (3) [code].
        hn_lr: eta, plain SGD on each hypernetwork and embedding (5e-3) [code].
        normalisation: "relu" (ReLU, divided by the sum) [code] or "softmax" [ours].
        granularity: one alpha per "layer" (module) [paper] or per "tensor" [code: FL-bench].
        update_direction: "towards_trained" (the chain-rule descent step) [ours] or "fl_bench"
            (the sign of the pFedLA code and FL-bench, which moves theta_bar away from theta~).
        """
        embed_dim: int = Field(100, ge=1, description="client embedding size")
        hidden_dim: int = Field(100, ge=1, description="hypernetwork hidden width")
        hidden_layers: int = Field(3, ge=1, description="Linear-ReLU blocks of the hypernetwork's MLP")
        hn_lr: float = Field(5e-3, ge=0, description="SGD learning rate of each client's hypernetwork",
                             json_schema_extra=float_range(1e-3, 1.0, log=True))
        normalisation: Literal["relu", "softmax"] = Field(
            "relu", description="alpha: ReLU then divided by the sum, or softmax")
        granularity: Literal["layer", "tensor"] = Field(
            "layer", description="one aggregation weight per layer (module) or per parameter tensor")
        update_direction: Literal["towards_trained", "fl_bench"] = Field(
            "towards_trained", description="hypernetwork step along +J^T Delta (towards the trained model) or -J^T Delta (the codes')")

    def __init__(self, hyper: HyperParams, setup) -> None:
        super().__init__(hyper, setup)
        self.groups = layer_groups(list(setup.ops.initial_params()), hyper.granularity)

    def init_server(self, params: Params) -> dict[str, Any]:
        h, n = self.hyper, self.setup.num_clients
        hn = init_hypernetworks(n, h.embed_dim, h.hidden_dim, h.hidden_layers, list(self.groups),
                                torch_generator(self.setup.seed, 0, SERVER, "pfedla-init"))
        models = {name: value.detach().unsqueeze(0).repeat(n, *([1] * value.dim())) for name, value in params.items()}
        return {"hn": hn, "models": models}

    def personalised(self, cid: int, hns: Params, models: Params) -> Params:
        alpha = aggregation_weights(client_hypernetwork(hns, cid), cid, list(self.groups), self.hyper.normalisation)
        return personalised_model(alpha, models, self.groups)

    def broadcast(self, rnd: int, server: dict, cids: list[int]) -> dict[int, Message]:
        return {cid: {"params": self.client_model(cid, server, None)} for cid in cids}

    def client_update(self, rnd: int, cid: int, client: Any, message: Message, data: ClientData) -> ClientUpdate:
        """Train theta_bar_i; upload Delta theta_i = theta~_i - theta_bar_i."""
        received = message["params"]
        trained = yield Fit(received)
        return client, {"delta": {name: trained[name] - received[name] for name in received}}

    def aggregate(self, rnd: int, server: dict, replies: dict[int, Message]) -> dict[str, Any]:
        """Eq. (3) for each participant's hypernetwork, eq. (4) for its stored model."""
        hns, models = server["hn"], server["models"]
        new_hns = {name: value.clone() for name, value in hns.items()}
        new_models = {name: value.clone() for name, value in models.items()}
        for cid in sorted(replies):
            delta = replies[cid]["delta"]
            mixed, grads = self.hypernetwork_gradient(cid, hns, models, delta)
            for name, grad in grads.items():
                new_hns[name][cid] = hns[name][cid] - self.hyper.hn_lr * grad
            for name, value in mixed.items():
                new_models[name][cid] = value + delta[name]
        self.record_weights(rnd, new_hns)
        return {"hn": new_hns, "models": new_models}

    def hypernetwork_gradient(self, cid: int, hns: Params, models: Params, delta: Params) -> tuple[Params, Params]:
        """(theta_bar_cid, g): g = (d theta_bar_cid / d hn_cid)^T (-Delta) (towards_trained) or
        (...)^T Delta (fl_bench), every tensor of client cid's hypernetwork."""
        live = {name: value.detach().requires_grad_(True) for name, value in client_hypernetwork(hns, cid).items()}
        alpha = aggregation_weights(live, cid, list(self.groups), self.hyper.normalisation)
        mixed = personalised_model(alpha, models, self.groups)
        sign = -1.0 if self.hyper.update_direction == "towards_trained" else 1.0
        grads = torch.autograd.grad([mixed[name] for name in mixed], list(live.values()),
                                    grad_outputs=[sign * delta[name].to(mixed[name].dtype) for name in mixed],
                                    allow_unused=True)
        return ({name: value.detach() for name, value in mixed.items()},
                {name: torch.zeros_like(value) if grad is None else grad
                 for (name, value), grad in zip(live.items(), grads)})

    def record_weights(self, rnd: int, hns: Params) -> None:
        """Diagnostics: alpha of every client after the update, [N clients, layers, N]."""
        with torch.no_grad():
            alphas = [aggregation_weights(client_hypernetwork(hns, cid), cid, list(self.groups),
                                          self.hyper.normalisation) for cid in range(self.setup.num_clients)]
        self.record(rnd, "aggregation_weights", np.stack([
            np.stack([a[layer].numpy() for layer in self.groups]) for a in alphas]))

    def client_model(self, cid: int, server: dict, client: Any) -> Params:
        """Eq. (2): theta_bar_cid from the current hypernetwork and stored models."""
        with torch.no_grad():
            return self.personalised(cid, server["hn"], server["models"])
