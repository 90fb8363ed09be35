"""pFedHN (Shamsian, Navon, Fetaya, Chechik, *Personalized Federated Learning using
Hypernetworks*, ICML 2021): a hypernetwork on the server generates each client's whole model.

The hypernetwork h(v_i; phi) maps client i's learned embedding v_i in R^e to its model theta_i:
an MLP v -> Linear(e, H) -> [ReLU -> Linear(H, H)] x `hidden_layers` (the feature, no ReLU
after the last layer), then one linear output head per target tensor, reshaped:
theta_i[t] = reshape(W_t MLP(v_i) + b_t) [code: `CNNHyper`]. phi = (MLP, heads); the embeddings
are rows of one table, trained with phi.

Round t (participants P_t):
  1. the server sends theta_i = h(v_i; phi) to each participant;
  2. client i trains theta_i for k = `inner_steps` mini-batches -> theta~_i and uploads
     Delta theta_i = theta_i - theta~_i [code: `inner_state - final_state`];
  3. the server updates phi and the embeddings by the chain rule, the vector-Jacobian product
        g_i = (d theta_i / d (phi, v))^T Delta theta_i                                (eq. 4)
     (the gradient of 1/2 ||h(v_i; phi) - theta~_i||^2 at the phi that generated theta_i),
     clipped to norm `max_grad_norm`, followed by an SGD step with momentum and weight decay
     on every hypernetwork tensor (the whole embedding table included) [code]. With several
     participants: one step per participant in client order, each VJP at the current phi
     (`server_steps="per_client"`, the paper's one-client-per-step algorithm in sequence), or one
     step with the mean of the VJPs at phi^t (`"mean"`).

Server state: the hypernetwork and its SGD momentum. Client state: none. Evaluated model: the
generated model h(v_i; phi) after the round's update (what the client would download next;
`evaluated_model = "custom"`). A client that never trained gets the model of its untrained
embedding. Communication: the whole model down, Delta theta up.
pFedHN-PC (`personal_head`): the hypernetwork generates the body only; the client trains the
generated body with its own head (kept as its state, never sent), uploads the body's Delta, and
is evaluated with the generated body and its head.
Size: with the paper's H = 100, the output heads hold (H + 1) x |theta| numbers: ~1.5M for the
digits MLP, ~58.8M (235 MB, as much again for the momentum) for FedAvgCNN on MNIST (582,026).
"""
from __future__ import annotations

import math
from typing import Any, Literal

import torch
import torch.nn.functional as F
from pydantic import Field

from pfedkit.algorithms.creff import fresh_linear
from pfedkit.algorithms.registry import register
from pfedkit.core.contract import Algorithm, ClientData, ClientUpdate, Fit, HyperParams, Message
from pfedkit.core.params import Params, clone, merge, select
from pfedkit.core.search import float_range, int_range
from pfedkit.core.sgd import clip_by_total_norm, sgd_momentum_step
from pfedkit.core.seeds import SERVER, torch_generator



# ---------------------------------------------------------------------------------------------
# The hypernetwork (pure functions on plain tensors)


def init_hypernetwork(num_clients: int, embed_dim: int, hidden_dim: int, hidden_layers: int,
                      targets: dict[str, torch.Size], generator: torch.Generator) -> Params:
    """phi and the embedding table, drawn from `generator`: embeddings ~ N(0, 1) (nn.Embedding's),
    every Linear PyTorch's default U(-1/sqrt(fan_in), 1/sqrt(fan_in))."""
    hn = {"embeddings": torch.randn(num_clients, embed_dim, generator=generator)}
    sizes = [embed_dim] + [hidden_dim] * (hidden_layers + 1)
    for k, (fan_in, fan_out) in enumerate(zip(sizes, sizes[1:])):
        hn[f"mlp.{k}.weight"], hn[f"mlp.{k}.bias"] = fresh_linear(fan_in, fan_out, generator)
    for name, shape in targets.items():
        hn[f"out.{name}.weight"], hn[f"out.{name}.bias"] = fresh_linear(hidden_dim, math.prod(shape), generator)
    return hn


def hypernetwork_feature(hn: Params, embedding: torch.Tensor) -> torch.Tensor:
    """MLP(v): Linear layers with a ReLU between consecutive ones (none after the last) [code]."""
    layers = sum(1 for name in hn if name.startswith("mlp.") and name.endswith(".weight"))
    feature = embedding
    for k in range(layers):
        feature = F.linear(feature, hn[f"mlp.{k}.weight"], hn[f"mlp.{k}.bias"])
        if k < layers - 1:
            feature = torch.relu(feature)
    return feature


def generate_model(hn: Params, cid: int, targets: dict[str, torch.Size]) -> Params:
    """theta_i = h(v_i; phi): theta_i[t] = reshape(W_t MLP(v_i) + b_t) for every target tensor t. Reads only row
    cid of the embedding table: another client's embedding never changes client cid's model."""
    feature = hypernetwork_feature(hn, hn["embeddings"][cid])
    return {name: F.linear(feature, hn[f"out.{name}.weight"], hn[f"out.{name}.bias"]).reshape(shape)
            for name, shape in targets.items()}


def hypernetwork_gradient(hn: Params, cid: int, delta: Params, targets: dict[str, torch.Size]) -> Params:
    """Eq. (4): g = (d theta_cid / d hn)^T Delta theta_cid (a vector-Jacobian product), every
    hypernetwork tensor's entry (zeros where theta_cid does not depend on it)."""
    live = {name: value.detach().requires_grad_(True) for name, value in hn.items()}
    model = generate_model(live, cid, targets)
    grads = torch.autograd.grad([model[name] for name in targets], list(live.values()),
                                grad_outputs=[delta[name].to(model[name].dtype) for name in targets], allow_unused=True)
    return {name: torch.zeros_like(value) if grad is None else grad
            for (name, value), grad in zip(hn.items(), grads)}


# ---------------------------------------------------------------------------------------------
# The algorithm


@register
class PFedHN(Algorithm):
    name = "pfedhn"
    description = "pFedHN: a server hypernetwork generates each client's model from a learned client embedding"
    evaluated_model = "custom"  # the model the hypernetwork generates for the client
    quick_test_options = {"inner_steps": 2}

    class Hyper(HyperParams):
        """pFedHN options (defaults: the pFedHN code's `experiments/pfedhn/trainer.py` [code]).

        inner_steps: k, mini-batches of local training per round (50) [code]; the run's lr,
            momentum, weight_decay and grad_clip apply (the code's inner SGD: 5e-3, 0.9, 5e-5, 50).
        embed_dim: e (None: int(1 + N/4)) [code]; hidden_dim H (100), hidden_layers (3) [code].
        hn_lr / hn_momentum / hn_weight_decay: the hypernetwork's SGD (1e-2, 0.9, 1e-3) [code];
        max_grad_norm: clip of each update's gradient norm (50) [code].
        server_steps: "per_client" (one step per participant, client order) [ours: the paper's
            one client per step, in sequence]; "mean" (one step with the mean VJP) [ours].
        personal_head: pFedHN-PC [paper, code: `experiments/pfedhn_pc`]: the hypernetwork
            generates the body only; each client keeps its head, trained with the body.
        """
        inner_steps: int = Field(50, ge=1, description="k: local mini-batches per round",
                                 json_schema_extra=int_range(5, 100, log=True))
        embed_dim: int | None = Field(None, ge=1, description="client embedding size (None: int(1 + N/4))")
        hidden_dim: int = Field(100, ge=1, description="hypernetwork hidden width")
        hidden_layers: int = Field(3, ge=0, description="hidden Linear layers after the first one")
        hn_lr: float = Field(1e-2, gt=0, description="SGD learning rate of the hypernetwork",
                             json_schema_extra=float_range(1e-3, 1e-1, log=True))
        hn_momentum: float = Field(0.9, ge=0, lt=1, description="SGD momentum of the hypernetwork")
        hn_weight_decay: float = Field(1e-3, ge=0, description="SGD weight decay of the hypernetwork")
        max_grad_norm: float = Field(50.0, gt=0, description="clip of each hypernetwork update's gradient norm")
        server_steps: Literal["per_client", "mean"] = Field(
            "per_client", description="one hypernetwork step per participant, or one with the mean gradient")
        personal_head: bool = Field(False, description="pFedHN-PC: generate the body only; each client keeps its own head")

    def __init__(self, hyper: HyperParams, setup) -> None:
        super().__init__(hyper, setup)
        params = setup.ops.initial_params()
        generated = select(params, "body") if hyper.personal_head else params
        self.targets = {name: value.shape for name, value in generated.items()}

    @property
    def embed_dim(self) -> int:
        return self.hyper.embed_dim or int(1 + self.setup.num_clients / 4)

    def init_server(self, params: Params) -> dict[str, Any]:
        h = self.hyper
        hn = init_hypernetwork(self.setup.num_clients, self.embed_dim, h.hidden_dim, h.hidden_layers, self.targets,
                               torch_generator(self.setup.seed, 0, SERVER, "pfedhn-init"))
        momentum = {name: torch.zeros_like(value) for name, value in hn.items()} if h.hn_momentum else {}
        return {"hn": hn, "momentum": momentum}

    def init_client(self, cid: int, params: Params) -> dict[str, Params] | None:
        """pFedHN-PC: the client's own head, from the initial model; else nothing."""
        return {"head": clone(select(params, "head"))} if self.hyper.personal_head else None

    def broadcast(self, rnd: int, server: dict, cids: list[int]) -> dict[int, Message]:
        return {cid: {"params": self.generated(cid, server)} for cid in cids}

    def client_update(self, rnd: int, cid: int, client: Any, message: Message, data: ClientData) -> ClientUpdate:
        """k local steps from the generated model (with its own head, pFedHN-PC); upload
        Delta theta = theta - theta~ of the generated tensors."""
        received = message["params"]
        trained = yield Fit(self.with_own_head(received, client), steps=self.hyper.inner_steps)
        if self.hyper.personal_head:
            client = {"head": select(trained, "head")}
        return client, {"delta": {name: received[name] - trained[name] for name in received}}

    def aggregate(self, rnd: int, server: dict, replies: dict[int, Message]) -> dict[str, Any]:
        """Eq. (4) and the hypernetwork's SGD steps (module docstring)."""
        if not replies:
            return server
        hn, buffers = server["hn"], server["momentum"]
        ordered = sorted(replies)
        if self.hyper.server_steps == "mean":
            total = {name: torch.zeros_like(value) for name, value in hn.items()}  # a running sum: one copy of phi
            for cid in ordered:
                for name, grad in hypernetwork_gradient(hn, cid, replies[cid]["delta"], self.targets).items():
                    total[name] += grad
            hn, buffers = self.step(hn, {name: value / len(ordered) for name, value in total.items()}, buffers)
        else:
            for cid in ordered:
                hn, buffers = self.step(hn, hypernetwork_gradient(hn, cid, replies[cid]["delta"], self.targets), buffers)
        self.record(rnd, "mean_update_norm", float(torch.stack([
            torch.linalg.vector_norm(torch.cat([d.reshape(-1) for d in replies[cid]["delta"].values()]))
            for cid in ordered]).mean()))
        return {"hn": hn, "momentum": buffers}

    def step(self, hn: Params, grads: Params, buffers: Params) -> tuple[Params, Params]:
        h = self.hyper
        return sgd_momentum_step(hn, clip_by_total_norm(grads, h.max_grad_norm), buffers, lr=h.hn_lr,
                                 momentum=h.hn_momentum, weight_decay=h.hn_weight_decay)

    def generated(self, cid: int, server: dict) -> Params:
        """h(v_cid; phi), from the current hypernetwork."""
        with torch.no_grad():
            return generate_model(server["hn"], cid, self.targets)

    def with_own_head(self, generated: Params, client: Any) -> Params:
        return merge(generated, client["head"]) if self.hyper.personal_head else generated

    def client_model(self, cid: int, server: dict, client: Any) -> Params:
        """h(v_cid; phi), with the client's own head in pFedHN-PC."""
        return self.with_own_head(self.generated(cid, server), client)
