"""FedKD (Wu, Wu, Lyu, Huang, Xie, *Communication-efficient federated learning via knowledge
distillation*, Nature Communications 13, 2032, 2022; arXiv:2108.13323): a private mentor and a
shared mentee trained together by adaptive mutual distillation; the mentee's update travels
compressed by SVD.

Participant i receives the global mentee w_s and, on each mini-batch, from the same point, with
z the logits, h the body's features, CE_t / CE_s the mentor's / mentee's task losses and
a = 1 / (CE_t + CE_s) the adaptive weight (a constant of the step [ours]):
    L_t = CE_t + d a KL(p_s || p_t) + g a MSE(h_t, W_h h_s)     (mentor; p_s, h_s constants)   (1)
    L_s = CE_s + d a KL(p_t || p_s) + g a MSE(h_t, W_h h_s)     (mentee; p_t, h_t constants)   (2)
with d = `distill_weight`, g = `hidden_weight` (1 and 1 in the paper: the distillation losses are
weighted by the task losses alone). W_h (d x d, the client's, initially the identity [ours]) maps
the mentee's features to the mentor's and is trained by the hidden term. One plain SGD step of
each from the same point (`fedkd_step`).

The mentee's update g_i = w_s' - w_s is compressed per weight matrix (a conv kernel as [out, in kh kw]
[ours]): g = U S V^T, keep the K largest singular values, K the smallest with
    sum_{k <= K} s_k^2 >= T(t) sum_k s_k^2,   T(t) = T_start + (T_end - T_start) t / R      (3)
(t = 1..R the round [code: authors]); vectors travel whole. The client uploads (U_K, S_K, V_K);
the server averages the reconstructed updates (uniform [code: authors, PFLlib] or n_i), compresses
that mean with the same T(t) [code: authors: the download is compressed too] and adds it to the
mentee. With d = g = 0 and T = 1 the mentee is FedAvg's model (float error: U S V^T) and the
mentor is Local training (tested).

Evaluated model: the mentor (the private model, `own`), as PFLlib. Both models share the run's
architecture (PFLlib's reading; the paper's mentor is larger, which one training request of
pfedkit cannot hold). How it runs: one `Fit` whose model is the mentor, the mentee as `extra`
tensors "mentee.<name>" and W_h as the extra "fedkd.hidden_map", a custom step reading both
models' logits and features through FML's zero probes (`fml.outputs_at`). Paper-vs-code table:
docs/algorithms/fedkd.md.
"""
from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any, Literal

import torch
import torch.nn.functional as F
from pydantic import Field

from pfedkit.algorithms.fml import (KL_WEIGHT, PEER_LOGITS, kl_divergence, outputs_at, read_out_terms, sgd_update,
                                    split_extra)
from pfedkit.algorithms.registry import register
from pfedkit.core.contract import (Algorithm, Batch, ClientData, ClientUpdate, cross_entropy, Fit, Forward,
                                   HyperParams, Message, StepTools)
from pfedkit.core.params import Params, clone, weighted_mean
from pfedkit.core.search import float_range

MENTEE = "mentee."                   # prefix of the mentee's tensors among the Fit's extras
HIDDEN_MAP = "fedkd.hidden_map"      # W_h [d, d]: an extra of the Fit, and (mentee point) the map applied
HIDDEN_TARGET = "fedkd.hidden_target"  # the constant the model's (mapped) features are pulled to
HIDDEN_WEIGHT = "fedkd.hidden_weight"  # g a


# ---------------------------------------------------------------------------------------------
# The math (pure functions)


def fedkd_loss(out: Forward, y: torch.Tensor, params: Params, context: Mapping[str, Any], *,
               reduction: str = "batchmean") -> torch.Tensor:
    """Eq. 1 / eq. 2 for the model at `out`: CE + params[KL_WEIGHT] KL(softmax(peer) || softmax(z))
    + params[HIDDEN_WEIGHT] MSE(target, M h), M = params[HIDDEN_MAP] where present (the mentee's
    W_h), else the identity; absent or zero-weighted terms are left out. Plus FML's read-out terms."""
    loss = cross_entropy(out, y, params, context)
    if PEER_LOGITS in params and float(params[KL_WEIGHT]) != 0:
        loss = loss + params[KL_WEIGHT] * kl_divergence(params[PEER_LOGITS].detach(), out.logits, reduction)
    if HIDDEN_TARGET in params and float(params[HIDDEN_WEIGHT]) != 0:
        features = out.features @ params[HIDDEN_MAP].T if HIDDEN_MAP in params else out.features
        loss = loss + params[HIDDEN_WEIGHT] * F.mse_loss(features, params[HIDDEN_TARGET].detach())
    return loss + read_out_terms(out, params)


def adaptive_weight(mentor_logits: torch.Tensor, mentee_logits: torch.Tensor, y: torch.Tensor) -> float:
    """a = 1 / (CE_t + CE_s) on the batch: distil more where both models predict well."""
    total = F.cross_entropy(mentor_logits, y) + F.cross_entropy(mentee_logits, y)
    return 1.0 / max(float(total), 1e-12)


def hidden_map_gradient(mentor_features: torch.Tensor, mentee_features: torch.Tensor,
                        hidden_map: torch.Tensor) -> torch.Tensor:
    """d/dW MSE(h_t, W h_s) = -(2 / (B d)) (h_t - h_s W^T)^T h_s, the features constants."""
    residual = mentor_features - mentee_features @ hidden_map.T
    return -2.0 / residual.numel() * residual.T @ mentee_features


def fedkd_step(tools: StepTools, batches: list[Batch], *, num_classes: int, feature_dim: int,
               distill_weight: float, hidden_weight: float, mentee_lr: float | None) -> float:
    """One step of eq. 1-2 on one batch: mentor, mentee and W_h from the same point. Returns L_t."""
    (batch,) = batches
    names = tools.trainable
    mentor = {name: tools.params[name] for name in names}
    mentee = {name: tools.params[MENTEE + name] for name in names}
    hidden_map = tools.params[HIDDEN_MAP]
    mentee_logits, mentee_features = outputs_at(tools, batch, mentee, num_classes, feature_dim)
    mentor_logits, mentor_features = outputs_at(tools, batch, mentor, num_classes, feature_dim)
    a = adaptive_weight(mentor_logits, mentee_logits, batch.y)
    weights = {KL_WEIGHT: hidden_map.new_tensor(distill_weight * a),
               HIDDEN_WEIGHT: hidden_map.new_tensor(hidden_weight * a)}
    with torch.no_grad():
        mapped = mentee_features @ hidden_map.T
    mentor_point = {**mentor, **weights, PEER_LOGITS: mentee_logits, HIDDEN_TARGET: mapped}
    mentor_loss, mentor_grads = tools.loss_and_grad(batch, at=mentor_point, wrt=names)
    mentee_point = {**mentee, **weights, PEER_LOGITS: mentor_logits, HIDDEN_TARGET: mentor_features,
                    HIDDEN_MAP: hidden_map.detach()}
    _, mentee_grads = tools.loss_and_grad(batch, at=mentee_point, wrt=names)
    map_grad = hidden_weight * a * hidden_map_gradient(mentor_features, mentee_features, hidden_map)
    sgd_update(mentor, mentor_grads, tools.lr)
    sgd_update(mentee, mentee_grads, tools.lr if mentee_lr is None else mentee_lr)
    sgd_update({HIDDEN_MAP: hidden_map}, {HIDDEN_MAP: map_grad}, tools.lr)
    return float(mentor_loss)


def energy_threshold(rnd: int, rounds: int, start: float, end: float) -> float:
    """T(t) = T_start + (T_end - T_start) t / R (eq. 3), t = rnd = 1..R."""
    return start + (end - start) * min(rnd / max(rounds, 1), 1.0)


def svd_compress(update: torch.Tensor, energy: float) -> torch.Tensor | dict[str, torch.Tensor]:
    """Eq. 3: a matrix (or a kernel as [out, rest]) as {"u": U_K, "s": S_K, "v": V_K^T}, K the fewest
    singular values whose squares hold `energy` of the total; a vector or an all-zero matrix whole."""
    if update.dim() < 2:
        return update
    u, s, vh = torch.linalg.svd(update.reshape(update.shape[0], -1), full_matrices=False)
    power = torch.cumsum(s * s, dim=0)
    if float(power[-1]) == 0.0:
        return update
    keep = min(int((power < energy * power[-1]).sum()) + 1, len(s))
    return {"u": u[:, :keep].contiguous(), "s": s[:keep].clone(), "v": vh[:keep].contiguous()}


def svd_restore(sent: torch.Tensor | Mapping[str, torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """U_K diag(S_K) V_K^T in the shape of `like` (an uncompressed tensor as it is)."""
    if isinstance(sent, torch.Tensor):
        return sent
    return ((sent["u"] * sent["s"]) @ sent["v"]).reshape(like.shape)


def compress_update(update: Params, energy: float) -> dict[str, Any]:
    return {name: svd_compress(tensor, energy) for name, tensor in update.items()}


def restore_update(sent: Mapping[str, Any], like: Params) -> Params:
    return {name: svd_restore(sent[name], tensor) for name, tensor in like.items()}


# ---------------------------------------------------------------------------------------------
# The algorithm


@register
class FedKD(Algorithm):
    name = "fedkd"
    description = ("FedKD: private mentor and shared mentee by adaptive mutual distillation; "
                   "the mentee's update SVD-compressed, energy threshold rising")
    evaluated_model = "own"  # the mentor, as the last Fit returned it

    class Hyper(HyperParams):
        """FedKD hyperparameters (docs/algorithms/fedkd.md).

        distill_weight, hidden_weight: d and g of eq. 1-2, the weights of the adaptive
            distillation and hidden losses (1 each: the paper's losses) [ours: the knobs].
        t_start, t_end: the energy threshold's first and last value, 0.95 and 0.98 [code: PFLlib's
            defaults; the paper's values were not retrievable]; 1.0 keeps every singular value.
        compress_download: also compress the server's mean update (the download) [code: authors].
        weighting: the server's mean of the updates, "uniform" (1/m) [code: authors, PFLlib] or
            "samples" (n_i).
        mentee_lr: the mentee's step size (None: the config's lr) [code: PFLlib has its own].
        kl_reduction: "batchmean" (KL per sample) or "pfllib" (torch's KLDivLoss() default).
        """
        distill_weight: float = Field(1.0, ge=0, description="d: weight of the adaptive distillation losses")
        hidden_weight: float = Field(1.0, ge=0, description="g: weight of the adaptive hidden-state losses")
        t_start: float = Field(0.95, gt=0, le=1, description="T_start: energy kept in round 1",
                               json_schema_extra=float_range(0.8, 0.99))
        t_end: float = Field(0.98, gt=0, le=1, description="T_end: energy kept in the last round")
        compress_download: bool = Field(True, description="compress the server's mean update too (authors)")
        weighting: Literal["uniform", "samples"] = Field("uniform", description="server mean: 1/m or n_i")
        mentee_lr: float | None = Field(None, ge=0, description="mentee's step size (None: the config's lr)")
        kl_reduction: Literal["batchmean", "pfllib"] = Field(
            "batchmean", description="KL averaged per sample, or over the B x C entries (PFLlib)")

    @property
    def feature_dim(self) -> int:
        return int(self.setup.ops.template.feature_dim)

    def energy(self, rnd: int) -> float:
        return energy_threshold(rnd, self.setup.rounds, self.hyper.t_start, self.hyper.t_end)

    def init_server(self, params: Params) -> dict[str, Any]:
        return {"mentee": clone(params)}

    def init_client(self, cid: int, params: Params) -> dict[str, Any]:
        return {"mentor": clone(params), "hidden_map": torch.eye(self.feature_dim)}

    def broadcast(self, rnd: int, server: dict, cids: list[int]) -> dict[int, Message]:
        # The whole mentee [ours]: a sampled client may have missed earlier rounds' updates.
        return {cid: {"mentee": server["mentee"]} for cid in cids}

    def client_update(self, rnd: int, cid: int, client: dict, message: Message, data: ClientData) -> ClientUpdate:
        h = self.hyper
        step = partial(fedkd_step, num_classes=self.setup.num_classes, feature_dim=self.feature_dim,
                       distill_weight=h.distill_weight, hidden_weight=h.hidden_weight, mentee_lr=h.mentee_lr)
        received = message["mentee"]
        extra = {MENTEE + name: tensor for name, tensor in received.items()}
        extra[HIDDEN_MAP] = client["hidden_map"]
        trained = yield Fit(client["mentor"], loss=partial(fedkd_loss, reduction=h.kl_reduction), step=step,
                            extra=extra)
        hidden_map = trained[HIDDEN_MAP]
        mentor, mentee = split_extra(trained, MENTEE)
        update = {name: mentee[name] - received[name] for name in received}
        return ({"mentor": mentor, "hidden_map": hidden_map},
                {"update": compress_update(update, self.energy(rnd)), "weight": data.n_train})

    def aggregate(self, rnd: int, server: dict, replies: dict[int, Message]) -> dict[str, Any]:
        if not replies:
            return server
        mentee, ordered = server["mentee"], sorted(replies)
        updates = [restore_update(replies[cid]["update"], mentee) for cid in ordered]
        weights = [replies[cid]["weight"] if self.hyper.weighting == "samples" else 1.0 for cid in ordered]
        mean = weighted_mean(updates, weights)
        if self.hyper.compress_download:
            mean = restore_update(compress_update(mean, self.energy(rnd)), mentee)
        return {"mentee": {name: mentee[name] + mean[name] for name in mentee}}

    def client_model(self, cid: int, server: dict, client: dict) -> Params:
        return client["mentor"]

    def trained_model(self, cid: int, client: dict, params: Params) -> Params:
        """After local training: the mentor (the answer without the mentee's tensors)."""
        return client["mentor"]

    def joining_model(self, cid: int, server: dict, client: dict, data: ClientData) -> Params:
        """A newcomer has no mentor yet: it receives the global mentee [ours]."""
        return server["mentee"]
