"""FedAS (Yang, Huang, Ye, *FedAS: Bridging Inconsistency in Personalized Federated Learning*,
CVPR 2024): federated parameter alignment and client synchronisation on a shared body with a
private head.

Round t, participant i, keeping its whole model theta_i = (phi_i body, psi_i head) from its last
training (initially the initial model):
  1. parameter alignment: the client's class prototypes under its own previous body,
        p_c = mean_{x in D_i, y = c} phi_i(x)                          (eval mode)
     then `alignment_epochs` epochs of SGD (lr `alignment_lr`) on the received global body phi^t
     alone, pulling its features to those prototypes:
        "pfllib": L_align = sum_{c in batch} (1 / (n_c d)) sum_{b: y_b = c} ||phi(x_b) - p_c||^2
        "flbench": L_align = sum_{c in batch} (1 / d) ||mean_{b: y_b = c} phi(x_b) - p_c||^2
     the aligned body replaces the client's body, its own head psi_i stays (`private_head=False`:
     the whole model is shared, the client starts from the global head, FL-bench's reading);
  2. E epochs of local training of the whole model (CE);
  3. client synchronisation: the trace of the empirical Fisher information of the trained model
     on its training data, summed over mini-batches of `fisher_batch_size` (a seeded shuffle),
        F_i = sum_batches ||grad_theta mean_b -log p(y_b | x_b)||^2          (eval mode)
     and the upload of the body with F_i;
  4. the server's body = sum_i F_i phi_i / sum_i F_i over the uploads (`aggregation=samples`:
     n_i weights instead, FedPer; `private_head=False`: the whole models).
Evaluated model: the client's own model, as its training returned it. alignment_epochs = 0 with
aggregation=samples is FedPer exactly (tested).

The paper's text was not retrievable here (only its abstract); the steps follow the authors'
released code (xiyuanyang45/FedAS, a PFLlib fork, identical to PFLlib's FedAS), FL-bench's reading
is an option: docs/algorithms/fedas.md.
"""
from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field
from torch.func import functional_call

from pfedkit.algorithms.prototypes import class_means
from pfedkit.algorithms.registry import register
from pfedkit.core.contract import Algorithm, ClientData, ClientUpdate, Fit, Forward, HyperParams, Message
from pfedkit.core.params import Params, clone, merge, select, weighted_mean
from pfedkit.core.search import float_range, int_range
from pfedkit.core.seeds import torch_generator

PROTOTYPES = "prototypes"  # the alignment Fit's context: [C, d] class means under the client's previous body
CHUNK = 1000  # samples per forward when computing prototypes (memory bound only)


# ---------------------------------------------------------------------------------------------
# The math (pure functions)


def alignment_loss(out: Forward, y: torch.Tensor, params: Params, context: Mapping[str, Any], *,
                   kind: str = "pfllib") -> torch.Tensor:
    """L_align of step 1 for the batch (module docstring), prototypes context[PROTOTYPES] [C, d].
    Masked sums over a one-hot class matrix, so it runs under vmap."""
    features, prototypes = out.features, context[PROTOTYPES].to(out.features.dtype)
    members = F.one_hot(y, prototypes.shape[0]).to(features.dtype)  # [B, C]
    counts = members.sum(dim=0)  # n_c in the batch
    dim = features.shape[1]
    if kind == "pfllib":
        errors = (features - prototypes[y]).square().sum(dim=1) / dim  # [B]
        return ((members.t() @ errors) / counts.clamp(min=1)).sum()
    if kind == "flbench":
        means = (members.t() @ features) / counts.clamp(min=1).unsqueeze(1)  # [C, d]
        return ((means - prototypes).square().sum(dim=1) / dim * (counts > 0)).sum()
    raise ValueError(f"alignment_loss kind must be 'pfllib' or 'flbench', got {kind!r}")


def fisher_trace(ops: Any, params: Params, buffers: Params | None, x: torch.Tensor, y: torch.Tensor,
                 batch_size: int, generator: torch.Generator) -> float:
    """F = sum over mini-batches (a shuffle of the samples by `generator`) of ||grad_theta NLL_batch||^2,
    NLL_batch = mean_b -log softmax(z_b)_{y_b}, all parameters, eval mode (float64 sum)."""
    live = {name: value.detach().requires_grad_(True) for name, value in params.items()}
    state = {**live, **(buffers or {})}
    total = torch.zeros((), dtype=torch.float64)
    for rows in torch.randperm(len(y), generator=generator).split(batch_size):
        rows = rows.to(x.device)
        with torch.enable_grad():
            nll = F.cross_entropy(functional_call(ops.template, state, (x[rows],)), y[rows])
            grads = torch.autograd.grad(nll, list(live.values()), allow_unused=True)
        total += sum(g.double().square().sum().cpu() for g in grads if g is not None)
    return float(total)


def synchronised_model(replies: dict[int, Message], weighting: str) -> Params:
    """Step 4: the uploads (bodies, or whole models) weighted by the Fisher traces ("fisher") or by n_i ("samples"), in client
    order. Traces that are all 0 (a model that fits its data exactly) fall back to n_i [ours]."""
    ordered = sorted(replies)
    weights = [float(replies[cid]["fisher" if weighting == "fisher" else "weight"]) for cid in ordered]
    if sum(weights) <= 0:
        weights = [float(replies[cid]["weight"]) for cid in ordered]
    return weighted_mean([replies[cid]["shared"] for cid in ordered], weights)


# ---------------------------------------------------------------------------------------------
# The algorithm


@register
class FedAS(Algorithm):
    name = "fedas"
    description = "FedAS: global body aligned to the client's own prototypes, Fisher-trace-weighted body averaging"
    evaluated_model = "own"  # the client's whole model as its training Fit returned it

    class Hyper(HyperParams):
        """FedAS hyperparameters (docs/algorithms/fedas.md).

        alignment_epochs: epochs of step 1 (0: no alignment), 1 [code: authors, PFLlib, FL-bench].
        alignment_lr: step 1's learning rate, 0.01 [code].
        alignment_loss: "pfllib" (per-sample MSE to the class prototype, summed over the batch's
            classes) [code: authors, PFLlib] or "flbench" (the batch's class means to the prototypes).
        fisher_batch_size: mini-batch size of the Fisher trace, 10 [ours: PFLlib's default batch size;
            the code uses the training batch size].
        aggregation: "fisher" (Fisher-trace weights) [code] or "samples" (n_i: FedPer's mean).
        private_head: True: the head never leaves the client, the server averages bodies [code:
            authors, PFLlib]; False: the whole model is shared, averaged and downloaded, the
            alignment still acting on the body [code: FL-bench].
        """
        alignment_epochs: int = Field(1, ge=0, description="epochs aligning the global body to the own prototypes",
                                      json_schema_extra=int_range(0, 3))
        alignment_lr: float = Field(0.01, gt=0, description="learning rate of the alignment",
                                    json_schema_extra=float_range(0.001, 0.1, log=True))
        alignment_loss: Literal["pfllib", "flbench"] = Field(
            "pfllib", description="MSE of each sample to its class prototype (PFLlib) or of the batch's class means (FL-bench)")
        fisher_batch_size: int = Field(10, ge=1, description="mini-batch size of the Fisher-trace pass")
        aggregation: Literal["fisher", "samples"] = Field(
            "fisher", description="body averaging weights: Fisher traces or n_i")
        private_head: bool = Field(True, description="keep the head on the client (False: share the whole model, FL-bench)")

    @property
    def shared_part(self) -> str:
        """What the server averages and sends: the body, or the whole model (private_head=False)."""
        return "body" if self.hyper.private_head else "all"

    def init_server(self, params: Params) -> dict[str, Any]:
        return {"shared": clone(select(params, self.shared_part))}

    def init_client(self, cid: int, params: Params) -> dict[str, Any]:
        return {"params": clone(params)}

    def broadcast(self, rnd: int, server: dict, cids: list[int]) -> dict[int, Message]:
        return {cid: {"shared": server["shared"]} for cid in cids}

    def client_update(self, rnd: int, cid: int, client: dict, message: Message, data: ClientData) -> ClientUpdate:
        h, own = self.hyper, client["params"]
        start = merge(select(own, "head"), message["shared"])  # the shared head wins where it is shared
        if h.alignment_epochs > 0:
            aligned = yield Fit(start, loss=partial(alignment_loss, kind=h.alignment_loss), trainable="body",
                                context={PROTOTYPES: self.prototypes(cid, own, data)}, epochs=h.alignment_epochs,
                                lr=h.alignment_lr, optimizer="alignment")
            start = merge(start, select(aligned, "body"))  # the aligned body, the head as it started
        trained = yield Fit(start)
        generator = torch_generator(self.setup.seed, rnd, cid, "fedas-fisher")
        fisher = fisher_trace(self.setup.ops_for(cid), trained, data.buffers, data.x_train, data.y_train,
                              h.fisher_batch_size, generator)
        reply = {"shared": select(trained, self.shared_part), "fisher": fisher, "weight": data.n_train}
        return {"params": trained}, reply

    def prototypes(self, cid: int, own: Params, data: ClientData) -> torch.Tensor:
        """p_c of step 1: class means of the client's previous body's features (eval mode) [C, d]."""
        features = self.setup.ops_for(cid).features(own, data.x_train, data.buffers, chunk=CHUNK)
        means, _ = class_means(features.float(), data.y_train, self.setup.num_classes)
        return means

    def aggregate(self, rnd: int, server: dict, replies: dict[int, Message]) -> dict[str, Any]:
        if not replies:
            return server
        traces = np.full(self.setup.num_clients, np.nan)
        for cid, reply in replies.items():
            traces[cid] = reply["fisher"]
        self.record(rnd, "fisher_trace", traces)  # per client, NaN: not a participant
        return {"shared": synchronised_model(replies, self.hyper.aggregation)}

    def client_model(self, cid: int, server: dict, client: dict) -> Params:
        return client["params"]

    def joining_model(self, cid: int, server: dict, client: dict, data: ClientData) -> Params:
        """A newcomer: the global body with its initial head (nothing to align to yet), or the
        global model when the head is shared."""
        return merge(select(client["params"], "head"), server["shared"])
