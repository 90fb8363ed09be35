"""FedDistill / FD (Jeong, Oh, Kim, Park, Bennis, Kim, *Communication-Efficient On-Device Machine
Learning: Federated Distillation and Augmentation under Non-IID Private Data*, arXiv:1811.11479,
NeurIPS 2018 workshop; PFLlib `FD`; spec baselines.md "FedDistill"). The augmentation part (FAug)
is not used.

No weights are shared. Round t:
  1. The server sends the global per-label logit vectors z̄_c it has (none before round 1); with
     `exclude_self` each client gets them without its own contribution, (sum - own) / (count - 1).
  2. A participant trains its own model E epochs on CE(z, y) + lam * KL(softmax(z̄_y) || softmax(z))
     (`distill_loss="kl"`), + lam * CE with the raw z̄_y as soft targets (`"pfllib_ce"`) or + lam *
     the mean squared error between z and z̄_y (`"pfllib_mse"`); samples whose label has no global
     vector contribute 0; the term is averaged over the whole batch.
  3. It computes its per-label mean logits z̄_{i,c} over its training data (one eval-mode pass after
     training; with `upload_logits="training_passes"` the mean of the logits of every training
     forward of the round instead, train mode and weights changing, as PFLlib) and uploads them
     for the classes it owns (the labels are the message's keys).
  4. The server sets z̄_c = plain mean of this round's uploads of class c; a class nobody uploaded
     this round keeps its previous vector.

Client state: its own model. Evaluated: the client's model. Communication: up (#own classes) * C
floats, down (#classes with a vector) * C floats (C * C once all exist). Server state: per class the
sum and number of the vectors behind z̄_c; with `exclude_self` also every client's vectors that are
part of those sums ([N, C, C] floats). Paper-vs-code table: docs/algorithms/feddistill.md.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any, Literal

import torch
import torch.nn.functional as F
from pydantic import Field

from pfedkit.algorithms.prototypes import class_means, means_from_sums, message_to_table, table_to_message
from pfedkit.algorithms.registry import register
from pfedkit.core.contract import (Algorithm, ClientData, ClientUpdate, cross_entropy, Fit, Forward, HyperParams, Message)
from pfedkit.core.errors import ConfigError
from pfedkit.core.params import Params, clone
from pfedkit.core.search import float_range

LOGIT_CHUNK = 512  # samples per forward when computing the mean logits (memory bound only)
# Fit extras carrying the per-class sums of the training forwards' logits (upload_logits="training_passes")
TRAINING_SUMS, TRAINING_COUNTS = "distill_logit_sums", "distill_logit_counts"


# ---------------------------------------------------------------------------------------------
# The math (pure functions)


def distillation_term(logits: torch.Tensor, labels: torch.Tensor, targets: torch.Tensor,
                      has_target: torch.Tensor, kind: str = "kl") -> torch.Tensor:
    """(1/B) sum_{b: z̄_{y_b} exists} d(z̄_{y_b}, z_b) over the batch of B samples, with
        "kl":        d = KL(softmax(z̄_y) || softmax(z)) = sum_k p_k (log p_k - log q_k)
        "pfllib_ce": d = -sum_k z̄_{y,k} log softmax(z)_k  (raw logits as soft targets)
        "pfllib_mse": d = (1/C) sum_k (z_k - z̄_{y,k})^2  (PFLlib's MSELoss over the [B, C] logits)
    targets [C, C] (row c = z̄_c), has_target [C] bool. Masked sums only, so it runs under vmap."""
    selected = has_target[labels].to(logits.dtype)  # [B]
    teacher = targets[labels]  # [B, C]
    log_q = F.log_softmax(logits, dim=1)
    if kind == "kl":
        log_p = F.log_softmax(teacher, dim=1)
        per_sample = (log_p.exp() * (log_p - log_q)).sum(dim=1)
    elif kind == "pfllib_ce":
        per_sample = -(teacher * log_q).sum(dim=1)
    elif kind == "pfllib_mse":
        per_sample = (logits - teacher).square().mean(dim=1)
    else:
        raise ValueError(f"distill_loss must be 'kl', 'pfllib_ce' or 'pfllib_mse', got {kind!r}")
    return (selected * per_sample).sum() / logits.shape[0]


def feddistill_loss(out: Forward, y: torch.Tensor, params: Params, context: Mapping[str, Any], *,
                    lam: float, kind: str = "kl") -> torch.Tensor:
    """CE(z, y) + lam * `distillation_term`; context "targets" [C, C], "has_target" [C].
    lam = 0 is exactly the cross-entropy (Local training)."""
    loss = cross_entropy(out, y, params, context)
    if lam == 0:
        return loss
    return loss + lam * distillation_term(out.logits, y, context["targets"], context["has_target"], kind)


def recording_loss(out: Forward, y: torch.Tensor, params: Params, context: Mapping[str, Any], *,
                   loss_fn: Any) -> torch.Tensor:
    """loss_fn's loss; on the side, adds the batch's logits (detached, float64) to the per-class
    sums and counts carried as the Fit's extras `TRAINING_SUMS` [C, C] and `TRAINING_COUNTS` [C]
    (updated in place: they get no gradient, so SGD leaves them alone)."""
    try:
        params[TRAINING_SUMS].detach().index_add_(0, y, out.logits.detach().to(torch.float64))
        params[TRAINING_COUNTS].detach().index_add_(0, y, torch.ones(len(y), dtype=torch.float64, device=y.device))
    except RuntimeError as err:  # DP-SGD computes the loss per sample under vmap: no side effects there
        if "vmap" not in str(err):
            raise
        raise ConfigError("feddistill.upload_logits=training_passes records the logits of the training forwards, "
                          "which DP-SGD's per-sample gradients (dp.level=sample) do not allow; use "
                          "feddistill.upload_logits=after_training or dp.level=client") from None
    return loss_fn(out, y, params, context)


def training_means(sums: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-class means [C, C] (float32; 0 where a class had no sample) and counts [C] (int64) from
    the training forwards' sums."""
    return means_from_sums(sums, counts).float(), counts.round().to(torch.int64)


def round_sums(uploads: Sequence[Mapping[int, torch.Tensor]], num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per class c: sum of the uploaded z̄_{i,c} (float64 [C, C]) and how many clients uploaded c [C]."""
    sums = torch.zeros(num_classes, num_classes, dtype=torch.float64)
    counts = torch.zeros(num_classes, dtype=torch.int64)
    for upload in uploads:
        for label, vector in upload.items():
            sums[int(label)] += vector.double()
            counts[int(label)] += 1
    return sums, counts


def mean_table(sums: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """z̄_c = sums_c / counts_c (unweighted mean over the owners) -> ([C, C] float32, present [C])."""
    present = counts > 0
    return (sums / counts.clamp(min=1).unsqueeze(1).double()).float() * present.unsqueeze(1), present


def without_own(sums: torch.Tensor, counts: torch.Tensor, own: torch.Tensor,
                own_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The original FD's download for one client: z̄_c^{-i} = (sum_c - z̄_{i,c}) / (count_c - 1) where
    client i is among class c's owners, sums_c / count_c elsewhere; a class whose only owner is i
    has no vector for it. own [C, C], own_mask [C] bool."""
    mine = own_mask.to(torch.int64)
    return mean_table(sums - own.double() * own_mask.unsqueeze(1), counts - mine)


# ---------------------------------------------------------------------------------------------
# The algorithm


@register
class FedDistill(Algorithm):
    name = "feddistill"
    description = "FedDistill (FD): clients share per-label mean logits and distil them into their own models"
    evaluated_model = "own"
    supports_heterogeneous_models = True  # only C-dimensional logit vectors travel

    class Hyper(HyperParams):
        """FedDistill hyperparameters (baselines.md "FedDistill").

        lam: weight of the distillation term, 1.0 [code: PFLlib; spec].
        distill_loss: "kl" = KL(softmax(z̄_y) || softmax(z)) [ours, spec]; "pfllib_ce" = cross-entropy
           with the raw global logits z̄_y as soft targets [code: PFLlib FD since 2025-11; from
           2024-04 it was the KL's gradient];
           "pfllib_mse" = mean squared error to z̄_y [code: PFLlib until 2024-04, the version
           FedReMa's code forks].
        exclude_self: False = every client receives the plain mean over all owners [code: PFLlib];
           True = the mean over the OTHER owners of each class [paper].
        upload_logits: "after_training" = the per-class mean logits of one eval-mode pass over the
           training data after training [ours, paper: the logits of the trained model];
           "training_passes" = the per-class mean of the logits of every training forward of the
           round, all local epochs, train mode, the weights changing between batches [code: PFLlib
           FD, every version].
        """
        lam: float = Field(1.0, ge=0, description="weight of the distillation term",
                           json_schema_extra=float_range(0.1, 10.0, log=True))
        distill_loss: Literal["kl", "pfllib_ce", "pfllib_mse"] = Field(
            "kl", description="KL to softmax(global logits), PFLlib's CE with the raw global logits as targets, "
            "or PFLlib's earlier mean squared error to them")
        exclude_self: bool = Field(False, description="send each client the mean over the other owners of a class")
        upload_logits: Literal["after_training", "training_passes"] = Field(
            "after_training", description="the uploaded per-class mean logits: one eval-mode pass over the "
            "training data after training, or the mean over the round's training forwards (PFLlib)")

    # -- state ---------------------------------------------------------------------------------

    def init_server(self, params: Params) -> dict[str, torch.Tensor]:
        """Per class: sum and number of the vectors behind z̄_c (0: no vector yet); with
        `exclude_self` also each client's vectors inside those sums."""
        c, n = self.setup.num_classes, self.setup.num_clients
        server = {"sums": torch.zeros(c, c, dtype=torch.float64), "counts": torch.zeros(c, dtype=torch.int64)}
        if self.hyper.exclude_self:
            server.update({"own": torch.zeros(n, c, c), "own_mask": torch.zeros(n, c, dtype=torch.bool)})
        return server

    def init_client(self, cid: int, params: Params) -> dict[str, Any]:
        return {"params": clone(params)}

    # -- round ---------------------------------------------------------------------------------

    def global_table(self, server: dict, cid: int) -> tuple[torch.Tensor, torch.Tensor]:
        """What client `cid` receives as ([C, C], present [C])."""
        if self.hyper.exclude_self:
            return without_own(server["sums"], server["counts"], server["own"][cid], server["own_mask"][cid])
        return mean_table(server["sums"], server["counts"])

    def broadcast(self, rnd: int, server: dict, cids: list[int]) -> dict[int, Message]:
        return {cid: {"logits": table_to_message(*self.global_table(server, cid))} for cid in cids}

    def client_update(self, rnd: int, cid: int, client: dict, message: Message, data: ClientData) -> ClientUpdate:
        c = self.setup.num_classes
        targets, has_target = message_to_table(message.get("logits", {}), c, c)
        loss = partial(feddistill_loss, lam=self.hyper.lam, kind=self.hyper.distill_loss)
        context = {"targets": targets, "has_target": has_target}
        if self.hyper.upload_logits == "after_training":
            params = yield Fit(client["params"], loss=loss, context=context)
            means, counts = self.mean_logits(params, data)
        else:
            sums = {TRAINING_SUMS: torch.zeros(c, c, dtype=torch.float64),
                    TRAINING_COUNTS: torch.zeros(c, dtype=torch.float64)}
            trained = yield Fit(client["params"], loss=partial(recording_loss, loss_fn=loss), context=context,
                                extra=sums)
            params = {name: value for name, value in trained.items() if name not in sums}
            means, counts = training_means(trained[TRAINING_SUMS], trained[TRAINING_COUNTS])
        return {"params": params}, {"logits": table_to_message(means, counts > 0)}

    def mean_logits(self, params: Params, data: ClientData) -> tuple[torch.Tensor, torch.Tensor]:
        """z̄_{i,c} = mean of the model's logits over the client's class-c training samples (one
        eval-mode pass, the client's BatchNorm statistics) -> ([C, C], counts [C])."""
        c = self.setup.num_classes
        if not data.n_train:
            return torch.zeros(c, c), torch.zeros(c, dtype=torch.int64)
        logits = self.setup.ops_for(data.cid).logits(params, data.x_train, data.buffers, chunk=LOGIT_CHUNK)
        return class_means(logits.float(), data.y_train, c)

    def aggregate(self, rnd: int, server: dict, replies: dict[int, Message]) -> dict[str, torch.Tensor]:
        """z̄_c from this round's uploads for every class uploaded; the others keep theirs."""
        if not replies:
            return server
        ordered = sorted(replies)
        sums, counts = round_sums([replies[cid]["logits"] for cid in ordered], self.setup.num_classes)
        updated = counts > 0
        server = {name: value.clone() for name, value in server.items()}
        server["sums"][updated] = sums[updated]
        server["counts"][updated] = counts[updated]
        if self.hyper.exclude_self:
            server["own_mask"][:, updated] = False
            for cid in ordered:
                for label, vector in replies[cid]["logits"].items():
                    server["own"][cid, int(label)] = vector
                    server["own_mask"][cid, int(label)] = True
        table, present = mean_table(server["sums"], server["counts"])
        self.record(rnd, "global_logits", torch.where(present.unsqueeze(1), table, torch.nan).numpy())
        return server

    def client_model(self, cid: int, server: dict, client: dict) -> Params:
        return client["params"]
