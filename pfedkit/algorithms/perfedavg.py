"""Per-FedAvg (Fallah, Mokhtari, Ozdaglar, NeurIPS 2020): FedAvg on the MAML objective
F(w) = (1/n) sum_i F_i(w - alpha grad F_i(w)).

Local training is a custom step (`Fit.step`) over consecutive batches of the usual schedule:
  FO (default, 2 batches D, D'):  w~ = w - alpha grad F(w; D);   w <- w - beta grad F(w~; D')
  HF (3 batches D, D', D''):      g = grad F(w~; D');
                                  H g ~ (grad F(w + delta g; D'') - grad F(w - delta g; D'')) / (2 delta);
                                  w <- w - beta (g - alpha H g)
(the gradient is taken at w~ and applied to w). Groups of 2 (3) batches are formed over the whole
request's schedule, so E epochs of b batches give floor(E b / 2) meta-steps [ours; the spec's
floor(b / 2) per epoch when b is even]. Server: FedAvg (n_i weights). alpha = the config's lr
unless `alpha` is set, beta = 1e-3 (FL-bench; PFLlib uses beta = alpha), delta = 1e-3.
The outer step is w <- w - beta g (PFLlib's PerAvgOptimizer), without the config's momentum, weight
decay or clipping; `trainer_optimizer: true` sends it through them instead (StepTools.sgd_step,
momentum kept per client with keep_optimizer_state), so that a table whose other rows train with
momentum and clipping can run Per-FedAvg at the same settings.

Evaluated model: the global model after ONE inner step w - alpha grad F(w; D) on one training batch
(`Algorithm.adapt`, PFLlib's evaluate_one_step); the adapted copy is thrown away. `eval_epochs: k`
takes k epochs of such steps instead (FL-bench's test path fine-tunes one epoch). It is the inner
step of the meta objective, so, like it, it ignores the config's gradient clipping, weight decay
and momentum: a clipped step would evaluate a point the meta-training never optimised.
Communication: the model down, the model + n_i up.
"""
from __future__ import annotations

from functools import partial
from typing import Literal

import torch
from pydantic import Field

from pfedkit.algorithms.fedavg import FedAvg
from pfedkit.algorithms.registry import register
from pfedkit.core.contract import Batch, Fit, HyperParams, Message, StepTools
from pfedkit.core.params import Params
from pfedkit.core.search import float_range


def shifted(params: Params, direction: Params, scale: float) -> Params:
    """params + scale * direction on the names of `direction`; the other entries as they are."""
    return {name: (value + scale * direction[name] if name in direction else value)
            for name, value in params.items()}


def descend(params: Params, direction: Params, scale: float) -> None:
    """params -= scale * direction in place, on the names of `direction` (the live tensors)."""
    with torch.no_grad():
        for name, value in direction.items():
            params[name].sub_(scale * value)


def inner_step(tools: StepTools, batches: list[Batch]) -> float:
    """The meta objective's inner step in place, w <- w - alpha grad F(w; D) (alpha = tools.lr),
    unclipped: the personalised model Per-FedAvg evaluates. Returns the loss at w on D."""
    loss, grad = tools.loss_and_grad(batches[0])
    descend(tools.params, grad, tools.lr)
    return float(loss)


def meta_step(tools: StepTools, batches: list[Batch], *, beta: float, variant: str, delta: float,
              trainer_optimizer: bool = False) -> float:
    """One Per-FedAvg local step on the live params w, alpha = tools.lr:
    FO: w <- w - beta grad F(w - alpha grad F(w; D); D');
    HF: w <- w - beta (g - alpha H(w; D'') g) with g the FO gradient and the Hessian-vector product
    taken by central finite differences of step delta. Returns the loss at w~ on D'."""
    alpha = tools.lr
    _, inner = tools.loss_and_grad(batches[0])
    adapted = shifted(tools.params, inner, -alpha)                      # w~ = w - alpha grad F(w; D)
    meta_loss, outer = tools.loss_and_grad(batches[1], at=adapted)      # g = grad F(w~; D')
    if variant == "hf":
        _, plus = tools.loss_and_grad(batches[2], at=shifted(tools.params, outer, delta))
        _, minus = tools.loss_and_grad(batches[2], at=shifted(tools.params, outer, -delta))
        outer = {name: g - alpha * (plus[name] - minus[name]) / (2 * delta) for name, g in outer.items()}
    if trainer_optimizer:  # the config's clipping, momentum and weight decay on the outer step
        tools.sgd_step(outer, beta)
    else:
        descend(tools.params, outer, beta)
    return float(meta_loss)


@register
class PerFedAvg(FedAvg):
    name = "perfedavg"
    description = "Per-FedAvg: MAML-style meta step (fo or hf), FedAvg server, evaluated after one local step"
    evaluated_model = "custom"  # the global model after one adaptation step

    class Hyper(HyperParams):
        variant: Literal["fo", "hf"] = Field("fo", description="first-order (2 batches per step) or "
                                             "Hessian-free (3 batches, finite-difference Hessian-vector product)")
        alpha: float | None = Field(None, ge=0, description="inner step size alpha, also the evaluation step's "
                                    "lr (None: the config's lr)")
        beta: float = Field(0.001, ge=0, description="outer (meta) step size beta",
                            json_schema_extra=float_range(0.0001, 0.01, log=True))
        delta: float = Field(0.001, gt=0, description="finite-difference step of the HF variant")
        eval_epochs: int | None = Field(None, ge=1, description=(
            "the evaluated model's adaptation: None, one inner step on one training batch (the paper, "
            "PFLlib); k, k epochs of inner steps (FL-bench fine-tunes one epoch)"))
        trainer_optimizer: bool = Field(False, description=(
            "the outer (meta) step through the config's SGD settings: grad_clip, momentum, weight "
            "decay, kept momentum (keep_optimizer_state); false: w - beta g, as the authors' code"))

    def local_fit(self, message: Message) -> Fit:
        """FedAvg's client update with the meta step instead of plain SGD."""
        step = partial(meta_step, beta=self.hyper.beta, variant=self.hyper.variant, delta=self.hyper.delta,
                       trainer_optimizer=self.hyper.trainer_optimizer)
        return Fit(message["params"], lr=self.hyper.alpha, step=step,
                   batches_per_step=3 if self.hyper.variant == "hf" else 2)

    def adapt(self, cid: int, server: dict, client: None, params: Params) -> Fit:
        """The inner step (lr alpha, one training batch; or `eval_epochs` epochs of them) from the
        evaluated (global) model."""
        epochs = self.hyper.eval_epochs
        return Fit(params, steps=1 if epochs is None else None, epochs=epochs, lr=self.hyper.alpha, step=inner_step)
