"""FedNova (Wang, Liu, Liang, Joshi, Poor, NeurIPS 2020): normalised averaging of clients that take
different numbers of local steps.

A client's update is x - y_i = eta G_i a_i (its gradients G_i weighted by the local solver's
coefficients a_i). FedAvg averages the updates as they are, so clients that take more steps pull
the model towards their own objective. FedNova averages the normalised updates d_i and rescales
by an effective step count (eq. (7) of the paper with its choice tau_eff = sum_i p_i ||a_i||_1):

    eta d_i = (x - y_i) / ||a_i||_1
    x <- x - tau_eff sum_i p_i eta d_i,   tau_eff = sum_i p_i ||a_i||_1,   p_i = n_i / sum_{j in S} n_j

||a_i||_1 = tau_i (the client's number of steps) for plain SGD, [tau_i - rho (1 - rho^tau_i)/(1 - rho)]
/ (1 - rho) for SGD with momentum rho. Each participant measures eta ||a_i||_1 during its own
training with the step probe (`step_probe.py`), whatever the run's epochs, batch size, local_steps,
drop_last, lr or momentum; eta cancels in the rule. Equal step counts give FedAvg's mean (up to
float rounding). A participant that took no step (s_i = 0) keeps x: its d_i is 0.

Client state: none. Server state: x. Communication: the model down; the model, s_i and n_i up.
Evaluated model: the server's x. Docs: docs/algorithms/fednova.md.
"""
from __future__ import annotations

from functools import partial
from typing import Any

from pfedkit.algorithms.fedavg import FedAvg
from pfedkit.algorithms.registry import register
from pfedkit.algorithms.step_probe import effective_step, model_part, step_probe_start, with_step_probe
from pfedkit.core.contract import Algorithm, ClientData, ClientUpdate, cross_entropy, Fit, Message
from pfedkit.core.params import Params, WeightedSum, mean_shares


def normalised_average(x: Params, models: list[Params], steps: list[float], weights: list[float]) -> Params:
    """x - tau_eff sum_i p_i (x - y_i) / s_i with p_i = weights / their sum, tau_eff = sum_i p_i s_i
    and s_i = eta ||a_i||_1 (the module docstring's rule; clients with s_i = 0 add no update)."""
    shares = mean_shares(weights)
    tau_eff = sum(share * step for share, step in zip(shares, steps))
    normalised = WeightedSum()  # sum_i p_i (x - y_i) / s_i
    for model, step, share in zip(models, steps, shares):
        normalised.add({name: x[name] - model[name] for name in x}, share / step if step > 0 else 0.0)
    return {name: x[name] - tau_eff * normalised.total[name] for name in x}


@register
class FedNova(Algorithm):
    name = "fednova"
    description = "FedNova: updates normalised by each client's local step count, rescaled by tau_eff"
    evaluated_model = "custom"  # x - tau_eff sum_i p_i d_i: the mean of the uploads only for equal steps

    init_server = FedAvg.init_server
    broadcast = FedAvg.broadcast
    client_model = FedAvg.client_model

    def client_update(self, rnd: int, cid: int, client: Any, message: Message, data: ClientData) -> ClientUpdate:
        answer = yield Fit(message["params"], loss=partial(with_step_probe, loss=cross_entropy), extra=step_probe_start())
        return client, {"params": model_part(answer), "local_step": effective_step(answer), "weight": data.n_train}

    def aggregate(self, rnd: int, server: dict, replies: dict[int, Message]) -> dict[str, Params]:
        if not replies:
            return server
        ordered = [replies[cid] for cid in sorted(replies)]
        return {"params": normalised_average(server["params"], [reply["params"] for reply in ordered],
                                             [reply["local_step"] for reply in ordered],
                                             [float(reply["weight"]) for reply in ordered])}
