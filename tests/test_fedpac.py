"""FedPAC: the client's statistics (V_i, h_i) from the received body, the alignment loss, the
count-weighted centroids, the simplex QP (against enumerated active sets and a grid), and the
combined heads the server hands back."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import learned_run, num_parameters
from torch import nn

from pfedkit.core.contract import ClientData, Forward, Setup
from pfedkit.algorithms.fedpac import (FedPAC, collaboration_matrix, collaboration_weights, feature_statistics,
                                       project_psd, simplex_kkt_residual, solve_simplex_qp, sparsify_weights)
from pfedkit.algorithms.prototypes import alignment_loss
from pfedkit.core.model_ops import ModelOps
from pfedkit.core.params import merge, select
from pfedkit.models.base import BodyHeadModel


def tiny_model() -> BodyHeadModel:
    return BodyHeadModel([("fc1", nn.Linear(3, 5)), ("relu", nn.ReLU()), ("fc", nn.Linear(5, 4))], "fc")


def tiny_algorithm(num_clients: int = 3, **hyper) -> FedPAC:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        ops = ModelOps(tiny_model)
    return FedPAC(FedPAC.Hyper(**hyper), Setup(num_clients, 4, np.ones((num_clients, 4)), seed=0, local_epochs=1, ops=ops))


def finish(update, value):
    try:
        update.send(value)
    except StopIteration as stop:
        return stop.value
    raise AssertionError("client_update asked for another Fit")


# -- the QP ---------------------------------------------------------------------------------------


def brute_force_simplex_qp(matrix: np.ndarray) -> np.ndarray:
    """Every support S: solve Q_SS a = lambda 1, 1^T a = 1; keep feasible points; best objective."""
    size, best, best_value = len(matrix), None, np.inf
    for k in range(1, size + 1):
        for support in itertools.combinations(range(size), k):
            s = list(support)
            system = np.block([[matrix[np.ix_(s, s)], -np.ones((k, 1))], [np.ones((1, k)), np.zeros((1, 1))]])
            rhs = np.r_[np.zeros(k), 1.0]
            try:
                solution = np.linalg.solve(system, rhs)
            except np.linalg.LinAlgError:
                continue
            if (solution[:k] < -1e-12).any():
                continue
            alpha = np.zeros(size)
            alpha[s] = solution[:k]
            value = alpha @ matrix @ alpha
            if value < best_value - 1e-14:
                best, best_value = alpha, value
    return best


def random_psd(size: int, rank: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    factor = rng.normal(size=(rank, size)) + rng.normal(size=(1, size)) * 2  # shared offset: corners likely
    return factor.T @ factor + np.diag(rng.uniform(0.01, 0.3, size))


@pytest.mark.parametrize("seed", range(8))
def test_qp_matches_enumerated_active_sets_and_a_grid_on_three_clients(seed):
    matrix = random_psd(3, 2, seed)
    alpha = solve_simplex_qp(matrix)
    np.testing.assert_allclose(alpha, brute_force_simplex_qp(matrix), atol=1e-8)
    assert simplex_kkt_residual(matrix / np.diag(matrix).max(), alpha) < 1e-9
    grid = np.array([(a, b, 1 - a - b) for a in np.linspace(0, 1, 201) for b in np.linspace(0, 1, 201) if a + b <= 1])
    assert alpha @ matrix @ alpha <= np.einsum("ki,ij,kj->k", grid, matrix, grid).min() + 1e-12


def test_qp_boundary_solution_and_kkt_for_twenty_clients():
    matrix = np.diag([1.0, 4.0, 9.0])  # optimum ∝ 1/diag: interior
    np.testing.assert_allclose(solve_simplex_qp(matrix), np.array([36, 9, 4]) / 49, atol=1e-10)
    corner = np.array([[1.0, 2.0, 2.0], [2.0, 5.0, 3.0], [2.0, 3.0, 5.0]])  # e_0 is optimal (g >= g_0)
    np.testing.assert_allclose(solve_simplex_qp(corner), [1.0, 0.0, 0.0], atol=1e-10)
    big = random_psd(20, 4, 11) * 1e-3  # scale must not matter
    alpha = solve_simplex_qp(big)
    assert simplex_kkt_residual(big / np.diag(big).max(), alpha) < 1e-9 and (alpha == 0).any()
    assert solve_simplex_qp(np.zeros((3, 3))) is None and solve_simplex_qp(np.full((2, 2), np.nan)) is None


def test_psd_projection_drops_small_eigenvalues_only_when_the_matrix_is_not_psd():
    psd = random_psd(4, 2, 3)
    np.testing.assert_allclose(project_psd(psd), psd)
    vectors, _ = np.linalg.qr(np.random.default_rng(0).normal(size=(3, 3)))
    matrix = vectors @ np.diag([-0.5, 0.005, 2.0]) @ vectors.T
    np.testing.assert_allclose(project_psd(matrix), 2.0 * np.outer(vectors[:, 2], vectors[:, 2]), atol=1e-12)


def test_small_weights_are_zeroed_and_the_rest_renormalised():
    np.testing.assert_allclose(sparsify_weights(np.array([0.5, 0.4995, 0.0005])), [0.5 / 0.9995, 0.4995 / 0.9995, 0.0])


# -- client statistics and loss -------------------------------------------------------------------


def test_feature_statistics_follow_the_spec_formula():
    features = torch.tensor([[1.0, 2.0], [3.0, 0.0], [0.0, 1.0], [2.0, 2.0], [4.0, 1.0]])
    labels = torch.tensor([0, 0, 2, 2, 2])
    variance, weighted = feature_statistics(features, labels, 3)
    n, expected_v, expected_h = 5, 0.0, torch.zeros(3, 2, dtype=torch.float64)
    for c in (0, 2):
        rows = features[labels == c].double()
        prior, mean = len(rows) / n, rows.mean(0)
        expected_h[c] = prior * mean
        expected_v += prior * (rows ** 2).sum(1).mean() - prior ** 2 * (mean ** 2).sum()
    torch.testing.assert_close(weighted, expected_h)
    torch.testing.assert_close(variance, expected_v / n)


def test_collaboration_matrix_is_diag_v_plus_d_i():
    rng = torch.Generator().manual_seed(0)
    h = torch.randn(3, 4, 2, generator=rng, dtype=torch.float64)
    v = torch.tensor([0.3, 0.1, 0.7], dtype=torch.float64)
    for i in range(3):
        expected = np.diag(v.numpy()).copy()
        for j, k in itertools.product(range(3), repeat=2):
            expected[j, k] += sum(float((h[i, c] - h[j, c]) @ (h[i, c] - h[k, c])) for c in range(4))
        np.testing.assert_allclose(collaboration_matrix(i, v, h), expected, rtol=1e-12)


def test_alignment_is_zero_at_the_centroids_and_absent_classes_contribute_nothing():
    centroids = torch.tensor([[1.0, 2.0], [float("nan")] * 2, [0.0, -1.0]])  # class 1: no centroid
    y = torch.tensor([0, 1, 2, 1])
    logits = torch.randn(4, 3)
    features = torch.stack([centroids[0], torch.tensor([5.0, 5.0]), centroids[2], torch.tensor([-3.0, 1.0])])
    features.requires_grad_(True)
    context = {"prototypes": centroids}
    loss = alignment_loss(Forward(features, logits), y, {}, context, lambda_f=2.0)
    torch.testing.assert_close(loss, F.cross_entropy(logits, y))
    moved = features.detach() + torch.tensor([[1.0, 0.0], [9.0, 9.0], [0.0, 0.0], [9.0, 9.0]])
    loss = alignment_loss(Forward(moved, logits), y, {}, context, lambda_f=2.0)
    torch.testing.assert_close(loss, F.cross_entropy(logits, y) + 2.0 * 1.0 / (4 * 2))  # mean over B*d


# -- client round -----------------------------------------------------------------------------------


def test_client_statistics_use_the_received_body_then_head_and_body_phases_then_centroids():
    algo = tiny_algorithm(lam=0.5, head_epochs=2, head_lr=0.3)
    initial = algo.setup.ops.initial_params()
    x, y = torch.randn(12, 3, generator=torch.Generator().manual_seed(1)), torch.tensor([0, 1, 3] * 4)
    data = ClientData(0, x, y, x[:2], y[:2], np.array([4, 4, 0, 4]))
    centroids = torch.randn(4, 5)
    own_head = {name: value + 1 for name, value in select(initial, "head").items()}
    message = {"body": select(initial, "body"), "centroids": centroids}
    update = algo.client_update(2, 0, {"head": own_head}, message, data)
    head_fit = next(update)
    assert (head_fit.trainable, head_fit.epochs, head_fit.lr, head_fit.optimizer) == ("head", 2, 0.3, "head")
    assert all(torch.equal(head_fit.params[n], v) for n, v in own_head.items())  # no combined head yet: own head
    body_fit = update.send(head_fit.params)
    assert (body_fit.trainable, body_fit.optimizer, body_fit.loss.keywords) == ("body", "body", {"lambda_f": 0.5})
    assert body_fit.context["prototypes"] is centroids
    trained = {name: value * 0.5 for name, value in body_fit.params.items()}
    state, reply = finish(update, trained)

    received_features = algo.setup.ops.features(merge(message["body"], own_head), x)
    variance, weighted = feature_statistics(received_features, y, 4)
    torch.testing.assert_close(reply["variance"], variance.float())
    torch.testing.assert_close(reply["weighted_means"], weighted.float())
    trained_features = algo.setup.ops.features(trained, x)
    torch.testing.assert_close(reply["prototypes"], torch.stack([trained_features[y == c].mean(0) for c in (0, 1, 3)]))
    assert reply["prototype_classes"].tolist() == [0, 1, 3] and reply["prototype_counts"].tolist() == [4, 4, 4]
    assert set(reply["body"]) == set(select(initial, "body")) and reply["weight"] == 12
    assert all(torch.equal(state["head"][n], trained[n]) for n in own_head)


# -- server -----------------------------------------------------------------------------------------


def reply_for(algo, body_value, head_value, variance, weighted, prototypes, classes, counts, n):
    initial = algo.setup.ops.initial_params()
    return {"body": {k: torch.full_like(v, body_value) for k, v in select(initial, "body").items()},
            "head": {k: torch.full_like(v, head_value) for k, v in select(initial, "head").items()},
            "weight": n, "variance": torch.tensor(variance), "weighted_means": weighted,
            "prototypes": prototypes, "prototype_classes": torch.tensor(classes), "prototype_counts": torch.tensor(counts)}


def test_server_centroids_are_count_weighted_and_bodies_are_fedavg():
    algo = tiny_algorithm()
    weighted = torch.zeros(4, 5)
    replies = {0: reply_for(algo, 1.0, 0.0, 0.1, weighted, torch.ones(2, 5), [0, 2], [1, 6], 7),
               2: reply_for(algo, 4.0, 1.0, 0.1, weighted, torch.full((1, 5), 4.0), [0], [3], 3)}
    server = algo.aggregate(1, algo.init_server(algo.setup.ops.initial_params()), replies)
    torch.testing.assert_close(server["centroids"][0], torch.full((5,), (1 * 1 + 3 * 4) / 4))  # uniform: 2.5
    torch.testing.assert_close(server["centroids"][2], torch.ones(5))
    assert torch.isnan(server["centroids"][[1, 3]]).all()  # nobody has classes 1, 3
    assert all(torch.allclose(v, torch.full_like(v, 0.7 * 1 + 0.3 * 4)) for v in server["body"].values())
    assert set(server["heads"]) == {0, 2}


def test_identical_clients_get_the_average_head_and_a_failed_solve_keeps_the_own_head():
    algo = tiny_algorithm()
    weighted = torch.randn(4, 5, generator=torch.Generator().manual_seed(3))
    prototypes = torch.ones(1, 5)
    replies = {cid: reply_for(algo, 0.0, float(cid), 0.2, weighted, prototypes, [0], [5], 5) for cid in range(3)}
    server = algo.aggregate(1, algo.init_server(algo.setup.ops.initial_params()), replies)
    for cid in range(3):
        assert all(torch.allclose(v, torch.full_like(v, 1.0)) for v in server["heads"][cid].values())  # (0+1+2)/3
    np.testing.assert_allclose(algo.diagnostics["fedpac_weights"][1], np.full((3, 3), 1 / 3))
    assert (collaboration_weights(torch.tensor([float("nan"), 0.2]), torch.zeros(2, 4, 5)) == np.eye(2)).all()


def test_combined_head_is_delivered_at_the_next_broadcast_and_used_by_client_model():
    algo = tiny_algorithm()
    initial = algo.setup.ops.initial_params()
    server = algo.init_server(initial)
    clients = [algo.init_client(c, initial) for c in range(3)]
    assert "head" not in algo.broadcast(1, server, [0])[0]
    assert all(torch.equal(algo.client_model(0, server, clients[0])[n], v) for n, v in initial.items())
    close, far = torch.zeros(4, 5), torch.full((4, 5), 3.0)
    replies = {0: reply_for(algo, 0.0, 1.0, 0.1, close, torch.ones(1, 5), [0], [5], 5),
               1: reply_for(algo, 0.0, 5.0, 0.1, close, torch.ones(1, 5), [0], [5], 5),
               2: reply_for(algo, 0.0, 9.0, 0.1, far, torch.ones(1, 5), [0], [5], 5)}
    server = algo.aggregate(1, server, replies)
    weights = algo.diagnostics["fedpac_weights"][1]
    np.testing.assert_allclose(weights[0], [0.5, 0.5, 0.0])  # the far client is left out
    message = algo.broadcast(2, server, [0])[0]
    assert all(torch.allclose(v, torch.full_like(v, 3.0)) for v in message["head"].values())
    assert all(torch.equal(algo.client_model(0, server, clients[0])[n], message["head"][n]) for n in message["head"])


def test_fedpac_learns_on_digits_with_spec_communication(small_config, tmp_path):
    config = {**small_config, "algorithm": "fedpac", "join_ratio": 0.75}
    sequential, metrics, state = learned_run(config)  # processes == sequential: tests/test_backends.py
    body, head = 4 * num_parameters(state.server["body"]), 4 * num_parameters(state.clients[0]["head"])
    c, d = state.server["centroids"].shape
    joined = metrics[(metrics["participated"] == 1)]
    first = joined[joined["round"] == 1]
    assert (first["bytes_down"] == body).all()  # round 1: body only (no combined head, no centroids)
    later = joined[(joined["round"] > 1)]
    # a client that already participated also gets its combined head
    assert set(later["bytes_down"]) <= {body + c * d * 4, body + head + c * d * 4}
    # up: body + head + n_i + V_i + h_i [C, d] + its classes' centroids, labels and counts
    assert ((joined["bytes_up"] - (body + head + 8 + 4 + c * d * 4)) % (d * 4 + 16) == 0).all()
    weights = state.diagnostics["fedpac_weights"]
    for matrix in weights.values():
        rows = matrix[~np.isnan(matrix).all(axis=1)]
        np.testing.assert_allclose(rows.sum(axis=1), 1.0)
