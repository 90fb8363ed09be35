"""FedFomo (spec baselines.md "FedFomo"): the weights, the model update, the unclipped P update,
the validation split kept out of training, the peer choice, and a digits run."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import pfedkit
from pfedkit.core.contract import ClientData, Setup
from pfedkit.algorithms.fedfomo import (DISTANCE_EPS, FedFomo, choose_peers, exploration_rate, fomo_update,
                                        fomo_weights, improvement_ratios, parameter_distance, top_peers,
                                        validation_size, validation_split)
from pfedkit.core.errors import ConfigError
from pfedkit.core.model_ops import ModelOps
from pfedkit.core.params import flatten
from pfedkit.report.methods import draw_diagnostics
from pfedkit.run_files import read_diagnostics

from conftest import TinyNet, final_state, num_parameters, tiny_params


def tiny_algo(num_clients: int = 4, counts=None, **hyper) -> FedFomo:
    counts = np.full((num_clients, 3), 4) if counts is None else counts
    return FedFomo(FedFomo.Hyper(**hyper), Setup(num_clients, 3, counts, 0, 1, ModelOps(TinyNet)))


def scalar(value: float) -> dict:
    return {"w": torch.tensor([value], dtype=torch.float64)}


# --- weights and update -------------------------------------------------------------------------

def test_weights_are_non_negative_and_sum_to_one_or_are_all_zero():
    rng = np.random.default_rng(0)
    for _ in range(50):
        ratios = rng.normal(size=rng.integers(1, 7))
        w = fomo_weights(ratios)
        assert (w >= 0).all()
        if (ratios > 0).any():
            assert w.sum() == pytest.approx(1.0)
            assert (w[ratios <= 0] == 0).all()
        else:
            assert (w == 0).all()


def test_hand_computed_weights_and_update():
    # L(old) = 1; peers: L = 0.5 at distance 1, L = 2 at distance 1, L = 0.8 at distance 0.5
    ratios = improvement_ratios(1.0, [0.5, 2.0, 0.8], [1.0, 1.0, 0.5])
    r0, r1, r2 = 0.5 / (1 + 1e-5), -1.0 / (1 + 1e-5), 0.2 / (0.5 + 1e-5)
    np.testing.assert_allclose(ratios, [r0, r1, r2])
    w = fomo_weights(ratios)
    np.testing.assert_allclose(w, [r0 / (r0 + r2), 0.0, r2 / (r0 + r2)])
    own, peers = scalar(1.0), [scalar(2.0), scalar(10.0), scalar(-1.0)]
    new = fomo_update(own, peers, w)
    expected = 1.0 + w[0] * (2.0 - 1.0) + w[1] * (10.0 - 1.0) + w[2] * (-1.0 - 1.0)
    assert new["w"].item() == pytest.approx(expected)
    assert fomo_update(own, peers, fomo_weights([-1.0, -2.0, 0.0])) is own  # nothing helps: keep theta_old


def test_client_mixes_by_validation_losses_and_trains_only_on_the_other_positions():
    """Losses on the validation positions only (the training positions carry labels that would
    reverse the ranking), distance over all parameters, then a Fit on the other positions."""
    algo = tiny_algo(num_clients=3)
    own, good, bad = tiny_params(0), tiny_params(1), tiny_params(2)
    n = 12
    x = torch.randn(n, 3, generator=torch.Generator().manual_seed(0))
    ops = ModelOps(TinyNet)
    fit_on, held_out = validation_split(n, 0.2, 0, 0)
    y = ops.logits(bad, x).argmax(dim=1)
    y[held_out] = ops.logits(good, x[held_out]).argmax(dim=1)  # labels `good` predicts
    y_val = y[held_out]
    data = ClientData(0, x, y, x[:1], y[:1], np.bincount(y.numpy(), minlength=3))
    update = algo.client_update(1, 0, {"params": own}, {"models": [good, bad], "ids": np.array([1, 2])}, data)
    fit = next(update)
    assert torch.equal(fit.samples, fit_on)

    def val_loss(params):
        return F.cross_entropy(ops.logits(params, x[held_out]).double(), y_val).item()

    def dist(params):
        return torch.linalg.vector_norm(flatten(params).double() - flatten(own).double()).item()

    ratios = [(val_loss(own) - val_loss(p)) / (dist(p) + 1e-5) for p in (good, bad)]
    w = np.maximum(ratios, 0) / np.maximum(ratios, 0).sum()
    assert w[0] > 0.5
    for name in own:
        expected = own[name].double() + sum(wj * (p[name].double() - own[name].double())
                                            for wj, p in zip(w, (good, bad)))
        torch.testing.assert_close(fit.params[name].double(), expected, rtol=1e-5, atol=1e-6)
    trained = {k: v + 1 for k, v in fit.params.items()}
    with pytest.raises(StopIteration) as stop:
        update.send(trained)
    state, reply = stop.value.value
    assert state["params"] is trained and reply["params"] is trained
    assert sorted(reply["ratios"]) == [1, 2]
    np.testing.assert_allclose([reply["ratios"][1], reply["ratios"][2]], ratios, rtol=1e-6)  # unclipped


def test_p_update_adds_the_unclipped_ratios_and_records_the_clipped_weights():
    algo = tiny_algo(num_clients=3)
    server = algo.init_server(tiny_params(0))
    replies = {0: {"params": tiny_params(1), "ratios": {1: -0.5, 2: 0.3}},
               2: {"params": tiny_params(2), "ratios": {0: -0.1, 1: -0.2}}}
    new = algo.aggregate(1, server, replies)
    np.testing.assert_allclose(new["P"], [[1, -0.5, 0.3], [0, 1, 0], [-0.1, -0.2, 1]])
    assert new["models"][0] is replies[0]["params"] and new["models"][2] is replies[2]["params"]
    assert new["models"][1] is server["models"][1]
    weights = algo.diagnostics["weights"][1]
    np.testing.assert_allclose(weights[0], [0, 0, 1])  # only the positive ratio mixes
    np.testing.assert_allclose(weights[2], [0, 0, 1])  # nothing helped: kept its own model
    assert np.isnan(weights[1]).all()
    np.testing.assert_allclose(algo.diagnostics["P"][1], new["P"])
    # the negative ratio pushes client 1 behind client 2 for client 0 (epsilon = 0: plain top-M)
    greedy = tiny_algo(num_clients=3, num_peers=1, epsilon=0.0)
    assert greedy.broadcast(2, new, [0])[0]["ids"].tolist() == [2]


# --- peers chosen ---------------------------------------------------------------------------------

def test_top_peers_exclude_self_and_break_ties_by_lowest_id():
    row = np.array([5.0, 0.0, 2.0, 2.0, -1.0, 0.0])
    assert top_peers(row, 0, 3) == [2, 3, 1]
    assert top_peers(row, 2, 2) == [0, 3]
    assert choose_peers(row, 0, 3, 0.0, np.random.default_rng(0)) == [2, 3, 1]


def test_exploration_replaces_slots_with_clients_not_yet_chosen():
    row = np.arange(10, dtype=float)
    for seed in range(20):
        chosen = choose_peers(row, 9, 3, 1.0, np.random.default_rng(seed))
        assert len(set(chosen)) == 3 and 9 not in chosen
        assert chosen[0] != 8  # the top slot always explored (8 may come back in a later slot)
    assert exploration_rate(1, 0.3, 0.98) == pytest.approx(0.3)
    assert exploration_rate(11, 0.3, 0.98) == pytest.approx(0.3 * 0.98 ** 10)
    algo = tiny_algo(num_clients=8, num_peers=2)
    server = algo.init_server(tiny_params(0))
    first = {cid: m["ids"].tolist() for cid, m in algo.broadcast(3, server, list(range(8))).items()}
    again = {cid: m["ids"].tolist() for cid, m in algo.broadcast(3, server, list(range(8))).items()}
    assert first == again  # seeded by (seed, round, client)
    assert any(ids != top_peers(server["P"][cid], cid, 2) for cid, ids in first.items())


def test_validation_split_sizes():
    assert validation_size(10, 0.2) == 2
    assert validation_size(11, 0.2) == 3  # ceil
    assert validation_size(2, 0.2) == 1
    assert validation_size(3, 0.9) == 2  # leaves one sample to train on
    with pytest.raises(ValueError):
        validation_size(1, 0.2)
    with pytest.raises(ConfigError, match="at least 2 training samples"):
        tiny_algo(num_clients=2, counts=np.array([[1, 0, 0], [3, 3, 3]])).check()


def test_the_validation_split_is_random_per_client_not_the_last_positions():
    """The stored datasets are sorted by label, so a client's last positions hold its highest class:
    the split is drawn at random (seeded, the same every round), partitions the positions, and on
    a label-sorted client of two classes both classes are validated on."""
    n = 200
    fit_on, held_out = validation_split(n, 0.2, 7, 3)
    assert len(held_out) == validation_size(n, 0.2) == 40
    assert torch.equal(torch.sort(torch.cat([fit_on, held_out])).values, torch.arange(n))
    again, other_client = validation_split(n, 0.2, 7, 3), validation_split(n, 0.2, 7, 4)
    assert torch.equal(again[1], held_out) and not torch.equal(other_client[1], held_out)
    assert not torch.equal(held_out, torch.arange(n - 40, n))
    labels = torch.cat([torch.zeros(150, dtype=torch.long), torch.ones(50, dtype=torch.long)])  # sorted
    assert set(labels[held_out].tolist()) == {0, 1}


def test_distance_is_the_l2_norm_over_all_parameters():
    a = {"x": torch.tensor([1.0, 2.0]), "y": torch.tensor([[0.0]])}
    b = {"x": torch.tensor([4.0, 2.0]), "y": torch.tensor([[4.0]])}
    assert parameter_distance(a, b) == pytest.approx(5.0)
    assert DISTANCE_EPS == 1e-5


# --- end to end ----------------------------------------------------------------------------------

def test_digits_run_mixes_peers_and_counts_m_models_down(small_config):
    result = pfedkit.run({**small_config, "algorithm": "fedfomo", "fedfomo": {"num_peers": 2}})
    last = result.metrics[result.metrics["round"] == 3]
    assert (last["correct"].sum() / last["n_test"].sum()) > 0.3  # 10 classes
    state = final_state(result)
    model_bytes = 4 * num_parameters(state.clients[0]["params"])
    assert (result.metrics["bytes_down"] == 2 * model_bytes + 2 * 8).all()  # M models + their ids
    assert (result.metrics["bytes_up"] == model_bytes + 2 * 8).all()  # model + M ratios
    diagnostics = read_diagnostics(result.run_dir / "diagnostics.pt")
    for rnd in (1, 2, 3):
        weights = diagnostics["weights"][rnd]
        assert weights.shape == (4, 4) and (weights >= 0).all()
        np.testing.assert_allclose(weights.sum(axis=1), 1.0, rtol=1e-6)
    np.testing.assert_allclose(diagnostics["P"][3], state.server["P"], rtol=1e-6)
    assert (np.diag(state.server["P"]) == 1).all()
    for cid in range(4):
        assert all(torch.equal(state.server["models"][cid][k], state.clients[cid]["params"][k])
                   for k in state.clients[cid]["params"])
    assert [p.name for p in draw_diagnostics(FedFomo, diagnostics, result.run_dir)] == [
        "fedfomo_weights.png", "fedfomo_affinity.png"]
