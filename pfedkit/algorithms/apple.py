"""APPLE (Luo & Wu, *Adapt to Adaptation: Learning Personalization for Cross-Silo Federated
Learning*, IJCAI 2022; arXiv:2110.08394): each client learns how much every client's core model
should count in its personalised model.

Every client j owns a core model w_j (kept by the server, initially the initial model). Client i
keeps a directed-relationship (DR) vector p_i in R^N, initially p_0 = (n_1, ..., n_N) / sum_j n_j,
and personalises with
    w_i^(p) = sum_j p_ij w_j                                                      (1)
Round t (r = t - 1): participant i downloads the other clients' core models and, per mini-batch,
minimises
    F_i(p_i, w_i) = CE(w_i^(p)) + lambda(r) mu ||p_i - p_0||^2                     (2)
over its own core w_i and p_i, the other cores fixed (the squared norm without 1/2 [code: authors];
PFLlib's gradient lambda mu (p_ij - p_0j) is this with mu / 2). With g = grad CE at w^(p), from the
same point:
    w_i  <- w_i  - eta g p_ii                      (the chain rule through (1))
    p_ij <- p_ij - eta_p (<g, w_j> + 2 lambda(r) mu (p_ij - p_0j))   for every j     (3)
`dr_gradient="layer_mean"` replaces <g, w_j> by PFLlib's mean over layers of the mean of g * w_j.
`constraint="simplex"` projects p_i onto the probability simplex after each update [ours]; the
authors' code and PFLlib keep p_i unconstrained (their download rule takes |p_ij|).
The loss scheduler decays the proximal pull over the first L T rounds [code: authors]:
    cosine: lambda(r) = (cos(pi r / R) + 1) / 2;  exponential: lambda(r) = 0.001^(r / R);
    R = floor(L T), lambda(r) = 0 for r >= R.
The client uploads its core w_i; the server stores it in slot i.

Evaluated model: w_i^(p) as the client's training left it (its new core, its new p_i, the other
cores as downloaded). With one client (p = [1]) and the simplex constraint APPLE is Local
training (tested). A custom `Fit.step` (`apple_step`): the other cores ride along as `extra`
tensors "core<j>.<name>", p_i as the extra "dr"; plain SGD (no momentum: the authors use 0.9).

The paper's full text was not retrievable here; eq. (2)'s form and the steps follow the authors'
code (ljaiverson/pFL-APPLE) and the paper's objective as quoted in a reading note: docs/algorithms/apple.md.
"""
from __future__ import annotations

import math
from functools import partial
from typing import Any, Literal

import numpy as np
import torch
from pydantic import Field

from pfedkit.algorithms.registry import register
from pfedkit.core.contract import Algorithm, Batch, ClientData, ClientUpdate, Fit, HyperParams, Message, StepTools
from pfedkit.core.params import Params, WeightedSum, clone
from pfedkit.core.search import float_range

DR = "dr"  # the DR vector p_i among the Fit's extras
EXPONENTIAL_FLOOR = 0.001  # lambda at r = R of the exponential scheduler [code: authors]


def core_prefix(j: int) -> str:
    """Extras prefix of client j's core model in a Fit."""
    return f"core{j}."


# ---------------------------------------------------------------------------------------------
# The math (pure functions)


def loss_scheduler(rnd: int, rounds: int, fraction: float, shape: str) -> float:
    """lambda(r) with r = rnd - 1 and R = floor(fraction * rounds): cosine or exponential decay over
    r < R, 0 afterwards (and when R = 0)."""
    decay_rounds, r = int(rounds * fraction), rnd - 1
    if r >= decay_rounds:
        return 0.0
    if shape == "cosine":
        return (math.cos(math.pi * r / decay_rounds) + 1.0) / 2.0
    if shape == "exponential":
        return EXPONENTIAL_FLOOR ** (r / decay_rounds)
    raise ValueError(f"loss scheduler shape must be 'cosine' or 'exponential', got {shape!r}")


def mixture(cores: list[Params], p: torch.Tensor) -> Params:
    """w^(p) = sum_j p_j w_j (eq. 1), summed in client order, entry by entry."""
    total = WeightedSum()
    for j, core in enumerate(cores):
        total.add(core, float(p[j]))
    return total.total


def project_to_simplex(vector: torch.Tensor) -> torch.Tensor:
    """The Euclidean projection onto {p >= 0, sum p = 1} (sort-based; Duchi et al., ICML 2008)."""
    ordered, _ = torch.sort(vector, descending=True)
    excess = torch.cumsum(ordered, dim=0) - 1.0
    ranks = torch.arange(1, len(vector) + 1, dtype=vector.dtype)
    support = int((ordered - excess / ranks > 0).nonzero().max())
    return (vector - excess[support] / (support + 1)).clamp(min=0.0)


def alignment(grad: Params, core: Params, names: list[str], reduction: str) -> torch.Tensor:
    """dCE/dp_j = <g, w_j> (eq. 3, "exact"), or PFLlib's mean over the layers of mean(g * w_j)."""
    if reduction == "exact":
        return sum((grad[name] * core[name]).sum() for name in names)
    return sum((grad[name] * core[name]).mean() for name in names) / len(names)


def apple_step(tools: StepTools, batches: list[Batch], *, own: int, num_clients: int, core_lr_scale: float,
               dr_lr: float, pull: float, p0: tuple[float, ...], constraint: str, dr_gradient: str) -> float:
    """One APPLE step on one batch (module docstring, eq. 3): the own core (step size: the request's
    lr times `core_lr_scale`) and p_i from the same point, `pull` = lambda(r) mu. Returns CE at w^(p)."""
    (batch,) = batches
    names, params = tools.trainable, tools.params
    own_core = {name: params[name] for name in names}
    cores = [own_core if j == own else {name: params[core_prefix(j) + name] for name in names}
             for j in range(num_clients)]
    p = params[DR]
    loss, grad = tools.loss_and_grad(batch, at=mixture(cores, p), wrt=names)
    with torch.no_grad():
        grad_ce = torch.stack([alignment(grad, core, names, dr_gradient) for core in cores])
        grad_p = grad_ce + 2 * pull * (p - p.new_tensor(p0))
        share = float(p[own])
        for name in names:
            own_core[name].add_(grad[name], alpha=-tools.lr * core_lr_scale * share)
        p.sub_(dr_lr * grad_p)
        if constraint == "simplex":
            p.copy_(project_to_simplex(p))
    return float(loss)


# ---------------------------------------------------------------------------------------------
# The algorithm


@register
class APPLE(Algorithm):
    name = "apple"
    description = "APPLE: personalised model = learned DR-vector mix of every client's core model, proximal pull decaying"
    evaluated_model = "custom"  # sum_j p_ij w_j with the client's trained core and p_i, the others as downloaded

    class Hyper(HyperParams):
        """APPLE hyperparameters (docs/algorithms/apple.md).

        dr_lr: eta_p, step size of the DR vector, 0.001 [code: authors' lr_coef].
        mu: coefficient of the proximal term mu ||p - p_0||^2, 0.1 [code: authors].
        scheduler: lambda(r)'s shape, "exponential" [code: authors' default] or "cosine" [code: PFLlib; authors' option].
        decay_fraction: L, the share of the rounds over which lambda decays to 0, 0.1 [code: authors]
            (PFLlib: 1.0).
        constraint: "none" (p_i unconstrained) [code: authors, PFLlib] or "simplex" [ours].
        core_lr: "lr" (the config's lr on the own core) [code: authors] or "lr_times_clients" (N
            times it, PFLlib, which offsets the 1/N share p_ii of the core's gradient).
        p_init: "samples" (p_0: the clients' shares of the training samples) [code: authors] or
            "uniform" (1/N) [code: PFLlib]; the proximal centre is p_0 either way.
        dr_gradient: "exact" (<g, w_j>, autograd's in the authors' code) or "layer_mean" (PFLlib).
        """
        dr_lr: float = Field(0.001, ge=0, description="eta_p: step size of the DR vector p_i",
                             json_schema_extra=float_range(1e-4, 1e-1, log=True))
        mu: float = Field(0.1, ge=0, description="proximal coefficient of mu ||p_i - p_0||^2",
                          json_schema_extra=float_range(0.01, 1.0, log=True))
        scheduler: Literal["exponential", "cosine"] = Field("exponential", description="shape of lambda(r)")
        decay_fraction: float = Field(0.1, ge=0, le=1, description="L: lambda decays to 0 over the first L*T rounds")
        constraint: Literal["none", "simplex"] = Field("none", description="keep p_i unconstrained or on the simplex")
        core_lr: Literal["lr", "lr_times_clients"] = Field(
            "lr", description="step size of the own core: the config's lr, or N times it (PFLlib)")
        p_init: Literal["samples", "uniform"] = Field("samples", description="p_i's start: p_0 (samples) or 1/N")
        dr_gradient: Literal["exact", "layer_mean"] = Field(
            "exact", description="dCE/dp_j: <g, w_j> (exact), or the mean over layers of mean(g * w_j) (PFLlib)")

    @property
    def p0(self) -> np.ndarray:
        """p_0: every client's share of all training samples."""
        counts = np.asarray(self.setup.train_counts, dtype=np.float64).sum(axis=1)
        return counts / counts.sum()

    def init_server(self, params: Params) -> dict[str, Any]:
        initial = clone(params)
        return {"cores": [initial] * self.setup.num_clients}

    def init_client(self, cid: int, params: Params) -> dict[str, Any]:
        n = self.setup.num_clients
        start = self.p0 if self.hyper.p_init == "samples" else np.full(n, 1.0 / n)
        return {"core": clone(params), "p": torch.tensor(start, dtype=torch.float32), "personal": clone(params)}

    def broadcast(self, rnd: int, server: dict, cids: list[int]) -> dict[int, Message]:
        cores = server["cores"]
        return {cid: {"cores": {j: core for j, core in enumerate(cores) if j != cid}} for cid in cids}

    def client_update(self, rnd: int, cid: int, client: dict, message: Message, data: ClientData) -> ClientUpdate:
        h, n = self.hyper, self.setup.num_clients
        others = {int(j): core for j, core in message["cores"].items()}
        extra = {core_prefix(j) + name: t for j, core in others.items() for name, t in core.items()}
        extra[DR] = client["p"]
        pull = loss_scheduler(rnd, self.setup.rounds, h.decay_fraction, h.scheduler) * h.mu
        step = partial(apple_step, own=cid, num_clients=n, dr_lr=h.dr_lr, pull=pull, p0=tuple(self.p0.tolist()),
                       core_lr_scale=1.0 if h.core_lr == "lr" else float(n), constraint=h.constraint,
                       dr_gradient=h.dr_gradient)
        trained = yield Fit(client["core"], step=step, extra=extra)
        core = {name: trained[name] for name in client["core"]}
        p = trained[DR]
        cores = [core if j == cid else others[j] for j in range(n)]
        return {"core": core, "p": p, "personal": mixture(cores, p)}, {"core": core, "weight": data.n_train}

    def aggregate(self, rnd: int, server: dict, replies: dict[int, Message]) -> dict[str, Any]:
        cores = list(server["cores"])
        for cid, reply in replies.items():
            cores[cid] = reply["core"]
        return {"cores": cores}

    def client_model(self, cid: int, server: dict, client: dict) -> Params:
        return client["personal"]

    def trained_model(self, cid: int, client: dict, params: Params) -> Params:
        return client["personal"]

    def joining_model(self, cid: int, server: dict, client: dict, data: ClientData) -> Params:
        """A newcomer has no DR vector of its own yet: the p_0 mix of the current cores [ours]."""
        return mixture(server["cores"], torch.tensor(self.p0))
