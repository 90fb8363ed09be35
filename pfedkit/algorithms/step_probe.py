"""The effective step of a client's local optimiser, measured during its own training.

SCAFFOLD's option II divides the model's displacement by K * lr (K local steps, lr the local
learning rate) and FedNova by the local solver's ||a_i||_1 (tau_i for SGD, the momentum formula
for SGD with momentum). A method knows neither the run's batch size nor its learning rate or
momentum: they belong to the run's optimiser, which may also count steps by epochs, by
`local_steps`, with or without `drop_last`. So the request measures the quantity itself:

    a scalar s beside the model (`Fit.extra[STEP_PROBE]`, starting at 0) whose loss term has
    value 0 and gradient -1 (`step_probe_term`).

The optimiser is linear in the gradients it is fed (SGD, heavy-ball momentum, weight decay), so
after the request s holds exactly the displacement it gave a parameter whose gradient is the
constant 1 at every step:

    plain SGD, K steps:           s = K * lr                                 (SCAFFOLD's K eta_l)
    momentum rho, tau steps:      s = lr * [tau - rho (1 - rho^tau) / (1 - rho)] / (1 - rho)
                                                                        (FedNova's eta ||a_i||_1)

which is what both papers divide by, for whatever schedule the run uses. Where the optimiser is
not linear (gradient clipping, DP-SGD's per-sample clipping and noise), s is still the clipped
steps' total for the probe's own unit gradient (the probe's gradient 1 also counts in the clipped
norm); docs/algorithms/fednova.md and scaffold.md say so. A request with an extra tensor runs on
the sequential trainer in the `vectorized` runtime (its documented fallback).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from pfedkit.core.contract import Forward, LossFn
from pfedkit.core.params import Params

STEP_PROBE = "step_probe"  # the probe's name in Fit.extra and in the answer


def step_probe_start() -> Params:
    """The probe as a request's `extra`: s = 0 (float32, like the model)."""
    return {STEP_PROBE: torch.zeros(())}


def step_probe_term(params: Params) -> torch.Tensor:
    """s.detach() - s: value exactly 0 (the reported loss is unchanged), gradient -1 w.r.t. s, so
    each optimiser step moves s by what it moves a parameter of constant gradient 1 (module docstring)."""
    probe = params[STEP_PROBE]
    return probe.detach() - probe


def with_step_probe(out: Forward, y: torch.Tensor, params: Params, context: Mapping[str, Any], *,
                    loss: LossFn) -> torch.Tensor:
    """`loss` + the probe's term: the request's loss, unchanged in value and in the model's
    gradients, with the probe measuring the optimiser's effective step."""
    return loss(out, y, params, context) + step_probe_term(params)


def effective_step(answer: Params) -> float:
    """The probe's value in a request's answer: the optimiser's total step for a unit gradient."""
    return float(answer[STEP_PROBE])


def model_part(answer: Params) -> Params:
    """The answer without the probe: the trained model's parameters."""
    return {name: value for name, value in answer.items() if name != STEP_PROBE}
