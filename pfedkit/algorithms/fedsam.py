"""FedSAM (Qu, Li, Duan, Liu, Tang, Lu, ICML 2022; Caldarola, Caputo, Ciccone, ECCV 2022): FedAvg
whose local steps are sharpness-aware (SAM, Foret et al. 2021), seeking flat local minima.

Each local step on a mini-batch B, from the live parameters w (a custom `Fit.step`):

    g = grad F(w; B)
    eps = rho g / ||g||                                  (variant "sam")
    eps = rho T^2 g / ||T g||,  T = |w| + eta on weight tensors, 1 on the others   (variant "asam")
    w <- w - lr grad F(w + eps; B)                       (the gradient at the perturbed point, applied at w)

||.|| is the norm over all trained tensors together (+1e-12 against g = 0). ASAM (Kwon et al.
2021) is Caldarola et al.'s FedASAM; T multiplies the tensors whose name ends in "weight", as their
code does. The descent is plain SGD with the config's lr: the config's momentum, weight decay and
gradient clipping do not apply (a custom step does its own update); the papers' code steps with a
base optimizer (weight decay, and momentum for MoFedSAM), so set those to 0 when comparing FedSAM
with FedAvg. rho = 0 is FedAvg's plain SGD. With BatchNorm, both evaluations of a step update the
running statistics (train mode), where SAM's reference code freezes them on the second.

Server: FedAvg (n_i weights). Client state: none. Evaluated model: the global model.
Communication: the model down, the model + n_i up. Cost: two gradient evaluations per step; the
vectorized runtime trains these requests with its sequential fallback (a custom step).
"""
from __future__ import annotations

from functools import partial
from typing import Literal

import torch
from pydantic import Field

from pfedkit.algorithms.fedavg import FedAvg
from pfedkit.algorithms.perfedavg import shifted
from pfedkit.algorithms.registry import register
from pfedkit.core.contract import Batch, Fit, HyperParams, Message, StepTools
from pfedkit.core.params import Params
from pfedkit.core.search import float_range

NORM_GUARD = 1e-12  # added to ||g||: a zero gradient gives eps = 0 instead of 0 / 0


def sam_perturbation(grad: Params, rho: float) -> Params:
    """eps = rho g / ||g|| (the norm over every tensor of `grad` together)."""
    norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grad.values()))
    return {name: g * (rho / (float(norm) + NORM_GUARD)) for name, g in grad.items()}


def asam_perturbation(grad: Params, params: Params, rho: float, eta: float) -> Params:
    """eps = rho T^2 g / ||T g||, T = |w| + eta for weight tensors (names ending in "weight"), 1 otherwise."""
    scale = {name: (params[name].abs() + eta if name.endswith("weight") else torch.ones_like(g))
             for name, g in grad.items()}
    scaled = {name: scale[name] * g for name, g in grad.items()}  # T g
    norm = torch.sqrt(sum((v.double() ** 2).sum() for v in scaled.values()))
    return {name: scale[name] * v * (rho / (float(norm) + NORM_GUARD)) for name, v in scaled.items()}


def sgd_update(params: Params, grad: Params, lr: float) -> None:
    """w <- w - lr g in place, as torch.optim.SGD computes it (add_ with alpha = -lr): with rho = 0
    the step is FedAvg's plain SGD bit for bit."""
    with torch.no_grad():
        for name, g in grad.items():
            params[name].add_(g, alpha=-lr)


def sam_step(tools: StepTools, batches: list[Batch], *, rho: float, variant: str, eta: float) -> float:
    """One SAM step on the live params w: w <- w - lr grad F(w + eps; B). Returns the loss at w."""
    (batch,) = batches
    loss, grad = tools.loss_and_grad(batch)
    if variant == "asam":
        eps = asam_perturbation(grad, tools.params, rho, eta)
    else:
        eps = sam_perturbation(grad, rho)
    _, sharp_grad = tools.loss_and_grad(batch, at=shifted(tools.params, eps, 1.0))
    sgd_update(tools.params, sharp_grad, tools.lr)
    return float(loss)


@register
class FedSAM(FedAvg):
    name = "fedsam"
    description = "FedSAM: FedAvg with sharpness-aware local steps (SAM or ASAM), radius rho"

    class Hyper(HyperParams):
        """FedSAM options.

        rho: the perturbation radius, 0.05 [ours: SAM's default; FL-Simulator uses 0.1, Caldarola
            et al.'s scripts 0.5; the papers' tuned values not retrieved].
        variant: "sam" (FedSAM) or "asam" (FedASAM, the adaptive radius); eta: ASAM's offset
            (0.01, Kwon et al.'s default).
        """
        rho: float = Field(0.05, ge=0, description="SAM radius: the gradient is taken at w + rho g/||g||",
                           json_schema_extra=float_range(0.01, 1.0, log=True))
        variant: Literal["sam", "asam"] = Field("sam", description="sam: eps = rho g/||g||; asam (FedASAM): "
                                                "eps = rho T^2 g/||T g||, T = |w| + eta on weights")
        eta: float = Field(0.01, ge=0, description="ASAM's offset in T = |w| + eta (variant asam only)")

    def local_fit(self, message: Message) -> Fit:
        """FedAvg's client update with SAM steps instead of plain SGD."""
        step = partial(sam_step, rho=self.hyper.rho, variant=self.hyper.variant, eta=self.hyper.eta)
        return Fit(message["params"], step=step)
