"""Floco (Grinwald, Wiesner, Nakajima, *Federated Learning over Connected Modes*, NeurIPS 2024,
arXiv:2403.03333): a solution simplex over the output layer, each client training a subregion.

The output layer's weight has M copies W_0..W_{M-1}, the vertices of a simplex; a point alpha of
the standard simplex is the layer W(alpha) = sum_m alpha_m W_m (the bias and the body are single,
as in FL-bench's SimplexLinear). W_0 takes the place of the model's output weight, W_1..W_{M-1}
travel as `Fit.extra` tensors "vertex.m". Every vertex starts Xavier-normal, W_m drawn under the
seed `seed + m` (the authors' code, in FL-bench and their Flower baseline; `vertex_init`). Each
mini-batch of local training (a custom `Fit.step`):

    alpha ~ R_i;   g = grad_W L(W(alpha));   W_m <- W_m - lr alpha_m g;   other parameters: plain SGD  (1)

R_i is the whole simplex (alpha ~ Dirichlet(1, ..., 1)) until the projection, then the L1 ball of
radius rho around the client's point beta_i, sampled as FL-bench does: beta_i + r u, r ~ U(0, rho),
u = v / ||v||_1 with v ~ U(-1, 1)^M (such a draw may leave the simplex). The server averages every
parameter and vertex (n_i weights). At the end of round `projection_round`, the participants'
trained vertices (their "gradient signature"; a common shift does not change principal
components, so trained weights and updates give the same points) are reduced to M principal
components kappa_i, projected onto the simplex of radius z (Euclidean projection) and renormalised:

    beta_i(z) = P_z(kappa_i) / ||P_z(kappa_i)||_1,   z* = argmin_{z in linspace(1e-4, 1, 1000)} E(beta(z))   (2)
    E(beta) = log( sum_{i<j} 1 / max(||beta_i - beta_j||, 1e-4)^2 ) - log #pairs   (Riesz 2-energy)       (3)

A client is evaluated at its point beta_i (before the projection, or never projected: at the
centre, 1/M each). M = 1 is FedAvg: the model's own output weight, nothing drawn or sampled, the
plain Fit.

Client state: none. Communication: down the model + M - 1 extra output weights (+ beta_i once
projected), up the same model-sized tensors + n_i.
"""
from __future__ import annotations

from functools import partial
from typing import Any, Literal

import numpy as np
import torch
from pydantic import Field

from pfedkit.algorithms import clusters
from pfedkit.algorithms.registry import register
from pfedkit.core.aggregation import fedavg_aggregate
from pfedkit.core.contract import Algorithm, Batch, ClientData, ClientUpdate, Fit, HyperParams, Message, StepTools
from pfedkit.core.errors import ConfigError
from pfedkit.core.params import Params, clone, linear_layer_names, select
from pfedkit.core.search import float_range, int_range
from pfedkit.core.seeds import torch_generator

VERTEX = "vertex."  # Fit.extra / server names of vertices 1..M-1 (vertex 0 is the model's output weight)
Z_GRID = np.linspace(1e-4, 1.0, 1000)  # simplex radii tried by the projection (eq. 2) [code: FL-bench]
MIN_DISTANCE = 1e-4  # distances below count as this in the Riesz energy (eq. 3) [code: FL-bench]


# ---------------------------------------------------------------------------------------------
# The simplex
# ---------------------------------------------------------------------------------------------

def vertex_names(weight_name: str, count: int) -> list[str]:
    """The names of W_0..W_{count-1}: the model's output weight, then the extras."""
    return [weight_name] + [f"{VERTEX}{m}" for m in range(1, count)]


def xavier_vertex(like: torch.Tensor, seed: int) -> torch.Tensor:
    """A vertex drawn Xavier-normal (std sqrt(2 / (fan_in + fan_out))) from a generator seeded
    with `seed`: the draw of torch.manual_seed(seed); xavier_normal_ in the authors' code."""
    return torch.nn.init.xavier_normal_(torch.zeros_like(like), generator=torch.Generator().manual_seed(seed))


def simplex_weight(params: Params, names: list[str], alpha) -> torch.Tensor:
    """W(alpha) = sum_m alpha_m W_m, summed in vertex order."""
    total = float(alpha[0]) * params[names[0]]
    for a, name in zip(alpha[1:], names[1:]):
        total = total + float(a) * params[name]
    return total


class RegionSampler:
    """One alpha per call: Dirichlet(1, ..., 1) over the simplex when `centre` is None, else
    FL-bench's draw around `centre` (module docstring). Draws from its own seeded generator, so a
    request sent to a worker process draws the same sequence."""

    def __init__(self, generator: torch.Generator, count: int, centre: torch.Tensor | None, radius: float) -> None:
        self.generator, self.count, self.centre, self.radius = generator, count, centre, radius

    def __call__(self) -> list[float]:
        uniform = torch.rand(self.count, generator=self.generator, dtype=torch.float64)
        if self.centre is None:
            exponential = -torch.log1p(-uniform)  # Exp(1) draws, normalised: uniform on the simplex
            return (exponential / exponential.sum()).tolist()
        direction = 2 * uniform - 1
        direction = direction / direction.abs().sum()
        r = self.radius * torch.rand((), generator=self.generator, dtype=torch.float64)
        return (self.centre.double() + r * direction).tolist()


def floco_step(tools: StepTools, batches: list[Batch], *, sampler: RegionSampler, vertices: list[str]) -> float:
    """Eq. (1) on one mini-batch: the loss at W(alpha); each vertex moves by alpha_m times the
    gradient of the output weight, every other trainable parameter by its plain SGD step."""
    (batch,) = batches
    params, alpha = tools.params, sampler()
    loss, grads = tools.loss_and_grad(batch, at={**params, vertices[0]: simplex_weight(params, vertices, alpha)})
    with torch.no_grad():
        for name in tools.trainable:
            if name != vertices[0]:
                params[name].add_(grads[name], alpha=-tools.lr)
        for a, name in zip(alpha, vertices):
            params[name].add_(grads[vertices[0]], alpha=-tools.lr * a)
    return float(loss)


# ---------------------------------------------------------------------------------------------
# The projection (eqs. 2-3)
# ---------------------------------------------------------------------------------------------

def principal_scores(signatures: np.ndarray, count: int) -> np.ndarray:
    """[m, count] PCA scores of the rows (centred, SVD); each component's sign makes the largest
    |loading| positive (as scikit-learn's PCA); components beyond the rank are 0."""
    centred = signatures - signatures.mean(axis=0)
    u, s, vt = np.linalg.svd(centred, full_matrices=False)
    signs = np.sign(vt[np.arange(len(vt)), np.abs(vt).argmax(axis=1)])
    scores = (u * s * signs)[:, :count]
    return np.pad(scores, ((0, 0), (0, count - scores.shape[1])))


def project_onto_simplex(points: np.ndarray, radius: float) -> np.ndarray:
    """Each row's Euclidean projection onto {b >= 0, sum b = radius} (Duchi et al. 2008)."""
    ordered = -np.sort(-points, axis=1)
    excess = np.cumsum(ordered, axis=1) - radius
    ranks = np.arange(1, points.shape[1] + 1)
    support = (ordered - excess / ranks > 0).sum(axis=1)
    threshold = excess[np.arange(len(points)), support - 1] / support
    return np.maximum(points - threshold[:, None], 0.0)


def riesz_log_energy(points: np.ndarray) -> float:
    """Eq. (3): log of the mean inverse squared distance over pairs (distances floored at 1e-4)."""
    upper = np.triu_indices(len(points), 1)
    distances = np.sqrt(((points[:, None] - points[None]) ** 2).sum(axis=2))[upper]
    return float(np.log((1.0 / np.maximum(distances, MIN_DISTANCE) ** 2).sum()) - np.log(len(distances)))


def client_points(signatures: np.ndarray, count: int) -> np.ndarray:
    """beta [m, count] of eq. (2): the renormalised projections of the PCA scores whose Riesz
    energy is the lowest over Z_GRID (the first such radius); fewer than two clients: the centre."""
    if len(signatures) < 2:
        return np.full((len(signatures), count), 1.0 / count)
    scores = principal_scores(signatures, count)
    best, best_energy = None, np.inf
    for radius in Z_GRID:
        projected = project_onto_simplex(scores, radius)
        projected = projected / projected.sum(axis=1, keepdims=True)
        energy = riesz_log_energy(projected)
        if np.isfinite(energy) and energy < best_energy:
            best, best_energy = projected, energy
    return best


# ---------------------------------------------------------------------------------------------
# The algorithm
# ---------------------------------------------------------------------------------------------

@register
class Floco(Algorithm):
    name = "floco"
    description = "Floco: a simplex of output layers; clients train subregions around points projected from their updates"
    evaluated_model = "custom"  # the model with the output weight at the client's point of the simplex
    quick_test_options = {"num_endpoints": 3, "projection_round": 1}  # the projection in the tests' short runs

    class Hyper(HyperParams):
        """Floco options [code: FL-bench's defaults, contributed by the authors]: M = 10 vertices,
        points projected once at round tau = 10, subregion radius rho = 0.1. Floco+ (a Ditto-style
        personal simplex) is not implemented."""
        num_endpoints: int = Field(10, ge=1, description="M: vertices of the simplex of output layers (1: FedAvg)",
                                   json_schema_extra=int_range(2, 20))
        projection_round: int = Field(10, ge=1, description="tau: the round whose participants' trained vertices "
                                      "give the clients' points of the simplex")
        radius: float = Field(0.1, ge=0, description="rho: L1 radius of a client's subregion around its point",
                              json_schema_extra=float_range(0.01, 0.5, log=True))
        vertex_init: Literal["xavier_normal", "pytorch"] = Field(
            "xavier_normal", description="how the vertices start: xavier_normal, W_m drawn under seed + m (the "
            "authors' code); pytorch: W_0 the model's own output weight, the others PyTorch's default "
            "initialisation under seeds of their own")

    def check(self) -> None:
        try:
            self.output_weight()
        except ValueError as err:
            raise ConfigError(f"floco: the simplex is over the output layer, which must be one Linear layer ({err}); "
                              "use head_split=last") from None

    def output_weight(self) -> str:
        return linear_layer_names(select(self.setup.ops.initial_params(), "head"), "head")[0]

    def vertices(self) -> list[str]:
        return vertex_names(self.output_weight(), self.hyper.num_endpoints)

    # --- state -------------------------------------------------------------------------------

    def init_server(self, params: Params) -> dict[str, Any]:
        """The model with its output weight replaced by vertex 0, and the other vertices (M = 1:
        the model unchanged)."""
        if self.hyper.num_endpoints == 1:
            return {"params": clone(params), "points": None}
        vertices = dict(zip(self.vertices(), self.initial_vertices(params)))
        return {"params": {**clone(params), **vertices}, "points": None}

    def initial_vertices(self, params: Params) -> list[torch.Tensor]:
        """W_0..W_{M-1}: Xavier-normal under seed + m; or (vertex_init="pytorch") the run's
        initial output weight, then the output weights of models re-initialised under seeds of
        their own (`clusters.seeded_models`)."""
        weight, count = self.output_weight(), self.hyper.num_endpoints
        if self.hyper.vertex_init == "xavier_normal":
            return [xavier_vertex(params[weight], self.setup.seed + m) for m in range(count)]
        models = clusters.seeded_models(self.setup.ops.build, params, count, self.setup.seed, "floco-vertex")
        return [models[m][weight] for m in range(count)]

    # --- round -------------------------------------------------------------------------------

    def broadcast(self, rnd: int, server: dict, cids: list[int]) -> dict[int, Message]:
        messages = {cid: {"params": server["params"]} for cid in cids}
        for cid in cids:
            point = self.point(server, cid)
            if point is not None:
                messages[cid]["point"] = point
        return messages

    def client_update(self, rnd: int, cid: int, client: Any, message: Message, data: ClientData) -> ClientUpdate:
        if self.hyper.num_endpoints == 1:
            trained = yield Fit(message["params"])
            return client, {"params": trained, "weight": data.n_train}
        received = message["params"]
        model = {name: t for name, t in received.items() if not name.startswith(VERTEX)}
        extra = {name: t for name, t in received.items() if name.startswith(VERTEX)}
        sampler = RegionSampler(torch_generator(self.setup.seed, rnd, cid, "floco-alpha"), self.hyper.num_endpoints,
                                message.get("point"), self.hyper.radius)
        trained = yield Fit(model, extra=extra, step=partial(floco_step, sampler=sampler, vertices=self.vertices()))
        return client, {"params": trained, "weight": data.n_train}

    def aggregate(self, rnd: int, server: dict, replies: dict[int, Message]) -> dict[str, Any]:
        """The n_i-weighted mean of every parameter and vertex; at round tau, the points (eq. 2)."""
        if not replies:
            return server
        points = server["points"]
        if rnd == self.hyper.projection_round and self.hyper.num_endpoints > 1:
            points = self.projected_points(rnd, replies)
        return {"params": fedavg_aggregate(replies), "points": points}

    def projected_points(self, rnd: int, replies: dict[int, Message]) -> np.ndarray:
        """[N, M] points of the participants (NaN rows for the other clients)."""
        ordered, names = sorted(replies), self.vertices()
        signatures = np.stack([torch.cat([replies[c]["params"][n].reshape(-1) for n in names]).double().numpy()
                               for c in ordered])
        points = np.full((self.setup.num_clients, self.hyper.num_endpoints), np.nan)
        points[ordered] = client_points(signatures, self.hyper.num_endpoints)
        self.record(rnd, "floco_points", points.copy())
        return points

    def point(self, server: dict, cid: int) -> torch.Tensor | None:
        """beta_i, or None before the projection and for a client that was not projected."""
        points = server["points"]
        if points is None or np.isnan(points[cid]).any():
            return None
        return torch.as_tensor(points[cid])

    def client_model(self, cid: int, server: dict, client: Any) -> Params:
        """The model with the output weight at beta_i (the centre of the simplex when it has none)."""
        params = server["params"]
        model = {name: t for name, t in params.items() if not name.startswith(VERTEX)}
        if self.hyper.num_endpoints == 1:
            return model
        point = self.point(server, cid)
        alpha = [1.0 / self.hyper.num_endpoints] * self.hyper.num_endpoints if point is None else point.tolist()
        vertices = self.vertices()
        return {**model, vertices[0]: simplex_weight(params, vertices, alpha)}
