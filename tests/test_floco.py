"""Floco: one vertex is FedAvg, the sampled points (whole simplex, then the subregion), the local
step against a hand computation, the projection (PCA, simplex projection, Riesz energy), the
server's mean and points, the evaluated output weight, and a digits run."""
from __future__ import annotations

import math
from functools import partial

import numpy as np
import pytest
import torch
from conftest import TinyNet, final_state, num_parameters, tiny_params
from sklearn.decomposition import PCA
from torch import nn
from torch.func import functional_call

import pfedkit
from pfedkit.algorithms.floco import (Floco, RegionSampler, client_points, floco_step, principal_scores,
                                      project_onto_simplex, riesz_log_energy)
from pfedkit.core.contract import ClientData, Setup
from pfedkit.core.model_ops import ModelOps
from pfedkit.core.seeds import torch_generator
from pfedkit.engine.trainer import FitJob, LocalTrainer, TrainSettings, batch_schedule

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def algorithm(num_clients: int = 4, seed: int = 0, **options) -> Floco:
    setup = Setup(num_clients, 3, np.ones((num_clients, 3)), seed, 1, ModelOps(TinyNet))
    return Floco(Floco.Hyper(**{"num_endpoints": 3, **options}), setup)


def test_one_vertex_gives_the_metrics_of_fedavg(small_config):
    config = {**small_config, "join_ratio": 0.75}
    fedavg = pfedkit.run({**config, "out_dir": config["out_dir"] + "-fedavg"}).metrics
    floco = pfedkit.run({**config, "algorithm": "floco", "floco": {"num_endpoints": 1, "projection_round": 1}}).metrics
    for column in ["round", "client", "accuracy", "loss", "train_loss", "bytes_up", "bytes_down"]:
        np.testing.assert_array_equal(floco[column].to_numpy(), fedavg[column].to_numpy(), err_msg=column)


def test_vertices_start_xavier_normal_under_seed_plus_m_as_the_authors_code():
    server = algorithm(seed=7).init_server(tiny_params(0))["params"]
    for m, name in enumerate(["head.weight", "vertex.1", "vertex.2"]):
        torch.manual_seed(7 + m)  # the authors' draw: fan_in 4, fan_out 3
        expected = torch.empty(3, 4).normal_(0.0, math.sqrt(2.0 / (4 + 3)))
        torch.testing.assert_close(server[name], expected, rtol=0, atol=0, msg=name)
    assert torch.equal(server["body.0.weight"], tiny_params(0)["body.0.weight"])


def test_pytorch_vertices_start_from_the_model_output_weight_and_seeded_reinitialisations():
    params = tiny_params(0)
    server = algorithm(seed=7, vertex_init="pytorch").init_server(params)["params"]
    assert torch.equal(server["head.weight"], params["head.weight"])
    again = algorithm(seed=7, vertex_init="pytorch").init_server(params)["params"]
    other = algorithm(seed=8, vertex_init="pytorch").init_server(params)["params"]
    for name in ["vertex.1", "vertex.2"]:
        assert torch.equal(server[name], again[name]) and not torch.equal(server[name], other[name])
        assert not torch.equal(server[name], params["head.weight"])
    assert not torch.equal(server["vertex.1"], server["vertex.2"])


def test_points_are_drawn_on_the_simplex_then_around_the_client_point():
    whole = RegionSampler(torch.Generator().manual_seed(0), 4, None, 0.1)
    draws = np.array([whole() for _ in range(4000)])
    assert (draws >= 0).all() and np.allclose(draws.sum(axis=1), 1.0)
    np.testing.assert_allclose(draws.mean(axis=0), 0.25, atol=0.01)  # Dirichlet(1): mean 1/M
    np.testing.assert_allclose(draws[:, 0].var(), 3 / (16 * 5), rtol=0.1)  # var = (M-1) / (M^2 (M+1))
    centre = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    ball = RegionSampler(torch.Generator().manual_seed(1), 4, centre, 0.1)
    offsets = np.array([ball() for _ in range(2000)]) - centre.numpy()
    l1 = np.abs(offsets).sum(axis=1)
    assert l1.max() <= 0.1 + 1e-12 and l1.min() < 0.01 and l1.max() > 0.09  # radius r ~ U(0, rho)
    generator = torch.Generator().manual_seed(2)
    v = 2 * torch.rand(4, generator=generator, dtype=torch.float64) - 1
    r = 0.1 * torch.rand((), generator=generator, dtype=torch.float64)
    expected = centre + r * v / v.abs().sum()  # FL-bench's draw: centre + r * (v / ||v||_1)
    np.testing.assert_allclose(RegionSampler(torch.Generator().manual_seed(2), 4, centre, 0.1)(), expected.numpy())


def grad_at(params, x, y):
    point = {k: v.detach().requires_grad_(True) for k, v in params.items()}
    loss = nn.functional.cross_entropy(functional_call(TinyNet(), point, (x,)), y)
    return dict(zip(point, torch.autograd.grad(loss, list(point.values()))))


def test_local_steps_match_a_hand_computation():
    lr, names = 0.3, ["head.weight", "vertex.1", "vertex.2"]
    algo = algorithm()
    g = torch.Generator().manual_seed(4)
    x, y = torch.randn(8, 3, generator=g), torch.randint(0, 3, (8,), generator=g)
    data = ClientData(0, x, y, x[:2], y[:2], np.bincount(y.numpy(), minlength=3))
    server = algo.init_server(tiny_params(0))
    update = algo.client_update(1, 0, None, algo.broadcast(1, server, [0])[0], data)
    fit = next(update)
    assert set(fit.extra) == {"vertex.1", "vertex.2"} and fit.step.keywords["vertices"] == names
    settings = TrainSettings(local_epochs=1, batch_size=4, lr=lr, seed=3)
    trained = LocalTrainer(TinyNet, settings).fit(FitJob(1, 0, 0, fit, None), x, y).params

    w = {**fit.params, **fit.extra}
    draws = RegionSampler(torch_generator(0, 1, 0, "floco-alpha"), 3, None, 0.1)  # the client's own draws
    schedule = batch_schedule(fit, settings, len(y), torch_generator(settings.seed, 1, 0, "fit-0"))
    assert len(schedule) == 2
    for batch in schedule:
        alpha = draws()
        mixed = sum(a * w[n] for a, n in zip(alpha, names))
        grads = grad_at({**{n: t for n, t in w.items() if not n.startswith("vertex")}, "head.weight": mixed},
                        x[batch], y[batch])
        w = {n: (t - lr * grads[n] if n in grads and n != "head.weight" else t) for n, t in w.items()}
        w.update({n: w[n] - lr * a * grads["head.weight"] for a, n in zip(alpha, names)})
    for name in w:
        torch.testing.assert_close(trained[name], w[name])


def test_simplex_projection_and_riesz_energy_by_hand():
    projected = project_onto_simplex(np.array([[0.5, 0.2, -0.1], [0.2, 0.3, 0.5], [3.0, 0.0, 0.0], [1.0, 1.0, 0.1]]), 1.0)
    shift = 0.4 / 3  # all three stay positive: each moves by (1 - 0.6) / 3
    np.testing.assert_allclose(projected, [[0.5 + shift, 0.2 + shift, -0.1 + shift], [0.2, 0.3, 0.5], [1.0, 0.0, 0.0],
                                           [0.5, 0.5, 0.0]])  # the last: support 2, threshold (2 - 1) / 2
    np.testing.assert_allclose(project_onto_simplex(np.array([[0.5, 0.2, -0.1]]), 0.5), [[0.4, 0.1, 0.0]])
    points = np.array([[1.0, 0.0], [0.0, 1.0], [0.5, 0.5]])  # squared distances 2, 0.5, 0.5
    assert riesz_log_energy(points) == pytest.approx(math.log((1 / 2 + 2 + 2) / 3))
    same = riesz_log_energy(np.array([[0.5, 0.5], [0.5, 0.5]]))
    assert same == pytest.approx(math.log(1e8))  # coincident points: the distance floor 1e-4


def test_pca_scores_are_scikit_learns_and_padded_beyond_the_rank():
    rng = np.random.default_rng(0)
    signatures = rng.normal(size=(6, 40))
    reference = PCA(n_components=4, svd_solver="full").fit_transform(signatures)
    ours = principal_scores(signatures, 4)
    np.testing.assert_allclose(ours, reference, atol=1e-10)  # signs too: the largest |loading| positive
    np.testing.assert_allclose(ours + 5.0, principal_scores(signatures + 5.0, 4) + 5.0)  # shift-invariant
    padded = principal_scores(signatures[:3], 5)
    assert padded.shape == (3, 5) and np.allclose(padded[:, 2:], 0.0, atol=1e-10)  # 3 clients: rank 2


def test_client_points_lie_on_the_simplex_at_the_lowest_energy_radius_and_keep_groups_together():
    rng = np.random.default_rng(1)
    base = rng.normal(size=(2, 30)) * 5
    signatures = np.concatenate([base[0] + 0.1 * rng.normal(size=(4, 30)), base[1] + 0.1 * rng.normal(size=(4, 30))])
    points = client_points(signatures, 3)
    assert points.shape == (8, 3) and (points >= 0).all() and np.allclose(points.sum(axis=1), 1.0)
    scores = principal_scores(signatures, 3)
    candidates = [project_onto_simplex(scores, radius) for radius in np.linspace(1e-4, 1.0, 1000)]
    energies = [riesz_log_energy(c / c.sum(axis=1, keepdims=True)) for c in candidates]
    best = candidates[int(np.argmin(energies))]
    np.testing.assert_array_equal(points, best / best.sum(axis=1, keepdims=True))
    assert 0 < np.argmin(energies) < 999  # an interior radius: the test tells the grid's ends apart
    distance = np.linalg.norm(points[:, None] - points[None], axis=2) + np.diag([np.inf] * 8)
    assert (distance.argmin(axis=1) // 4 == np.arange(8) // 4).all()  # each client's nearest shares its group
    np.testing.assert_array_equal(client_points(signatures[:1], 3), [[1 / 3, 1 / 3, 1 / 3]])


def test_server_averages_models_and_vertices_by_n_i_and_projects_at_tau():
    algo = algorithm(num_clients=3, projection_round=2)
    server = algo.init_server(tiny_params(0))
    replies = {c: {"params": {n: t + c + 1 for n, t in server["params"].items()}, "weight": w}
               for c, w in [(0, 10), (2, 30)]}
    first = algo.aggregate(1, server, replies)
    assert first["points"] is None and "floco_points" not in algo.diagnostics
    for name, tensor in server["params"].items():
        torch.testing.assert_close(first["params"][name], tensor + (10 * 1 + 30 * 3) / 40)
    second = algo.aggregate(2, first, replies)
    assert np.isnan(second["points"][1]).all() and np.allclose(second["points"][[0, 2]].sum(axis=1), 1.0)
    np.testing.assert_array_equal(algo.diagnostics["floco_points"][2], second["points"])
    message = algo.broadcast(3, second, [0, 1])
    assert "point" not in message[1] and torch.equal(message[0]["point"], torch.as_tensor(second["points"][0]))
    assert algo.aggregate(3, second, {}) is second


def test_client_is_evaluated_at_its_point_and_at_the_centre_before():
    algo = algorithm(num_clients=2)
    server = algo.init_server(tiny_params(0))
    vertices = [server["params"][n] for n in ("head.weight", "vertex.1", "vertex.2")]
    model = algo.client_model(0, server, None)
    assert set(model) == set(tiny_params(0))
    torch.testing.assert_close(model["head.weight"], sum(vertices) / 3)
    server["points"] = np.array([[0.7, 0.2, 0.1], [np.nan] * 3])
    torch.testing.assert_close(algo.client_model(0, server, None)["head.weight"],
                               0.7 * vertices[0] + 0.2 * vertices[1] + 0.1 * vertices[2])
    torch.testing.assert_close(algo.client_model(1, server, None)["head.weight"], sum(vertices) / 3)
    assert torch.equal(algo.client_model(0, server, None)["body.0.weight"], server["params"]["body.0.weight"])


def test_digits_run_learns_and_sends_the_vertices(small_config):
    config = {**small_config, "algorithm": "floco", "floco": {"num_endpoints": 3, "projection_round": 2}}
    result = pfedkit.run(config)
    metrics = result.metrics
    last = metrics[metrics["round"] == 3]
    assert last["correct"].sum() / last["n_test"].sum() > 0.3  # 10 classes
    state = final_state(result)
    model_bytes = 4 * num_parameters(state.server["params"])  # the model and the two extra vertices
    assert (metrics.loc[metrics["round"] <= 2, "bytes_down"] == model_bytes).all()
    assert (metrics.loc[metrics["round"] == 3, "bytes_down"] == model_bytes + 3 * 8).all()  # + beta_i
    assert (metrics["bytes_up"] == model_bytes + 8).all()
    points = state.server["points"]
    assert points.shape == (4, 3) and np.allclose(points.sum(axis=1), 1.0)
