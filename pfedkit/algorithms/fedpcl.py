"""FedPCL (Tan, Long, Ma, Liu, Zhou, Jiang, *Federated Learning from Pre-Trained Models: A
Contrastive Learning Approach*, NeurIPS 2022): prototype-wise contrastive learning.

The paper fuses the outputs of frozen pre-trained backbones with a small learned projection. No
pre-trained backbone is available offline, so pfedkit trains the model's body as that projection
(PFLlib's reading: the body is trained, the head is unused) [ours]. Only prototypes travel:

  r(x) = f(x) / ||f(x)||                                  (the normalised representation)
  C_i^(c) = (1/n_ic) sum_{y=c} r_i(x)                     (eq. 1: local prototype of class c)
  C̄^(c) = (1/|N_c|) sum_{i in N_c} C_i^(c)                 (eq. 2: global prototype; count-weighted
                                                            with `global_weighting="count"`)
  L_G = -(1/B) sum_b log softmax_c( <r_b, C̄^(c)> / tau )[y_b]            (eq. 3, global term)
  L_P = (1/|S|) sum_{j in S} -(1/B) sum_b log softmax_c( <r_b, C_j^(c)> / tau )[y_b]   (eq. 4)
  L = L_G + L_P                                            (eq. 5: the local objective)

where S are the clients whose local prototypes the server holds, each table padded with the
global prototype of a class it lacks. The equations are not retrievable verbatim in this session;
this reading is PFLlib's (`clientpcl.py`) written per class label (see docs/algorithms/fedpcl.md).

Round t:
  1. The server sends the global prototypes and every stored local prototype table (none before
     round 1).
  2. A participant trains its body E epochs on L (eq. 5); with no prototype received yet (round 1)
     it does not train (`Fit(steps=0)`, as PFLlib and the FedPCL code, whose round-1 loss is 0).
  3. It computes its local prototypes (eq. 1, one eval-mode pass over its training data after
     training), keeps them and uploads them with their class counts.
  4. The server stores each participant's latest table; global prototypes are recomputed from the
     stored tables (eq. 2) when it broadcasts.

Evaluated: the client's own model, predicting the class of the nearest prototype,
argmin_c ||r(x) - C_i^(c)||_2 over its own local prototypes (`prediction="local"`: the FedPCL
code's `test_inference_twoway`, PFLlib) or the global ones (`prediction="global"`).
Communication: up k (d + 2) numbers (k owned classes: prototype + count); down the global table
and every stored local table: (#global classes + sum_j #classes of j) * d floats.
"""
from __future__ import annotations

from functools import partial
from typing import Any, Literal

import torch
import torch.nn.functional as F
from pydantic import Field

from pfedkit.algorithms.fedproto import prototype_logits
from pfedkit.algorithms.prototypes import class_means, message_to_table, table_to_message
from pfedkit.algorithms.registry import register
from pfedkit.core.contract import Algorithm, ClientData, ClientUpdate, Fit, Forward, HyperParams, Message
from pfedkit.core.params import Params, clone
from pfedkit.core.search import float_range

FEATURE_CHUNK = 512  # samples per forward when computing local prototypes (memory bound only)
MASKED = -1e9  # score of a class without a prototype: exp underflows to 0, finite so 0 * score stays 0


# ---------------------------------------------------------------------------------------------
# The math (pure functions)


def representations(features: torch.Tensor) -> torch.Tensor:
    """r(x) = f(x) / ||f(x)||_2 per row (the representation every FedPCL term reads)."""
    return F.normalize(features, dim=-1)


def prototype_contrastive_loss(reps: torch.Tensor, labels: torch.Tensor, prototypes: torch.Tensor,
                               present: torch.Tensor, tau: float) -> torch.Tensor:
    """Eq. (3)/(4) for one or several prototype tables:

        -(1/B) sum_b log [ exp(<r_b, P_{y_b}>/tau) / sum_{c present} exp(<r_b, P_c>/tau) ]

    reps [B, d], labels [B], prototypes [C, d] or [S, C, d], present [C] (classes with a
    prototype; absent ones leave the softmax). With S tables: the mean over them of each table's
    loss. A sample whose class has no prototype contributes 0 (and still counts in B).
    Masked sums only (no boolean indexing), so it runs under torch.vmap."""
    tables = prototypes if prototypes.dim() == 3 else prototypes.unsqueeze(0)
    scores = torch.einsum("bd,scd->sbc", reps, tables) / tau
    scores = torch.where(present, scores, torch.full_like(scores, MASKED))
    picked = torch.log_softmax(scores, dim=-1).gather(-1, labels.expand(tables.shape[0], -1).unsqueeze(-1))
    known = present[labels].to(reps.dtype)  # [B]
    per_table = -(picked.squeeze(-1) * known).sum(dim=-1) / max(int(labels.shape[0]), 1)
    return per_table.mean()


def fedpcl_loss(out: Forward, y: torch.Tensor, params: Params, context: dict[str, Any], *, tau: float) -> torch.Tensor:
    """Eq. (5): L_G (the global table) + L_P (the mean over the stored local tables).

    context: "global" [C, d], "locals" [S, C, d] (padded with the global prototype where a table
    lacks a class), "present" [C] (classes with a global prototype). S = 0: L_G only."""
    reps = representations(out.features)
    loss = prototype_contrastive_loss(reps, y, context["global"], context["present"], tau)
    if context["locals"].shape[0]:
        loss = loss + prototype_contrastive_loss(reps, y, context["locals"], context["present"], tau)
    return loss


def global_prototypes(local: torch.Tensor, present: torch.Tensor, weights: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. (2): C̄^(c) = sum_i w_ic C_i^(c) / sum_i w_ic over the tables holding class c.

    local [N, C, d], present [N, C] bool, weights [N, C] (1: plain mean over owners [code];
    n_ic: count-weighted) -> (global [C, d], present [C]). Sums in float64."""
    w = weights.double() * present.double()
    total = w.sum(dim=0)
    sums = torch.einsum("nc,ncd->cd", w, local.double())
    return (sums / total.clamp(min=1e-300).unsqueeze(1)).to(local.dtype), total > 0


def padded_tables(local: torch.Tensor, present: torch.Tensor, global_table: torch.Tensor) -> torch.Tensor:
    """Each local table [S, C, d] with the global prototype in the rows of classes it lacks."""
    return torch.where(present.unsqueeze(-1), local, global_table.unsqueeze(0))


# ---------------------------------------------------------------------------------------------
# The algorithm


@register
class FedPCL(Algorithm):
    name = "fedpcl"
    description = "FedPCL: prototype-wise contrastive learning against global and every client's local prototypes"
    evaluated_model = "custom"  # own model, predicting by the nearest (local) prototype
    head = "last"

    class Hyper(HyperParams):
        """FedPCL options.

        tau: temperature of eqs. (3)-(4); 0.07 [code: FedPCL's ConLoss] (PFLlib's default is 1.0).
        global_weighting: eq. (2)'s average: "uniform" = plain mean over the clients holding the
            class [code: FedPCL `proto_aggregation`, PFLlib]; "count" = weighted by n_ic [ours].
        prediction: "local" = nearest own local prototype [code: FedPCL, PFLlib]; "global" =
            nearest global prototype [ours].
        unseen_clients: the local tables of L_P: "skip" = only clients that uploaded [ours];
            "global" = every client, one that never uploaded counting as the global table [code:
            PFLlib's `prototype_padding`].
        """
        tau: float = Field(0.07, gt=0, description="temperature of the prototype-wise contrastive losses",
                           json_schema_extra=float_range(0.05, 1.0, log=True))
        global_weighting: Literal["uniform", "count"] = Field(
            "uniform", description="global prototype: plain mean over the clients holding the class (code), or "
            "weighted by their class counts")
        prediction: Literal["local", "global"] = Field(
            "local", description="predict by the nearest own local prototype (code) or global prototype")
        unseen_clients: Literal["skip", "global"] = Field(
            "skip", description="local tables of clients that never uploaded: left out of L_P, or counted as the "
            "global table (PFLlib)")

    def __init__(self, hyper: HyperParams, setup) -> None:
        super().__init__(hyper, setup)
        self.feature_dim = int(setup.ops.template.feature_dim)

    # --- state ---------------------------------------------------------------------------------

    def init_server(self, params: Params) -> dict[str, torch.Tensor]:
        """Every client's latest local table [N, C, d], which rows exist, and the class counts."""
        n, c, d = self.setup.num_clients, self.setup.num_classes, self.feature_dim
        return {"prototypes": torch.zeros(n, c, d), "present": torch.zeros(n, c, dtype=torch.bool),
                "counts": torch.zeros(n, c, dtype=torch.int64)}

    def init_client(self, cid: int, params: Params) -> dict[str, torch.Tensor]:
        """The client's own model and its latest local prototypes (none yet)."""
        c, d = self.setup.num_classes, self.feature_dim
        return {"params": clone(params), "prototypes": torch.zeros(c, d), "present": torch.zeros(c, dtype=torch.bool)}

    # --- round ---------------------------------------------------------------------------------

    def global_table(self, server: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Eq. (2) over the stored tables -> (global [C, d], present [C])."""
        weights = (server["counts"] if self.hyper.global_weighting == "count"
                   else torch.ones_like(server["counts"]))
        return global_prototypes(server["prototypes"], server["present"], weights)

    def broadcast(self, rnd: int, server: dict, cids: list[int]) -> dict[int, Message]:
        global_table, global_present = self.global_table(server)
        uploaded = server["present"].any(dim=1)
        locals_ = {int(j): table_to_message(server["prototypes"][j], server["present"][j])
                   for j in uploaded.nonzero().squeeze(1).tolist()}
        down = {"global": table_to_message(global_table, global_present), "locals": locals_}
        return {cid: down for cid in cids}

    def training_context(self, message: Message) -> dict[str, torch.Tensor]:
        """The Fit's context from the download: the global table, the padded local tables of L_P."""
        c, d = self.setup.num_classes, self.feature_dim
        global_table, present = message_to_table(message.get("global", {}), c, d)
        tables = [message_to_table(table, c, d) for _, table in sorted(message.get("locals", {}).items())]
        if self.hyper.unseen_clients == "global":
            tables += [(global_table, present)] * (self.setup.num_clients - len(tables))
        locals_ = (padded_tables(torch.stack([t for t, _ in tables]), torch.stack([p for _, p in tables]), global_table)
                   if tables else torch.zeros(0, c, d))
        return {"global": global_table, "locals": locals_, "present": present}

    def client_update(self, rnd: int, cid: int, client: dict, message: Message, data: ClientData) -> ClientUpdate:
        """Train the body on eq. (5) (no training while no prototype exists), then eq. (1)."""
        context = self.training_context(message)
        if bool(context["present"].any()):
            request = Fit(client["params"], loss=partial(fedpcl_loss, tau=self.hyper.tau), trainable="body",
                          context=context)
        else:
            request = Fit(client["params"], steps=0)  # round 1: nothing to contrast with (PFLlib, FedPCL code)
        params = yield request
        prototypes, counts = self.local_prototypes(params, data)
        present = counts > 0
        reply = {"prototypes": table_to_message(prototypes, present),
                 "counts": {int(c): int(counts[c]) for c in present.nonzero().squeeze(1).tolist()}}
        return {"params": params, "prototypes": prototypes, "present": present}, reply

    def local_prototypes(self, params: Params, data: ClientData) -> tuple[torch.Tensor, torch.Tensor]:
        """Eq. (1) in eval mode with the client's own BatchNorm statistics -> (means [C, d], counts [C])."""
        features = (self.setup.ops_for(data.cid).features(params, data.x_train, data.buffers, chunk=FEATURE_CHUNK)
                    .reshape(data.n_train, -1).float() if data.n_train else torch.zeros(0, self.feature_dim))
        return class_means(representations(features), data.y_train, self.setup.num_classes)

    def aggregate(self, rnd: int, server: dict, replies: dict[int, Message]) -> dict[str, torch.Tensor]:
        """Store each participant's latest local table (the global one is eq. 2 over the stored tables)."""
        if not replies:
            return server
        server = {name: value.clone() for name, value in server.items()}
        for cid in sorted(replies):
            table, present = message_to_table(replies[cid]["prototypes"], self.setup.num_classes, self.feature_dim)
            server["prototypes"][cid], server["present"][cid] = table, present
            server["counts"][cid] = 0
            for label, count in replies[cid]["counts"].items():
                server["counts"][cid, int(label)] = int(count)
        self.record(rnd, "global_classes", int(server["present"].any(dim=0).sum()))
        return server

    # --- evaluation ----------------------------------------------------------------------------

    def client_model(self, cid: int, server: dict, client: dict) -> Params:
        return client["params"]

    def predict(self, cid: int, server: dict, client: dict, features: torch.Tensor) -> torch.Tensor:
        """Nearest prototype to r(x): the client's own local ones ("local"), else (or while it has
        none) the global ones; the head while no prototype exists at all."""
        reps = representations(features.float())
        if self.hyper.prediction == "local" and bool(client["present"].any()):
            return prototype_logits(reps, client["prototypes"], client["present"])
        global_table, present = self.global_table(server)
        if bool(present.any()):
            return prototype_logits(reps, global_table, present)
        return self.setup.ops_for(cid).head_logits(client["params"], features)

    def new_client_refusal(self) -> str:
        return ("models are private and only prototypes travel; a newcomer's untrained body has no local "
                "prototypes and does not produce the representation space the shared ones describe")
