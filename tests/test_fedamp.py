"""FedAMP: the attention weights xi (rows are distributions, guard, identical models), the cloud
models u_i against hand computations, the client's proximal training from its own model, the
server's store of latest models, and a short digits run (bytes, diagnostics, backends)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import pfedkit
from pfedkit.algorithms.fedamp import FedAMP, attention_row, squared_distances_to
from pfedkit.core.contract import ClientData, Setup
from pfedkit.report.methods import draw_diagnostics
from pfedkit.run_files import read_diagnostics
from tests.conftest import final_state, num_parameters

CONFIG = {"algorithm": "fedamp", "dataset": "digits", "num_clients": 4, "rounds": 3, "threads": 1,
          "batch_size": 20, "lr": 0.05, "seed": 3, "join_ratio": 0.75,
          "partition": {"scheme": "dirichlet", "alpha": 0.5}}


def fedamp(num_clients: int, **hyper) -> FedAMP:
    setup = Setup(num_clients=num_clients, num_classes=3, train_counts=np.ones((num_clients, 3)), seed=0,
                  local_epochs=1, ops=None)
    return FedAMP(FedAMP.Hyper(**hyper), setup)


def test_every_row_is_a_distribution_including_the_guard_case():
    rng = np.random.default_rng(0)
    guarded_seen = unguarded_seen = 0
    for _ in range(200):
        n = int(rng.integers(1, 8))
        distances = rng.exponential(rng.choice([0.01, 1.0, 100.0]), size=n)
        i = int(rng.integers(n))
        distances[i] = 0.0
        row, guarded = attention_row(distances, i, float(rng.choice([0.1, 1.0, 1000.0])),
                                     float(rng.choice([0.1, 1.0, 10.0])))
        assert (row >= 0).all() and row.sum() == pytest.approx(1.0, abs=1e-12)
        if guarded:
            assert row[i] == 0.0
        guarded_seen += guarded
        unguarded_seen += not guarded
    assert guarded_seen and unguarded_seen


def test_identical_models_give_alpha_over_sigma_off_the_diagonal():
    row, guarded = attention_row(np.zeros(5), 2, alpha_k=0.03, sigma=0.5)
    assert not guarded
    np.testing.assert_allclose(row, [0.06, 0.06, 1 - 4 * 0.06, 0.06, 0.06], rtol=1e-12)
    # cwFedAvg's defaults (alpha_K / sigma = 10^4): the guard splits the weight among the others
    row, guarded = attention_row(np.zeros(5), 2, alpha_k=1000.0, sigma=0.1)
    assert guarded
    np.testing.assert_allclose(row, [0.25, 0.25, 0.0, 0.25, 0.25], rtol=1e-12)


def test_far_models_underflow_to_no_attention():
    row, guarded = attention_row(np.array([0.0, 1e4, 5e3]), 0, alpha_k=1000.0, sigma=0.1)
    assert not guarded and row.tolist() == [1.0, 0.0, 0.0]


def test_squared_distances_cover_every_parameter_tensor():
    models = [{"a": torch.tensor([0.0, 0.0]), "b": torch.tensor([1.0])},
              {"a": torch.tensor([1.0, 2.0]), "b": torch.tensor([-1.0])},
              {"a": torch.tensor([0.0, 0.0]), "b": torch.tensor([1.0])}]
    np.testing.assert_array_equal(squared_distances_to(models, 0), [0.0, 1 + 4 + 4, 0.0])
    np.testing.assert_array_equal(squared_distances_to(models, 1), [9.0, 0.0, 9.0])


def hand_cloud_model(models: list[dict], i: int, alpha_k: float, sigma: float) -> tuple[list[float], dict, bool]:
    """xi_i., u_i and whether the guard acted, written out with Python floats."""
    d = [sum(float(((m[k] - models[i][k]) ** 2).sum()) for k in models[i]) for m in models]
    xi = [alpha_k * math.exp(-d[j] / sigma) / sigma if j != i else 0.0 for j in range(len(models))]
    guarded = sum(xi) > 1
    if guarded:
        xi = [x / sum(xi) for x in xi]
    else:
        xi[i] = 1 - sum(xi)
    u = {k: sum(xi[j] * models[j][k] for j in range(len(models))) for k in models[i]}
    return xi, u, guarded


@pytest.mark.parametrize("alpha_k, sigma", [(0.1, 2.0), (10.0, 1.0)])  # sum < 1 / guard
def test_cloud_models_match_a_hand_computation(alpha_k, sigma):
    models = [{"a": torch.tensor([0.0, 0.0]), "b": torch.tensor([0.5])},
              {"a": torch.tensor([1.0, 0.0]), "b": torch.tensor([0.5])},
              {"a": torch.tensor([0.0, 2.0]), "b": torch.tensor([-0.5])}]
    algo = fedamp(3, alpha_k=alpha_k, sigma=sigma)
    messages = algo.broadcast(4, {"models": dict(enumerate(models))}, [0, 2])
    assert sorted(messages) == [0, 2]
    xi = algo.diagnostics["xi"][4]
    assert np.isnan(xi[1]).all()  # client 1 received nothing this round
    guarded = 0
    for i in (0, 2):
        hand_xi, hand_u, hand_guarded = hand_cloud_model(models, i, alpha_k, sigma)
        guarded += hand_guarded
        np.testing.assert_allclose(xi[i], hand_xi, rtol=1e-6)
        assert set(messages[i]) == {"params"}
        for key in hand_u:
            torch.testing.assert_close(messages[i]["params"][key], hand_u[key].float(), rtol=1e-6, atol=1e-7)
    assert algo.diagnostics["guarded_rows"][4] == guarded == (1 if alpha_k == 10.0 else 0)  # 2 is far from 0 and 1


def test_client_trains_its_own_model_towards_the_cloud_model_and_uploads_it():
    algo = fedamp(2, alpha_k=50.0, lam=2.0)
    own, cloud = {"w": torch.tensor([5.0])}, {"w": torch.tensor([1.0])}
    data = ClientData(0, torch.zeros(6, 1), torch.zeros(6), torch.zeros(1, 1), torch.zeros(1), None)
    update = algo.client_update(1, 0, {"params": own}, {"params": cloud}, data)
    fit = next(update)
    assert fit.params is own and fit.context["anchor"] is cloud
    assert fit.loss.keywords == {"mu": pytest.approx(2.0 / 50.0)}  # (lam / (2 alpha_K)) ||w - u||^2
    trained = {"w": torch.tensor([4.0])}
    with pytest.raises(StopIteration) as stop:
        update.send(trained)
    state, reply = stop.value.value
    assert state["params"] is trained and reply == {"params": trained}


def test_server_stores_each_upload_and_keeps_the_others():
    algo = fedamp(3)
    first, second, third = ({"w": torch.tensor([float(v)])} for v in range(3))
    server = algo.aggregate(1, {"models": {0: first, 1: first, 2: first}},
                            {1: {"params": second}, 2: {"params": third}})
    assert server["models"][0] is first and server["models"][1] is second and server["models"][2] is third


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return pfedkit.run({**CONFIG, "fedamp": {"alpha_k": 1.0, "sigma": 1.0},
                        "out_dir": str(tmp_path_factory.mktemp("runs"))})


def test_digits_run_learns_sends_one_model_each_way_and_records_xi(run):
    metrics = run.metrics[run.metrics["round"] >= 1]
    assert metrics.groupby("round")["accuracy"].mean().iloc[-1] > 0.3  # 10 classes: chance is 0.1
    state = final_state(run)
    model_bytes = 4 * num_parameters(state.clients[0]["params"])
    took_part = metrics["bytes_down"] > 0
    assert took_part.sum() == 3 * 3  # 3 of 4 clients per round
    assert (metrics.loc[took_part, "bytes_down"] == model_bytes).all()
    assert (metrics.loc[took_part, "bytes_up"] == model_bytes).all()
    for cid, client in enumerate(state.clients):  # the evaluated model is the client's own = its latest upload
        params = client["params"]
        assert all(torch.equal(params[k], state.server["models"][cid][k]) for k in params)
    xi = read_diagnostics(run.run_dir / "diagnostics.pt")["xi"]
    assert sorted(xi) == [1, 2, 3]
    for matrix in xi.values():
        assert matrix.shape == (4, 4)
        present = ~np.isnan(matrix).all(axis=1)
        assert present.sum() == 3 and np.allclose(matrix[present].sum(axis=1), 1.0, atol=1e-6)
    # round 1: all stored models are the initial one, alpha_K / sigma = 1 per peer > 1 in total: guard
    first = xi[1][~np.isnan(xi[1]).all(axis=1)]
    off_diagonal = ~np.eye(4, dtype=bool)[~np.isnan(xi[1]).all(axis=1)]
    assert (first[~off_diagonal] == 0).all() and np.allclose(first[off_diagonal], 1 / 3)


def test_report_draws_the_xi_heatmaps(run, tmp_path):
    diagnostics = read_diagnostics(run.run_dir / "diagnostics.pt")
    written = draw_diagnostics(FedAMP, diagnostics, tmp_path)
    assert [p.name for p in written] == ["fedamp_xi.png", "fedamp_guarded_rows.png"]
    assert all(p.is_file() for p in written)


def test_processes_backend_equals_sequential(run, tmp_path):
    processes = pfedkit.run({**CONFIG, "fedamp": {"alpha_k": 1.0, "sigma": 1.0}, "backend": "processes",
                             "workers": 2, "out_dir": str(tmp_path)})
    assert (run.run_dir / "metrics.csv").read_bytes() == (processes.run_dir / "metrics.csv").read_bytes()
