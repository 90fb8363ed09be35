"""FedSoft (spec baselines.md "FedSoft"): importance weights, the v-weighted centre update, the
soft proximal loss, lam = 0 reducing the local models to Local training, and a digits run."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

import pfedkit
from pfedkit.core.contract import ClientData, Forward, Setup, cross_entropy
from pfedkit.algorithms.fedsoft import (FedSoft, centre_weights, importance_weights, is_estimation_round,
                                        select_for_centre, soft_proximal_loss)
from pfedkit.config import load_config
from pfedkit.core.errors import ConfigError
from pfedkit.core.model_ops import ModelOps
from pfedkit.core.params import flatten
from pfedkit.report.methods import draw_diagnostics
from pfedkit.run_files import read_diagnostics
from pfedkit.runs import prepare

from conftest import TinyNet, final_state, num_parameters, tiny_params


def tiny_setup(num_clients: int = 2, seed: int = 0) -> Setup:
    return Setup(num_clients, 3, np.full((num_clients, 3), 2), seed, 1, ModelOps(TinyNet))


def tiny_algo(num_clients: int = 2, **hyper) -> FedSoft:
    return FedSoft(FedSoft.Hyper(**{"num_centres": 2, **hyper}), tiny_setup(num_clients))


def constant_classifier(favoured: int) -> dict:
    """TinyNet parameters whose logits are 5 on class `favoured` and 0 elsewhere, for any input."""
    params = {name: torch.zeros_like(value) for name, value in tiny_params().items()}
    params["head.bias"][favoured] = 5.0
    return params


def client_data(labels: list[int]) -> ClientData:
    n = len(labels)
    x = torch.linspace(-1, 1, 3 * n).reshape(n, 3)
    y = torch.tensor(labels)
    return ClientData(0, x, y, x[:1], y[:1], np.bincount(labels, minlength=3))


def scalar(value: float) -> dict:
    return {"w": torch.tensor([value], dtype=torch.float64)}


# --- importance weights --------------------------------------------------------------------------

def test_importance_weights_count_the_samples_each_centre_explains_best():
    losses = np.array([[0.1, 0.9, 0.5, 0.2, 0.7],
                       [0.4, 0.3, 0.5, 0.6, 0.1]])  # sample 2 ties -> centre 0
    np.testing.assert_allclose(importance_weights(losses, 1e-4), [3 / 5, 2 / 5])


def test_a_centre_no_sample_prefers_gets_sigma():
    losses = np.array([[0.1, 0.2, 0.3, 0.4], [0.5, 0.6, 0.7, 0.8], [0.9, 0.9, 0.9, 0.9]])
    u = importance_weights(losses, 0.01)
    np.testing.assert_allclose(u, [1.0, 0.01, 0.01])  # n_ks = sigma n_k -> u_ks = sigma
    assert u.sum() > 1  # as in the paper: the smoothed weights are not renormalised


def test_client_estimates_from_its_own_samples_under_each_centre_and_trains_its_own_model():
    """Centre 0 always predicts class 0, centre 1 class 1: labels 0 prefer centre 0, labels 1
    centre 1, labels 2 tie (-> centre 0). Training starts from the client's model, not a centre."""
    algo = tiny_algo(lam=0.3)
    centres = [constant_classifier(0), constant_classifier(1)]
    own = tiny_params(5)
    client = {"params": own, "importance": np.array([0.5, 0.5]), "estimated_at": 0}
    update = algo.client_update(1, 0, client, {"centres": centres, "estimate": True}, client_data([0, 0, 1, 2, 1]))
    fit = next(update)
    np.testing.assert_allclose(fit.context["importance"].numpy(), [0.6, 0.4])
    assert fit.params is own and fit.context["centres"] is centres
    assert fit.loss.func is soft_proximal_loss and fit.loss.keywords == {"lam": 0.3}
    with pytest.raises(StopIteration) as stop:
        update.send(centres[1])
    state, reply = stop.value.value
    assert state["params"] is centres[1] and reply["params"] is centres[1] and reply["weight"] == 5
    np.testing.assert_allclose(reply["importance"], [0.6, 0.4])
    np.testing.assert_allclose(state["importance"], [0.6, 0.4])
    assert state["estimated_at"] == 1

    only_ones = algo.client_update(1, 0, client, {"centres": centres, "estimate": True}, client_data([1, 1, 1]))
    np.testing.assert_allclose(next(only_ones).context["importance"].numpy(), [1e-4, 1.0], rtol=1e-6)


def test_importance_weights_are_kept_between_estimation_rounds():
    assert [r for r in range(1, 9) if is_estimation_round(r, 2)] == [1, 3, 5, 7]
    assert [r for r in range(1, 9) if is_estimation_round(r, 3)] == [1, 4, 7]
    algo = tiny_algo(tau=2)
    assert algo.broadcast(2, {"centres": []}, [0])[0]["estimate"] is False
    assert algo.broadcast(3, {"centres": []}, [0])[0]["estimate"] is True
    client = {"params": tiny_params(5), "importance": np.array([0.25, 0.75]), "estimated_at": 0}
    centres = [constant_classifier(0), constant_classifier(1)]
    fit = next(algo.client_update(2, 0, client, {"centres": centres, "estimate": False}, client_data([0, 0, 0])))
    np.testing.assert_allclose(fit.context["importance"].numpy(), [0.25, 0.75])


def test_catch_up_estimates_when_the_latest_estimation_round_was_missed():
    """tau = 3: estimation rounds 1, 4, 7. In round 5 a client last estimated in round 1 (or
    never) catches up; one that estimated in round 4 does not."""
    algo = tiny_algo(tau=3, catch_up=True)
    centres = [constant_classifier(0), constant_classifier(1)]
    message = {"centres": centres, "estimate": False}

    def used(estimated_at, rnd=5):
        client = {"params": tiny_params(5), "importance": np.array([0.25, 0.75]), "estimated_at": estimated_at}
        return next(algo.client_update(rnd, 0, client, message, client_data([0, 0, 0]))).context["importance"].numpy()

    np.testing.assert_allclose(used(0), [1.0, 1e-4], rtol=1e-6)
    np.testing.assert_allclose(used(1), [1.0, 1e-4], rtol=1e-6)
    np.testing.assert_allclose(used(4), [0.25, 0.75])
    np.testing.assert_allclose(used(1, rnd=3), [0.25, 0.75])  # round 1 is still the latest
    plain = tiny_algo(tau=3)
    client = {"params": tiny_params(5), "importance": np.array([0.25, 0.75]), "estimated_at": 0}
    fit = next(plain.client_update(5, 0, client, message, client_data([0, 0, 0])))
    np.testing.assert_allclose(fit.context["importance"].numpy(), [0.25, 0.75])


# --- the local objective -------------------------------------------------------------------------

def test_soft_proximal_loss_adds_importance_weighted_squared_distances():
    logits = torch.tensor([[2.0, 0.0, -1.0]])
    out, y = Forward(torch.zeros(1, 2), logits), torch.tensor([0])
    w = {"a": torch.tensor([1.0, 2.0], requires_grad=True)}
    centres = [{"a": torch.tensor([0.0, 0.0])}, {"a": torch.tensor([1.0, 4.0])}]
    context = {"centres": centres, "importance": torch.tensor([0.5, 0.25])}
    loss = soft_proximal_loss(out, y, w, context, lam=0.2)
    ce = cross_entropy(out, y, w, context)
    # (0.2/2) (0.5 * 5 + 0.25 * 4) = 0.35
    assert loss.item() == pytest.approx(ce.item() + 0.35)
    loss.backward()
    # gradient lam sum_s u_s (w - c_s) = 0.2 (0.5 [1, 2] + 0.25 [0, -2]) = [0.1, 0.1]
    np.testing.assert_allclose(w["a"].grad.numpy(), [0.1, 0.1], rtol=1e-6)
    assert soft_proximal_loss(out, y, w, context, lam=0.0).item() == ce.item()


# --- server: v and the centre update ---------------------------------------------------------------

def test_v_rows_sum_to_one_and_weight_by_importance_times_samples():
    rng = np.random.default_rng(0)
    u, n = rng.random((6, 4)) + 1e-4, rng.integers(1, 100, 6)
    v = centre_weights(u, n)
    assert v.shape == (4, 6)
    np.testing.assert_allclose(v.sum(axis=1), 1.0)
    np.testing.assert_allclose(v[2, 3], u[3, 2] * n[3] / (u[:, 2] * n).sum())


def test_centre_update_is_the_v_weighted_mean_of_the_uploads():
    algo = tiny_algo(num_clients=3)
    server = {"centres": [scalar(0.0), scalar(0.0)], "importance": np.full((3, 2), np.nan)}
    replies = {0: {"params": scalar(1.0), "importance": np.array([0.8, 0.2]), "weight": 10},
               2: {"params": scalar(4.0), "importance": np.array([0.1, 0.9]), "weight": 30}}
    new = algo.aggregate(1, server, replies)
    # centre 0: (0.8*10*1 + 0.1*30*4) / (8 + 3) = 20/11; centre 1: (0.2*10*1 + 0.9*30*4) / (2 + 27) = 110/29
    assert new["centres"][0]["w"].item() == pytest.approx(20 / 11)
    assert new["centres"][1]["w"].item() == pytest.approx(110 / 29)
    np.testing.assert_array_equal(new["importance"][1], [np.nan, np.nan])
    np.testing.assert_allclose(new["importance"][[0, 2]], [[0.8, 0.2], [0.1, 0.9]])
    np.testing.assert_array_equal(algo.diagnostics["cluster_assignment"][1], [0, -1, 1])
    assert algo.diagnostics["cluster_weights"][1].shape == (3, 2)
    assert algo.aggregate(2, new, {})["centres"] == new["centres"]  # no uploads: centres kept


def test_selection_takes_the_uniform_mean_of_clients_drawn_by_v():
    algo = tiny_algo(num_clients=3, selection_size=2)
    server = {"centres": [scalar(0.0), scalar(0.0)], "importance": np.full((3, 2), np.nan)}
    replies = {0: {"params": scalar(1.0), "importance": np.array([0.8, 0.2]), "weight": 10},
               2: {"params": scalar(4.0), "importance": np.array([0.1, 0.9]), "weight": 30}}
    new = algo.aggregate(1, server, replies)  # K = 2 = all uploads: plain mean whatever v says
    assert [c["w"].item() for c in new["centres"]] == [2.5, 2.5]
    draws = [select_for_centre(np.array([0.7, 0.2, 0.1]), 1, np.random.default_rng(s))[0] for s in range(3000)]
    np.testing.assert_allclose(np.bincount(draws, minlength=3) / 3000, [0.7, 0.2, 0.1], atol=0.03)
    assert sorted(select_for_centre(np.array([0.5, 0.5, 0.0]), 3, np.random.default_rng(0))) == [0, 1]


def test_selection_size_above_the_number_of_clients_is_refused():
    with pytest.raises(ConfigError, match="selection_size"):
        tiny_algo(num_clients=3, selection_size=4).check()


# --- end to end ----------------------------------------------------------------------------------

def test_lam_zero_local_models_train_like_local_while_centres_update(small_config):
    config = {**small_config, "rounds": 2}
    soft = pfedkit.run({**config, "algorithm": "fedsoft", "fedsoft": {"lam": 0.0}})
    local = pfedkit.run({**config, "algorithm": "local"})
    columns = ["round", "client", "accuracy", "loss"]
    pd.testing.assert_frame_equal(soft.metrics[columns].reset_index(drop=True),
                                  local.metrics[columns].reset_index(drop=True))
    initial = prepare(load_config({**config, "algorithm": "fedsoft", "out_dir": config["out_dir"] + "-init"}))
    start = initial.state.server["centres"]
    end = final_state(soft).server["centres"]
    assert len(end) == 3
    assert all(not torch.equal(flatten(a), flatten(b)) for a, b in zip(start, end))


def test_digits_run_learns_and_sends_all_centres(small_config):
    result = pfedkit.run({**small_config, "algorithm": "fedsoft"})
    last = result.metrics[result.metrics["round"] == 3]
    assert (last["correct"].sum() / last["n_test"].sum()) > 0.3  # 10 classes
    state = final_state(result)
    model_bytes = 4 * num_parameters(state.clients[0]["params"])
    assert (result.metrics["bytes_down"] == 3 * model_bytes + 8).all()  # S centres + the flag
    assert (result.metrics["bytes_up"] == model_bytes + 3 * 8 + 8).all()  # w_k, u_k, n_k
    diagnostics = read_diagnostics(result.run_dir / "diagnostics.pt")
    weights = diagnostics["cluster_weights"][3]
    assert weights.shape == (4, 3) and (weights >= 1e-4 - 1e-9).all()
    np.testing.assert_array_equal(diagnostics["cluster_assignment"][3], weights.argmax(axis=1))
    np.testing.assert_allclose(weights, np.stack([c["importance"] for c in state.clients]), rtol=1e-6)
    assert [p.name for p in draw_diagnostics(FedSoft, diagnostics, result.run_dir)] == [
        "fedsoft_clusters.png", "fedsoft_cluster_weights.png"]
