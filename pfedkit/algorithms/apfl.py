"""APFL (Deng, Kamani, Mahdavi, arXiv:2003.13461, 2020): a personal model mixed with the global one.

Each client keeps a local model v_i and a mixing weight alpha_i (both persist across rounds;
v_i starts at the initial model, alpha_i at `alpha_init`). A participant trains the received
global model w with a custom `Fit.step`, per mini-batch and at the same point (w, v, alpha):
  g_w = grad F(w);   vbar = alpha v + (1 - alpha) w;   g = grad F(vbar)
  w <- w - lr g_w;   v <- v - lr alpha g                      (= grad_v F(vbar))
  alpha <- clip_[0,1](alpha - alpha_lr <v - w, g>)            (if adaptive; = d F(vbar) / d alpha)
using the pre-update v and w everywhere: this simultaneous form is ours (the paper updates w, then
v, then alpha in sequence). v travels as `extra` tensors named "personal.<parameter name>", alpha
as the 0-d extra "alpha". The client uploads w (FedAvg, n_i weights) and keeps v_i, alpha_i.
alpha_lr = the config's lr unless `alpha_lr` is set; alpha_init = 0.5 (FL-bench; PFLlib 1.0).

Evaluated model: vbar_i = alpha_i v_i + (1 - alpha_i) w with w the current global model.
Communication: the model down, the model + n_i up.
"""
from __future__ import annotations

from functools import partial
from typing import Any

import torch
from pydantic import Field

from pfedkit.algorithms.fedavg import FedAvg
from pfedkit.algorithms.registry import register
from pfedkit.core.contract import Batch, ClientData, ClientUpdate, Fit, HyperParams, Message, StepTools
from pfedkit.core.params import Params, clone, interpolate
from pfedkit.core.search import float_range

PERSONAL = "personal."  # prefix of v among a Fit's extra tensors
ALPHA = "alpha"


def mixture(personal: Params, global_: Params, alpha: float | torch.Tensor) -> Params:
    """vbar = alpha v + (1 - alpha) w, entry by entry over the names of `global_`."""
    return interpolate(global_, personal, alpha)


def apfl_step(tools: StepTools, batches: list[Batch], *, adaptive: bool, alpha_lr: float | None) -> float:
    """One APFL step on one batch: w, v and (if adaptive) alpha, all from the same point.
    Returns the loss of the mixed model vbar."""
    (batch,) = batches
    params, names, lr = tools.params, tools.trainable, tools.lr
    alpha = params[ALPHA]
    global_ = {name: params[name] for name in names}
    personal = {name: params[PERSONAL + name] for name in names}
    _, grad_w = tools.loss_and_grad(batch)
    mixed_loss, grad_mixed = tools.loss_and_grad(batch, at={**params, **mixture(personal, global_, alpha)})
    with torch.no_grad():
        if adaptive:
            slope = sum(((personal[n] - global_[n]) * grad_mixed[n]).sum() for n in names)  # d F(vbar) / d alpha
            new_alpha = (alpha - (lr if alpha_lr is None else alpha_lr) * slope).clamp(0.0, 1.0)
        for name in names:
            personal[name].sub_(lr * alpha * grad_mixed[name])
            global_[name].sub_(lr * grad_w[name])
        if adaptive:
            alpha.copy_(new_alpha)
    return float(mixed_loss)


@register
class APFL(FedAvg):
    name = "apfl"
    description = "APFL: personal model v mixed as alpha v + (1 - alpha) w, alpha learned per client"
    evaluated_model = "custom"  # alpha_i v_i + (1 - alpha_i) w

    class Hyper(HyperParams):
        alpha_init: float = Field(0.5, ge=0, le=1, description="initial mixing weight alpha_i of every client",
                                  json_schema_extra=float_range(0.1, 0.9))
        adaptive: bool = Field(True, description="learn alpha_i by gradient steps (False: keep alpha_init)")
        alpha_lr: float | None = Field(None, ge=0, description="step size of the alpha update (None: the config's lr)")

    def init_client(self, cid: int, params: Params) -> dict[str, Any]:
        return {"personal": clone(params), "alpha": float(self.hyper.alpha_init)}

    def client_update(self, rnd: int, cid: int, client: dict, message: Message, data: ClientData) -> ClientUpdate:
        extra = {PERSONAL + name: t for name, t in client["personal"].items()}
        extra[ALPHA] = torch.tensor(client["alpha"])
        step = partial(apfl_step, adaptive=self.hyper.adaptive, alpha_lr=self.hyper.alpha_lr)
        trained = yield Fit(message["params"], step=step, extra=extra)
        personal = {name[len(PERSONAL):]: t for name, t in trained.items() if name.startswith(PERSONAL)}
        global_ = {name: t for name, t in trained.items() if name in message["params"]}
        state = {"personal": personal, "alpha": float(trained[ALPHA])}
        return state, {"params": global_, "weight": data.n_train}

    def client_model(self, cid: int, server: dict, client: dict) -> Params:
        return mixture(client["personal"], server["params"], client["alpha"])

    def joining_model(self, cid: int, server: dict, client: dict, data: ClientData) -> Params:
        """A newcomer has no personal model v_i (nor a learned alpha): it receives the global w."""
        return server["params"]

    def trained_model(self, cid: int, client: dict, params: Params) -> Params:
        """After local training: the new v_i and alpha_i mixed with the w this client just trained."""
        return mixture(client["personal"], {n: t for n, t in params.items() if n in client["personal"]}, client["alpha"])
