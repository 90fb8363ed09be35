"""IFCA (baselines.md "IFCA"): k = 1 is FedAvg, the client picks the model with the lowest loss,
clusters nobody chose keep their model, k models go down, and a short run on digits."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import TinyNet, learned_run, num_parameters, tiny_params

import pfedkit
from pfedkit.algorithms.ifca import IFCA, choose_cluster
from pfedkit.core.contract import ClientData, Setup
from pfedkit.core.model_ops import ModelOps
from pfedkit.core.params import weighted_mean
from pfedkit.report.methods import draw_diagnostics
from pfedkit.run_files import read_diagnostics

COLUMNS = ["round", "client", "participated", "accuracy", "loss", "train_loss", "train_steps", "bytes_down"]


def tiny_setup(num_clients: int = 4) -> Setup:
    return Setup(num_clients, 3, np.ones((num_clients, 3)), 0, 1, ModelOps(TinyNet))


def tiny_data(label: int = 1, n: int = 12) -> ClientData:
    x = torch.linspace(-1, 1, 3 * n).reshape(n, 3)
    y = torch.full((n,), label)
    return ClientData(0, x, y, x[:2], y[:2], np.bincount(y.numpy(), minlength=3))


def predicting(label: int) -> dict:
    """TinyNet parameters whose logits are 8 for `label` and 0 elsewhere on any input."""
    params = {name: torch.zeros_like(value) for name, value in tiny_params().items()}
    params["head.bias"][label] = 8.0
    return params


def test_k1_gives_metrics_identical_to_fedavg(small_config, tmp_path):
    config = {**small_config, "join_ratio": 0.75}
    fedavg = pfedkit.run({**config, "out_dir": str(tmp_path / "a")}).metrics
    ifca = pfedkit.run({**config, "algorithm": "ifca", "ifca": {"k": 1}, "out_dir": str(tmp_path / "b")}).metrics
    assert fedavg["accuracy"].notna().all()
    for column in COLUMNS:
        np.testing.assert_array_equal(ifca[column].to_numpy(), fedavg[column].to_numpy(), err_msg=column)
    joined = ifca["participated"] == 1
    np.testing.assert_array_equal(ifca.loc[joined, "bytes_up"], fedavg.loc[joined, "bytes_up"] + 8)  # + the index j


def test_client_picks_the_model_with_the_lowest_loss():
    ops, data = ModelOps(TinyNet), tiny_data(label=1)
    (j, losses) = choose_cluster(ops, [predicting(0), predicting(1), predicting(2)], data)
    assert j == 1 and losses[1] < 0.01 < 7 < losses[0] == pytest.approx(losses[2])
    assert choose_cluster(ops, [predicting(2), predicting(2), predicting(1)], data)[0] == 2
    assert choose_cluster(ops, [predicting(0), predicting(0)], data)[0] == 0  # ties: the lowest index


def test_client_trains_and_uploads_its_chosen_model_and_keeps_it_as_state():
    algo = IFCA(IFCA.Hyper(k=3), tiny_setup())
    models = [predicting(0), predicting(2), predicting(1)]
    data = tiny_data(label=2)
    update = algo.client_update(1, 0, {"cluster": None}, {"models": models}, data)
    request = next(update)
    assert request.params is models[1]
    trained = predicting(2)
    with pytest.raises(StopIteration) as stop:
        update.send(trained)
    state, reply = stop.value.value
    assert state == {"cluster": 1}
    assert reply["params"] is trained and reply["cluster"] == 1 and reply["weight"] == data.n_train
    assert set(reply) == {"params", "cluster", "weight"}


def test_server_averages_uploads_per_cluster_by_n_i_and_unchosen_clusters_keep_their_model():
    algo = IFCA(IFCA.Hyper(k=3), tiny_setup(5))
    models = [tiny_params(s) for s in range(3)]
    uploads = {cid: tiny_params(10 + cid) for cid in range(5)}
    chosen = {0: 1, 1: 2, 3: 1, 4: 1}  # client 2 is not a participant; nobody chose cluster 0
    sizes = {0: 10, 1: 7, 3: 30, 4: 60}
    replies = {cid: {"params": uploads[cid], "cluster": j, "weight": sizes[cid]} for cid, j in chosen.items()}
    new = algo.aggregate(4, {"models": models}, replies)["models"]
    assert all(torch.equal(new[0][n], models[0][n]) for n in models[0])
    for name in models[0]:
        expected = (10 * uploads[0][name] + 30 * uploads[3][name] + 60 * uploads[4][name]) / 100
        torch.testing.assert_close(new[1][name], expected)
        torch.testing.assert_close(new[2][name], uploads[1][name])
    uniform = weighted_mean([uploads[0], uploads[3], uploads[4]], [1, 1, 1])
    assert not all(torch.allclose(new[1][n], uniform[n]) for n in uniform)
    np.testing.assert_array_equal(algo.diagnostics["cluster_assignment"][4], [1, 2, -1, 1, 1])


def test_clusters_are_differently_initialised_and_model_0_is_the_initial_model():
    algo = IFCA(IFCA.Hyper(k=3), tiny_setup())
    initial = tiny_params(7)
    models = algo.init_server(initial)["models"]
    assert len(models) == 3 and all(torch.equal(models[0][n], initial[n]) for n in initial)
    assert not torch.equal(models[1]["head.weight"], models[2]["head.weight"])
    assert not torch.equal(models[1]["head.weight"], initial["head.weight"])
    again = algo.init_server(initial)["models"]  # seeded: the same models every time
    assert all(torch.equal(again[2][n], models[2][n]) for n in initial)


def test_client_is_evaluated_with_its_current_cluster_and_cluster_0_before_it_joins():
    algo = IFCA(IFCA.Hyper(k=2), tiny_setup())
    server = {"models": [tiny_params(1), tiny_params(2)]}
    assert algo.client_model(0, server, {"cluster": None}) is server["models"][0]
    assert algo.client_model(0, server, {"cluster": 1}) is server["models"][1]


def test_end_to_end_digits_bytes_assignments_and_report(small_config, tmp_path):
    config = {**small_config, "algorithm": "ifca", "ifca": {"k": 2}, "join_ratio": 0.75}
    result, metrics, state = learned_run(config)
    model_bytes = 4 * num_parameters(state.server["models"][0])
    joined = metrics[metrics["participated"] == 1]
    assert len(joined) == 3 * 3
    assert (joined["bytes_down"] == 2 * model_bytes).all()  # k models down
    assert (joined["bytes_up"] == model_bytes + 16).all()  # one model + j + n_i up
    diagnostics = read_diagnostics(result.run_dir / "diagnostics.pt")
    for rnd, vector in diagnostics["cluster_assignment"].items():
        participants = joined.loc[joined["round"] == rnd, "client"].tolist()
        assert vector.shape == (4,)
        assert all((vector[c] in (0, 1)) == (c in participants) for c in range(4))
    last = diagnostics["cluster_assignment"][3]
    for cid in np.flatnonzero(last >= 0):
        assert state.clients[cid]["cluster"] == last[cid]
    written = draw_diagnostics(IFCA, diagnostics, tmp_path / "report")
    assert [p.name for p in written] == ["ifca_clusters.png"] and written[0].stat().st_size > 0


def test_processes_backend_equals_sequential(small_config, tmp_path):
    config = {**small_config, "algorithm": "ifca", "ifca": {"k": 2}, "join_ratio": 0.75, "rounds": 2}
    sequential = pfedkit.run({**config, "backend": "sequential", "out_dir": str(tmp_path / "s")})
    processes = pfedkit.run({**config, "backend": "processes", "workers": 2, "out_dir": str(tmp_path / "p")})
    assert (sequential.run_dir / "metrics.csv").read_bytes() == (processes.run_dir / "metrics.csv").read_bytes()
