"""SuPerFed (Hahn, Jeong, Lee, *Connecting Low-Loss Subspace for Personalized Federated
Learning*, KDD 2022, arXiv:2109.07628; "SuPerFed-MM", and "-LM" with `mixing=layer`): a federated model w_f and a
personal model w_l joined by a line of low-loss models, w(lam) = (1 - lam) w_f + lam w_l.

Rounds 1..floor(L R) (`mix_start` = L, R the run's rounds) train the federated model alone
(lam = 0): FedAvg with the proximity term. From round floor(L R) + 1, each mini-batch of local
training (a custom `Fit.step`) draws lam ~ U(0, 1) and descends

    F(w_f, w_l) = CE(w(lam)) + mu P(w_f, w_g) + nu cos^2(w_f, w_l)                             (1)
    P = ||w_f - w_g||^2 ("squared"), or sum over tensors of ||w_f - w_g||_2 ("layer_norms", the code)
    cos(w_f, w_l) = <w_f, w_l> / (||w_f|| ||w_l||) over all parameters                         (2)

with w_g the downloaded federated model: grad_{w_f} = (1 - lam) g + grad of the regularisers,
grad_{w_l} = lam g + nu grad cos^2, g the gradient of CE at w(lam). The server averages w_f (n_i
weights); w_l never leaves the client (`Fit.extra` tensors "personal.<name>"; every parameter has
a personal copy, initialised under a seed of the client's own).

Client state: w_l and whether it trained in the mixing phase. Evaluated: w(lam_eval) of the
current federated model and w_l (lam_eval = 1: the personal end), the federated model for a
client that has not trained in the mixing phase. With lam fixed at 0 (`mix_start = 1`) and
mu = 0 it is FedAvg. Communication: the federated model down, it + n_i up.
"""
from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any, Literal

import torch
from pydantic import Field

from pfedkit.algorithms import clusters
from pfedkit.algorithms.registry import register
from pfedkit.core.aggregation import MeanOfUploads
from pfedkit.core.contract import (Algorithm, Batch, ClientData, ClientUpdate, Fit, Forward, HyperParams, Message,
                                   StepTools, cross_entropy)
from pfedkit.core.params import Params, clone, interpolate, squared_distance
from pfedkit.core.search import choices, float_range
from pfedkit.core.seeds import torch_generator

PERSONAL = "personal."  # prefix of w_l among a Fit's extra tensors


def proximity(federated: Params, anchor: Params, form: str) -> torch.Tensor:
    """P(w_f, w_g): ||w_f - w_g||^2 ("squared") or sum_tensors ||w_f - w_g||_2 ("layer_norms")."""
    if form == "squared":
        return squared_distance(federated, anchor)
    return sum(torch.linalg.vector_norm(federated[name] - anchor[name]) for name in anchor)


def squared_cosine(federated: Params, personal: Params) -> torch.Tensor:
    """cos^2(w_f, w_l) of eq. (2) over every entry: <w_f, w_l>^2 / (||w_f||^2 ||w_l||^2)."""
    inner = sum((federated[name] * personal[name]).sum() for name in federated)
    norms = (sum((federated[name] ** 2).sum() for name in federated)
             * sum((personal[name] ** 2).sum() for name in federated))
    return inner ** 2 / norms


def regulariser(federated: Params, personal: Params, anchor: Params, *, mu: float, nu: float,
                proximal: str) -> torch.Tensor:
    """mu P(w_f, w_g) + nu cos^2(w_f, w_l): the terms of eq. (1) besides the loss."""
    total = torch.zeros(())
    if mu:
        total = total + mu * proximity(federated, anchor, proximal)
    if nu:
        total = total + nu * squared_cosine(federated, personal)
    return total


def proximal_loss(out: Forward, y: torch.Tensor, params: Params, context: Mapping[str, Any], *, mu: float,
                  proximal: str) -> torch.Tensor:
    """CE + mu P(w_f, w_g), w_g = context["anchor"]: the federated model's loss before mixing."""
    loss = cross_entropy(out, y, params, context)
    if mu == 0:
        return loss
    return loss + mu * proximity(params, context["anchor"], proximal)


class LambdaSampler:
    """lam ~ U(0, 1) per call, from its own seeded generator (a request sent to a worker process
    draws the same sequence)."""

    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator

    def __call__(self) -> float:
        return float(torch.rand((), generator=self.generator, dtype=torch.float64))


def layer_of(name: str) -> str:
    """The module a parameter belongs to ("body.0.weight" -> "body.0")."""
    return name.rsplit(".", 1)[0]


def mixing_points(names: list[str], sampler: LambdaSampler, layerwise: bool) -> dict[str, float]:
    """lam of each parameter: one draw for the whole model (SuPerFed-MM), or one per layer in the
    order of `names` (SuPerFed-LM: a layer's weight and bias share theirs)."""
    if not layerwise:
        lam = sampler()
        return {name: lam for name in names}
    draws: dict[str, float] = {}
    for name in names:
        if layer_of(name) not in draws:
            draws[layer_of(name)] = sampler()
    return {name: draws[layer_of(name)] for name in names}


def regulariser_gradients(federated: Params, personal: Params, anchor: Params, *, mu: float, nu: float,
                          proximal: str) -> tuple[float, dict, dict]:
    """The regulariser's value and its gradients in w_f and in w_l (None where a term is off)."""
    with torch.enable_grad():
        f = {name: t.detach().requires_grad_(True) for name, t in federated.items()}
        p = {name: t.detach().requires_grad_(True) for name, t in personal.items()}
        penalty = regulariser(f, p, anchor, mu=mu, nu=nu, proximal=proximal)
        leaves = [*f.values(), *p.values()]
        if not penalty.requires_grad:  # mu = nu = 0
            return float(penalty), dict.fromkeys(f), dict.fromkeys(p)
        grads = torch.autograd.grad(penalty, leaves, allow_unused=True)
    return float(penalty.detach()), dict(zip(f, grads[:len(f)])), dict(zip(p, grads[len(f):]))


def superfed_step(tools: StepTools, batches: list[Batch], *, sampler: LambdaSampler, anchor: Params, mu: float,
                  nu: float, proximal: str, layerwise: bool = False) -> float:
    """One mini-batch of eq. (1): the loss at w(lam), its gradient split (1 - lam) / lam between
    w_f and w_l, plus the regularisers' gradients; plain SGD. Returns the objective's value."""
    (batch,) = batches
    params, names = tools.params, tools.trainable
    lams = mixing_points(names, sampler, layerwise)
    federated = {name: params[name] for name in names}
    personal = {name: params[PERSONAL + name] for name in names}
    mixed = {name: interpolate({name: federated[name]}, {name: personal[name]}, lams[name])[name] for name in names}
    loss, grad = tools.loss_and_grad(batch, at={**params, **mixed})
    penalty, extra_f, extra_p = regulariser_gradients(federated, personal, anchor, mu=mu, nu=nu, proximal=proximal)
    with torch.no_grad():
        for name in names:
            step_f, step_p = (1 - lams[name]) * grad[name], lams[name] * grad[name]
            if extra_f[name] is not None:
                step_f = step_f + extra_f[name]
            if extra_p[name] is not None:
                step_p = step_p + extra_p[name]
            federated[name].sub_(tools.lr * step_f)
            personal[name].sub_(tools.lr * step_p)
    return float(loss) + penalty


@register
class SuPerFed(MeanOfUploads, Algorithm):
    name = "superfed"
    description = "SuPerFed: federated and personal models joined by a trained line w(lam), lam ~ U(0, 1) per batch"
    evaluated_model = "custom"  # w(lam_eval) of the current federated model and the personal model
    # A point inside the line: the generic tests' evaluated model then depends on both of its ends
    # (at lam_eval = 1 it is the personal model alone, which the first round's Fit does not carry).
    quick_test_options = {"eval_lambda": 0.5}

    class Hyper(HyperParams):
        """SuPerFed options: model mixing (MM; layer: LM, one lam per layer), mu 0.01, nu 1 and
        L = 0.6 as the authors' MNIST example
        command; lam_eval = 1 (the personal end, as the authors' basic evaluation; their sweep
        reports the best of lam in {0, 0.1, ..., 1} on the test split); proximal: the squared
        distance [as the paper is read] or the code's sum of per-tensor norms."""
        mu: float = Field(0.01, ge=0, description="weight of the proximity term P(w_f, w_global)",
                          json_schema_extra=float_range(0.0001, 1.0, log=True))
        nu: float = Field(1.0, ge=0, description="weight of the orthogonality term cos^2(w_f, w_personal)",
                          json_schema_extra=float_range(0.1, 5.0, log=True))
        mix_start: float = Field(0.6, ge=0, le=1, description="L: the first floor(L * rounds) rounds train the "
                                 "federated model only (lam = 0)", json_schema_extra=float_range(0.0, 0.9))
        eval_lambda: float = Field(1.0, ge=0, le=1, description="lam of the evaluated model w(lam) "
                                   "(1: the personal model, 0: the federated one)")
        mixing: Literal["model", "layer"] = Field(
            "model", description="one lam per mini-batch for the whole model (SuPerFed-MM) or one per layer "
            "(SuPerFed-LM)", json_schema_extra=choices("model", "layer"))
        proximal: Literal["squared", "layer_norms"] = Field(
            "squared", description="P: ||w_f - w_g||^2 (the paper as read) or the sum of per-tensor L2 norms "
            "(the authors' code)",
            json_schema_extra=choices("squared", "layer_norms"))

    def mixing(self, rnd: int) -> bool:
        """Rounds after floor(L R) train the line (R unknown, 0: every round does)."""
        return rnd > int(self.hyper.mix_start * self.setup.rounds)

    def init_server(self, params: Params) -> dict[str, Any]:
        return {"params": clone(params)}

    def init_client(self, cid: int, params: Params) -> dict[str, Any]:
        """w_l: the model re-initialised under (seed, "superfed-personal-<cid>") [code: a client-seeded init]."""
        personal = clusters.seeded_models(self.setup.ops_for(cid).build, params, 2, self.setup.seed,
                                          f"superfed-personal-{cid}")[1]
        return {"personal": personal, "mixed": False}

    def broadcast(self, rnd: int, server: dict, cids: list[int]) -> dict[int, Message]:
        return {cid: {"params": server["params"]} for cid in cids}

    def client_update(self, rnd: int, cid: int, client: dict, message: Message, data: ClientData) -> ClientUpdate:
        anchor, h = message["params"], self.hyper
        if not self.mixing(rnd):
            trained = yield Fit(anchor, loss=partial(proximal_loss, mu=h.mu, proximal=h.proximal),
                                context={"anchor": anchor})
            return client, {"params": trained, "weight": data.n_train}
        sampler = LambdaSampler(torch_generator(self.setup.seed, rnd, cid, "superfed-lambda"))
        step = partial(superfed_step, sampler=sampler, anchor=anchor, mu=h.mu, nu=h.nu, proximal=h.proximal,
                       layerwise=h.mixing == "layer")
        trained = yield Fit(anchor, step=step, extra={PERSONAL + name: t for name, t in client["personal"].items()})
        personal = {name[len(PERSONAL):]: t for name, t in trained.items() if name.startswith(PERSONAL)}
        federated = {name: t for name, t in trained.items() if name in anchor}
        return {"personal": personal, "mixed": True}, {"params": federated, "weight": data.n_train}

    def client_model(self, cid: int, server: dict, client: dict) -> Params:
        if not client["mixed"]:
            return server["params"]
        return interpolate(server["params"], client["personal"], self.hyper.eval_lambda)

    def trained_model(self, cid: int, client: dict, params: Params) -> Params:
        """After local training: w(lam_eval) of the federated model just trained and the new w_l."""
        federated = {name: t for name, t in params.items() if not name.startswith(PERSONAL)}
        return interpolate(federated, client["personal"], self.hyper.eval_lambda) if client["mixed"] else federated
