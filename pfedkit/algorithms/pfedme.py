"""pFedMe (T. Dinh, Tran, Nguyen, NeurIPS 2020): personalisation through Moreau envelopes.

Each participant downloads w^t and sets its local copy w_i = w^t and its personalised model
theta = w^t. Per local step (one mini-batch), a custom `Fit.step`:
  K times:  theta <- theta - eta_p (grad F(theta; batch) + lam (theta - w_i) + mu theta)
            (approximate solve of argmin_theta F(theta; batch) + (lam/2) ||theta - w_i||^2)
  then:     w_i <- w_i - eta lam (w_i - theta)                         (eta = the config's lr)
The Fit trains theta as the model's parameters and carries w_i as `extra` tensors named
"local.<parameter name>". The client uploads w_i and keeps theta; the server mixes
w^{t+1} = (1 - beta) w^t + beta * mean_i w_i (UNWEIGHTED mean over the uploads).
Defaults (FL-bench): lam = 15, K = 5, eta_p = 0.01, beta = 1, mu = 1e-3.

Evaluated model: the client's theta after its latest participation (before its first one: the
global model). Communication: the model down, the model up.
"""
from __future__ import annotations

from functools import partial
from typing import Any

import torch
from pydantic import Field, field_validator

from pfedkit.algorithms.registry import register
from pfedkit.core.contract import Algorithm, Batch, ClientData, ClientUpdate, Fit, HyperParams, Message, StepTools
from pfedkit.core.params import Params, clone, interpolate, weighted_mean
from pfedkit.core.search import choices, float_range

LOCAL = "local."  # prefix of the local copy w_i among a Fit's extra tensors


def moreau_step(tools: StepTools, batches: list[Batch], *, lam: float, inner_steps: int,
                personal_lr: float, mu: float) -> float:
    """One pFedMe local step on one batch: K inner steps on theta (the live model parameters) towards
    argmin F + (lam/2)||theta - w_i||^2 (+ mu theta, as pFedMe's optimizer), then
    w_i <- w_i - lr lam (w_i - theta). Returns the mean loss of the K inner evaluations."""
    (batch,) = batches
    params, total = tools.params, 0.0
    for _ in range(inner_steps):
        loss, grads = tools.loss_and_grad(batch)
        total += float(loss)
        with torch.no_grad():
            for name, grad in grads.items():
                theta = params[name]
                theta.sub_(personal_lr * (grad + lam * (theta - params[LOCAL + name]) + mu * theta))
    with torch.no_grad():
        for name in tools.trainable:
            local = params[LOCAL + name]
            local.sub_(tools.lr * lam * (local - params[name]))
    return total / max(inner_steps, 1)


@register
class PFedMe(Algorithm):
    name = "pfedme"
    description = "pFedMe: Moreau-envelope inner solve (K steps, lam) per batch, server mix with beta"
    evaluated_model = "own"

    class Hyper(HyperParams):
        lam: float = Field(15.0, ge=0, description="lambda: strength of the pull between theta and the local copy w_i",
                           json_schema_extra=float_range(1.0, 30.0, log=True))
        inner_steps: int = Field(5, ge=1, description="K: gradient steps of the inner (personalised) problem per batch")
        personal_lr: float = Field(0.01, gt=0, description="eta_p: step size of the inner steps",
                                   json_schema_extra=float_range(0.001, 0.1, log=True))
        beta: float = Field(1.0, ge=0, description="server mixing: w <- (1 - beta) w + beta mean_i w_i "
                            "(the paper also uses 2)", json_schema_extra=choices(1.0, 2.0))
        mu: float = Field(0.001, ge=0, description="L2 term mu theta in the inner steps")

        @field_validator("beta")
        @classmethod
        def _mix_weights_do_not_cancel(cls, beta: float) -> float:
            # The mix is the weighted mean with weights (1 - beta, beta): from beta ~ 2^53 on,
            # 1 - beta rounds to -beta in double precision and the weights sum to 0.
            if (1.0 - beta) + beta <= 0:
                raise ValueError(f"{beta:g} makes the server mix's weights 1 - beta and beta cancel in double "
                                 "precision (beta below 2^53 needed); the paper uses beta 1 or 2")
            return beta

    def init_server(self, params: Params) -> dict[str, Any]:
        return {"params": clone(params)}

    def init_client(self, cid: int, params: Params) -> dict[str, Any]:
        return {"theta": None}  # no personalised model before the first participation

    def broadcast(self, rnd: int, server: dict, cids: list[int]) -> dict[int, Message]:
        return {cid: {"params": server["params"]} for cid in cids}

    def client_update(self, rnd: int, cid: int, client: dict, message: Message, data: ClientData) -> ClientUpdate:
        received = message["params"]
        step = partial(moreau_step, lam=self.hyper.lam, inner_steps=self.hyper.inner_steps,
                       personal_lr=self.hyper.personal_lr, mu=self.hyper.mu)
        trained = yield Fit(received, step=step, extra={LOCAL + name: t for name, t in received.items()})
        theta = {name: t for name, t in trained.items() if not name.startswith(LOCAL)}
        local = {name[len(LOCAL):]: t for name, t in trained.items() if name.startswith(LOCAL)}
        return {"theta": theta}, {"params": local}

    def aggregate(self, rnd: int, server: dict, replies: dict[int, Message]) -> dict[str, Any]:
        if not replies:
            return server
        uploads = [replies[cid]["params"] for cid in sorted(replies)]
        return {"params": interpolate(server["params"], weighted_mean(uploads, [1.0] * len(uploads)), self.hyper.beta)}

    def client_model(self, cid: int, server: dict, client: dict) -> Params:
        return server["params"] if client["theta"] is None else client["theta"]
