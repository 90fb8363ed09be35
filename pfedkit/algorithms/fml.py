"""FML (Shen, Zhang, Jia, Zhang, Huang, Zhou, Kuang, Wu, Wu, *Federated Mutual Learning*,
arXiv:2006.16765, 2020): a private local model and a shared meme model, trained together by deep
mutual learning (DML, Zhang et al. CVPR 2018) on every mini-batch.

Each participant i receives the global meme model w^t, and on each mini-batch, from the same point
(both models before the step), with p = softmax(z):
    L_local = alpha CE(z_local, y) + (1 - alpha) KL(p_meme || p_local)        (eq. 1)
    L_meme  = beta  CE(z_meme,  y) + (1 - beta)  KL(p_local || p_meme)        (eq. 2)
    local <- local - lr grad_local L_local;   meme <- meme - meme_lr grad_meme L_meme
The peer's distribution is a constant target in each loss (DML). It uploads the meme model; the
server averages the memes (n_i weights; `weighting=uniform`: PFLlib's plain mean). The local model
never leaves the client and is the evaluated model.

With alpha = beta = 1 (both KL weights 0) the two models do not interact: the meme model trains as
FedAvg's model and the local model as Local's (tested, both).

How it runs: one `Fit` whose model is the local model, the meme model riding along as `extra`
tensors "meme.<name>", and a custom step (`fml_step`) doing the two updates. A step needs each
model's logits on the batch; `StepTools` gives only a loss and its gradient, so the logits are
read as the gradient of <probe, z> with respect to a zero probe (`outputs_at`): exact, and free
of any change to the loss value or the parameters' gradients. Cost per batch: three forwards and
two backwards. Models with BatchNorm share one set of running statistics in the trainer
(both models' train-mode forwards update it) [ours]. Custom steps are plain SGD: the config's
momentum, weight decay and gradient clipping do not apply (PFLlib clips both models at norm 10).

Communication: the meme model down and up (+ n_i). Paper-vs-code table: docs/algorithms/fml.md.
"""
from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any, Literal

import torch
import torch.nn.functional as F
from pydantic import Field

from pfedkit.algorithms.registry import register
from pfedkit.core.aggregation import fedavg_aggregate
from pfedkit.core.contract import (Algorithm, Batch, ClientData, ClientUpdate, cross_entropy, Fit, Forward,
                                   HyperParams, Message, StepTools)
from pfedkit.core.params import Params, clone, weighted_mean
from pfedkit.core.search import float_range

MEME = "meme."  # prefix of the meme model's tensors among the Fit's extras
# Entries a step adds to the point it evaluates the loss at (`StepTools.loss_and_grad(at=...)`):
PEER_LOGITS = "mutual.peer_logits"      # the other model's logits on the batch, a constant target
CE_WEIGHT = "mutual.ce_weight"          # alpha (local) or beta (meme)
KL_WEIGHT = "mutual.kl_weight"          # 1 - alpha (local) or 1 - beta (meme)
CROSS_WEIGHT = "mutual.cross_weight"    # PFLlib's extra gradient through the peer's KL (cross_gradients)
LOGIT_PROBE = "mutual.logit_probe"      # zero [B, C]: d<probe, z>/d probe = z, the logits read-out
FEATURE_PROBE = "mutual.feature_probe"  # zero [B, d]: the same for the body features


# ---------------------------------------------------------------------------------------------
# The math (pure functions)


def kl_divergence(target_logits: torch.Tensor, logits: torch.Tensor, reduction: str = "batchmean") -> torch.Tensor:
    """KL(softmax(target) || softmax(logits)) = sum_k p_k (log p_k - log q_k), averaged over the batch
    ("batchmean", DML's and the papers' KL) or over the B x C entries ("pfllib": torch's
    KLDivLoss() default, as PFLlib's FML and FedKD call it, i.e. the batch mean / C)."""
    log_p = F.log_softmax(target_logits, dim=1)
    log_q = F.log_softmax(logits, dim=1)
    per_sample = (log_p.exp() * (log_p - log_q)).sum(dim=1)
    if reduction == "batchmean":
        return per_sample.mean()
    if reduction == "pfllib":
        return per_sample.mean() / logits.shape[1]
    raise ValueError(f"KL reduction must be 'batchmean' or 'pfllib', got {reduction!r}")


def read_out_terms(out: Forward, params: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """<probe_z, z> + <probe_h, h> for the probes present in `params` (zero probes: the value 0 and
    no change to any parameter's gradient; the probes' own gradients are the logits z and the
    features h). 0 when none is present."""
    terms = torch.zeros((), dtype=out.logits.dtype, device=out.logits.device)
    if LOGIT_PROBE in params:
        terms = terms + (params[LOGIT_PROBE] * out.logits).sum()
    if FEATURE_PROBE in params:
        terms = terms + (params[FEATURE_PROBE] * out.features).sum()
    return terms


def mutual_loss(out: Forward, y: torch.Tensor, params: Params, context: Mapping[str, Any], *,
                reduction: str = "batchmean") -> torch.Tensor:
    """Eq. 1 / eq. 2 for the model at `out`: w CE(z, y) + (1 - w) KL(softmax(z_peer) || softmax(z)),
    w = params[CE_WEIGHT] (1 when absent), the peer's logits params[PEER_LOGITS] a constant; with
    params[CROSS_WEIGHT] also + c KL(softmax(z) || softmax(z_peer)) differentiated through z (the
    peer's loss term, PFLlib's cross gradient). Plus the read-out terms (value 0)."""
    loss = cross_entropy(out, y, params, context)
    if CE_WEIGHT in params:
        loss = params[CE_WEIGHT] * loss
    if PEER_LOGITS in params:
        peer = params[PEER_LOGITS].detach()
        if float(params[KL_WEIGHT]) != 0:
            loss = loss + params[KL_WEIGHT] * kl_divergence(peer, out.logits, reduction)
        if CROSS_WEIGHT in params and float(params[CROSS_WEIGHT]) != 0:
            loss = loss + params[CROSS_WEIGHT] * kl_divergence(out.logits, peer, reduction)
    return loss + read_out_terms(out, params)


def outputs_at(tools: StepTools, batch: Batch, model: Params, num_classes: int,
               feature_dim: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logits [B, C], features [B, d] or None) of `model` on the batch, in train mode like every
    forward of the step: the gradients of the zero probes of `read_out_terms`. The request's loss
    must add those terms (`mutual_loss`, FedKD's loss do)."""
    rows = len(batch.y)
    like = next(iter(model.values()))
    point = {**model, LOGIT_PROBE: like.new_zeros(rows, num_classes)}
    if feature_dim is not None:
        point[FEATURE_PROBE] = like.new_zeros(rows, feature_dim)
    probes = [name for name in (LOGIT_PROBE, FEATURE_PROBE) if name in point]
    _, grads = tools.loss_and_grad(batch, at=point, wrt=probes)
    return grads[LOGIT_PROBE], grads.get(FEATURE_PROBE)


def sgd_update(model: Params, grads: Params, lr: float) -> None:
    """model <- model - lr grad, in place (the live tensors of a custom step)."""
    with torch.no_grad():
        for name, tensor in model.items():
            tensor.add_(grads[name], alpha=-lr)


def fml_step(tools: StepTools, batches: list[Batch], *, alpha: float, beta: float, meme_lr: float | None,
             num_classes: int, cross_gradients: bool = False) -> float:
    """One DML step of eq. 1-2 on one batch, both models from the same point. Returns L_local."""
    (batch,) = batches
    names = tools.trainable
    local = {name: tools.params[name] for name in names}
    meme = {name: tools.params[MEME + name] for name in names}
    like = next(iter(local.values()))

    def weights(ce: float, cross: float) -> dict[str, torch.Tensor]:
        chosen = {CE_WEIGHT: ce, KL_WEIGHT: 1.0 - ce}
        if cross_gradients:
            chosen[CROSS_WEIGHT] = cross
        return {key: like.new_tensor(value) for key, value in chosen.items()}

    meme_logits, _ = outputs_at(tools, batch, meme, num_classes)
    probe = like.new_zeros(len(batch.y), num_classes)
    local_point = {**local, **weights(alpha, 1.0 - beta), PEER_LOGITS: meme_logits, LOGIT_PROBE: probe}
    local_loss, local_grads = tools.loss_and_grad(batch, at=local_point, wrt=[*names, LOGIT_PROBE])
    local_logits = local_grads.pop(LOGIT_PROBE)  # before the update: the meme's target
    meme_point = {**meme, **weights(beta, 1.0 - alpha), PEER_LOGITS: local_logits}
    _, meme_grads = tools.loss_and_grad(batch, at=meme_point, wrt=names)
    sgd_update(local, local_grads, tools.lr)
    sgd_update(meme, meme_grads, tools.lr if meme_lr is None else meme_lr)
    return float(local_loss)


def mean_of(replies: dict[int, Message], key: str, weighting: str) -> Params:
    """The server's mean of the replies' `key` models: n_i-weighted ("samples", FedAvg) or plain
    ("uniform", PFLlib's 1/m), in client order."""
    if weighting == "samples":
        return fedavg_aggregate(replies, key)
    ordered = sorted(replies)
    return weighted_mean([replies[cid][key] for cid in ordered], [1.0] * len(ordered))


def split_extra(trained: Params, prefix: str) -> tuple[Params, Params]:
    """(the model's tensors, the extras named `prefix`<name> with the prefix removed) of a Fit's answer."""
    model = {name: t for name, t in trained.items() if name.startswith(("body.", "head."))}
    extra = {name[len(prefix):]: t for name, t in trained.items() if name.startswith(prefix)}
    return model, extra


# ---------------------------------------------------------------------------------------------
# The algorithm


@register
class FML(Algorithm):
    name = "fml"
    description = "FML: private local model and shared meme model trained by deep mutual learning; memes averaged"
    evaluated_model = "own"  # the local model, as the last Fit returned it

    class Hyper(HyperParams):
        """FML hyperparameters (docs/algorithms/fml.md).

        alpha, beta: weights of the cross-entropy in the local / meme losses (eq. 1-2); the KL
            terms get 1 - alpha, 1 - beta. 0.5 each [ours: the paper's values were not retrievable].
        meme_lr: step size of the meme model (None: the config's lr, as PFLlib).
        kl_reduction: "batchmean" (DML's KL per sample, batch mean) [paper]; "pfllib" (torch's
            KLDivLoss() default: mean over the B x C entries) [code: PFLlib].
        cross_gradients: False: each loss trains its own model only, the peer a constant [paper,
            DML]; True: PFLlib, whose local loss also backpropagates into the meme model and vice
            versa (its peer logits are not detached).
        weighting: the server's mean of the memes, "samples" (n_i, FedAvg) [paper] or "uniform" [code: PFLlib].
        """
        alpha: float = Field(0.5, ge=0, le=1, description="CE weight of the local loss (KL weight 1 - alpha)",
                             json_schema_extra=float_range(0.1, 1.0))
        beta: float = Field(0.5, ge=0, le=1, description="CE weight of the meme loss (KL weight 1 - beta)",
                            json_schema_extra=float_range(0.1, 1.0))
        meme_lr: float | None = Field(None, ge=0, description="meme model's step size (None: the config's lr)")
        kl_reduction: Literal["batchmean", "pfllib"] = Field(
            "batchmean", description="KL averaged per sample (DML) or over the B x C entries (PFLlib)")
        cross_gradients: bool = Field(False, description="PFLlib: each model's loss also trains the other model")
        weighting: Literal["samples", "uniform"] = Field("samples", description="server mean of the memes: n_i or 1/m")

    def init_server(self, params: Params) -> dict[str, Any]:
        return {"params": clone(params)}

    def init_client(self, cid: int, params: Params) -> dict[str, Any]:
        return {"local": clone(params)}

    def broadcast(self, rnd: int, server: dict, cids: list[int]) -> dict[int, Message]:
        return {cid: {"params": server["params"]} for cid in cids}

    def client_update(self, rnd: int, cid: int, client: dict, message: Message, data: ClientData) -> ClientUpdate:
        h = self.hyper
        step = partial(fml_step, alpha=h.alpha, beta=h.beta, meme_lr=h.meme_lr,
                       num_classes=self.setup.num_classes, cross_gradients=h.cross_gradients)
        extra = {MEME + name: tensor for name, tensor in message["params"].items()}
        trained = yield Fit(client["local"], loss=partial(mutual_loss, reduction=h.kl_reduction), step=step,
                            extra=extra)
        local, meme = split_extra(trained, MEME)
        return {"local": local}, {"params": meme, "weight": data.n_train}

    def aggregate(self, rnd: int, server: dict, replies: dict[int, Message]) -> dict[str, Any]:
        return {"params": mean_of(replies, "params", self.hyper.weighting)} if replies else server

    def client_model(self, cid: int, server: dict, client: dict) -> Params:
        return client["local"]

    def trained_model(self, cid: int, client: dict, params: Params) -> Params:
        """After local training: the local model (the answer without the meme's tensors)."""
        return client["local"]

    def joining_model(self, cid: int, server: dict, client: dict, data: ClientData) -> Params:
        """A newcomer has no local model yet: it receives the global meme model [ours]."""
        return server["params"]
