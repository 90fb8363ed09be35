"""SCAFFOLD (Karimireddy, Kale, Mohri, Reddi, Stich, Suresh, ICML 2020): local steps corrected by
control variates.

Algorithm 1 of the paper, with server control variate c and client control variates c_i (all 0
at the start):

    local step (line 10):   y <- y - eta_l (g_i(y) - c_i + c)                  K steps from y = x
    option I   (line 12):   c_i+ = g_i(x), the gradient of the local loss at the server model
    option II  (line 12):   c_i+ = c_i - c + (x - y_i) / (K eta_l)
    server     (lines 16-17): x <- x + eta_g (1/|S|) sum_i (y_i - x);  c <- c + (|S|/N) (1/|S|) sum_i (c_i+ - c_i)

The local step is plain SGD on a loss with a linear term: `scaffold_loss` = CE + <y, c - c_i> (its
value held at CE), whose gradient is g_i(y) + c - c_i, so the run's SGD makes exactly line 10's
step and nothing of the trainer is replaced. Option II needs K eta_l, which a method does not know
(batch size, lr, local_steps and drop_last belong to the run): the request measures it with the
step probe (`step_probe.py`: a scalar of unit gradient whose displacement is K eta_l for plain SGD;
with momentum it is the momentum's effective step, the generalisation pfedkit takes [ours]).
Option I's gradient is one extra pass over the client's training data at x after training
(`gradient_sum_step`, a custom step that changes no parameter; mini-batch gradients weighted by
their sizes, so the result is the gradient of the mean loss over the whole training set).

Client state: c_i (one model-sized tensor set). Server state: x and c. Communication: x and c down,
y_i and c_i+ - c_i (+ n_i) up. Evaluated model: the server's x. Weights of the server's mean:
uniform over the participants [paper]; `weights=samples` uses n_i. Docs: docs/algorithms/scaffold.md.
"""
from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any, Literal

import torch
from pydantic import Field

from pfedkit.algorithms.fedavg import FedAvg
from pfedkit.algorithms.registry import register
from pfedkit.algorithms.step_probe import effective_step, model_part, step_probe_start, with_step_probe
from pfedkit.core.contract import (Algorithm, Batch, ClientData, ClientUpdate, cross_entropy, Fit, Forward, HyperParams,
                                   Message, StepTools)
from pfedkit.core.params import Params, WeightedSum, clone, weighted_mean
from pfedkit.core.search import float_range

GRADIENT = "gradient."              # Fit.extra prefix of option I's gradient sums, one per parameter
GRADIENT_SAMPLES = "gradient_samples"  # Fit.extra: the samples those sums cover


def scaffold_loss(out: Forward, y: torch.Tensor, params: Params, context: Mapping[str, Any]) -> torch.Tensor:
    """CE + sum over parameters of <y - y.detach(), c - c_i> (context["correction"] = c - c_i):
    the value is CE, the gradient g_i(y) + c - c_i, so an SGD step is Algorithm 1's line 10."""
    correction = context["correction"]
    linear = sum(((params[name] - params[name].detach()) * correction[name]).sum() for name in correction)
    return cross_entropy(out, y, params, context) + linear


def gradient_sum_step(tools: StepTools, batches: list[Batch]) -> float:
    """Option I's pass, one batch at a time: add n_b * grad f_i(x; b) to the gradient sums (extra
    tensors) at the unchanged model x; returns the batch loss."""
    (batch,) = batches
    loss, gradients = tools.loss_and_grad(batch)
    size = len(batch.y)
    with torch.no_grad():
        for name, gradient in gradients.items():
            tools.params[GRADIENT + name].add_(gradient, alpha=size)
        tools.params[GRADIENT_SAMPLES].add_(size)
    return float(loss)


def control_from_displacement(c_i: Params, c: Params, x: Params, y: Params, step: float) -> Params:
    """Option II: c_i+ = c_i - c + (x - y_i) / (K eta_l), K eta_l = `step` (the probe's value). No
    local step taken (step 0): c_i kept."""
    if step == 0:
        return c_i
    return {name: c_i[name] - c[name] + (x[name] - y[name]) / step for name in c_i}


@register
class SCAFFOLD(Algorithm):
    name = "scaffold"
    description = "SCAFFOLD: local steps corrected by control variates c - c_i (option I or II)"
    evaluated_model = "custom"  # x + eta_g * mean(y_i - x): not the n_i-weighted mean of the uploads

    class Hyper(HyperParams):
        """SCAFFOLD options: option II [paper's default, cheaper]; eta_g = 1 [paper's experiments];
        uniform server mean [paper, FL-bench; PFLlib: n_i]."""
        option: Literal["I", "II"] = Field("II", description="c_i update: I = gradient at the server model over "
                                           "the local data (one more pass), II = c_i - c + (x - y_i)/(K lr)")
        global_lr: float = Field(1.0, gt=0, description="global step size eta_g",
                                 json_schema_extra=float_range(0.1, 2.0, log=True))
        weights: Literal["uniform", "samples"] = Field("uniform", description="the server's mean of y_i - x: "
                                                       "uniform over the participants (paper) or by n_i")

    def init_server(self, params: Params) -> dict[str, Params]:
        return {"params": clone(params), "control": {name: torch.zeros_like(v) for name, v in params.items()}}

    def init_client(self, cid: int, params: Params) -> dict[str, Params]:
        return {"control": {name: torch.zeros_like(v) for name, v in params.items()}}

    def broadcast(self, rnd: int, server: dict, cids: list[int]) -> dict[int, Message]:
        return {cid: {"params": server["params"], "control": server["control"]} for cid in cids}

    client_model = FedAvg.client_model  # the server's model

    def client_update(self, rnd: int, cid: int, client: dict, message: Message, data: ClientData) -> ClientUpdate:
        x, c, c_i = message["params"], message["control"], client["control"]
        context = {"correction": {name: c[name] - c_i[name] for name in c}}
        if self.hyper.option == "I":
            y = yield Fit(x, loss=scaffold_loss, context=context)
            new_c_i = yield from self.gradient_at(x)
        else:
            answer = yield Fit(x, loss=partial(with_step_probe, loss=scaffold_loss), context=context,
                               extra=step_probe_start())
            y = model_part(answer)
            new_c_i = control_from_displacement(c_i, c, x, y, effective_step(answer))
        delta = {name: new_c_i[name] - c_i[name] for name in c_i}
        return {"control": new_c_i}, {"params": y, "control_delta": delta, "weight": data.n_train}

    def gradient_at(self, x: Params) -> ClientUpdate:
        """Option I: the gradient of the local loss at x over all training samples (one epoch of
        `gradient_sum_step`, after the training request so that its batches are FedAvg's)."""
        sums = {GRADIENT + name: torch.zeros_like(value) for name, value in x.items()}
        answer = yield Fit(x, epochs=1, step=gradient_sum_step, extra={**sums, GRADIENT_SAMPLES: torch.zeros(())})
        samples = float(answer[GRADIENT_SAMPLES])
        return {name: answer[GRADIENT + name] / samples for name in x}

    def aggregate(self, rnd: int, server: dict, replies: dict[int, Message]) -> dict[str, Params]:
        """x <- x + eta_g mean_i (y_i - x); c <- c + (1/N) sum_i delta c_i (Algorithm 1, lines 16-17)."""
        if not replies:
            return server
        ordered = sorted(replies)
        weights = [float(replies[cid]["weight"]) if self.hyper.weights == "samples" else 1.0 for cid in ordered]
        mean = weighted_mean([replies[cid]["params"] for cid in ordered], weights)
        x = server["params"]
        params = {name: x[name] + self.hyper.global_lr * (mean[name] - x[name]) for name in x}
        control_change = WeightedSum()
        for cid in ordered:
            control_change.add(replies[cid]["control_delta"], 1.0 / self.setup.num_clients)
        control = {name: value + control_change.total[name] for name, value in server["control"].items()}
        return {"params": params, "control": control}
