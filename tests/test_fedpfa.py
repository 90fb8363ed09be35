"""FedPFA: FedAvg up to the switch round; sparsity vectors against a hand computation; the grouping
(agglomerative, canonical labels, late joiners to the nearest group); group models = n_i-weighted
means of their members' uploads; G = 1 is FedAvg; messages and diagnostics of a digits run."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import final_state, num_parameters
from torch import nn

import pfedkit
from pfedkit.algorithms.fedpfa import FedPFA, group_clients, nearest_group, sparsity_vector
from pfedkit.core.contract import ClientData, Setup, message_bytes
from pfedkit.core.errors import ConfigError
from pfedkit.core.model_ops import ModelOps
from pfedkit.core.params import weighted_mean
from pfedkit.models.base import BodyHeadModel
from pfedkit.report.methods import draw_diagnostics
from pfedkit.run_files import read_diagnostics

COLUMNS = ["round", "client", "accuracy", "loss", "correct"]


def tiny_model() -> BodyHeadModel:
    return BodyHeadModel([("fc1", nn.Linear(3, 4)), ("relu", nn.ReLU()), ("fc", nn.Linear(4, 3))], "fc")


def tiny_algorithm(num_clients: int = 6, rounds: int = 10, **hyper) -> FedPFA:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        ops = ModelOps(tiny_model)
    return FedPFA(FedPFA.Hyper(**hyper), Setup(num_clients, 3, np.ones((num_clients, 3)), seed=1, local_epochs=1,
                                               ops=ops, rounds=rounds))


def model_with(value: float, like: dict) -> dict:
    return {name: torch.full_like(tensor, value) for name, tensor in like.items()}


# --- the sparsity vector -----------------------------------------------------------------------

def test_sparsity_vector_is_the_fraction_of_zero_activations_per_unit():
    features = torch.tensor([[0.0, 1.5, 0.0], [2.0, 0.0, 0.0], [0.0, 0.3, 0.0], [0.1, 0.2, 0.0]])
    torch.testing.assert_close(sparsity_vector(features), torch.tensor([0.5, 0.25, 1.0]))
    # conv-like [n, c, h, w] outputs: one entry per flattened unit
    assert sparsity_vector(torch.zeros(5, 2, 3, 3)).shape == (18,)


def test_client_sparsity_is_computed_on_the_federated_model_with_tinynet_features():
    algo = tiny_algorithm(switch_round=2)
    federated = algo.setup.ops.initial_params()
    g = torch.Generator().manual_seed(4)
    x, y = torch.randn(12, 3, generator=g), torch.randint(0, 3, (12,), generator=g)
    data = ClientData(0, x, y, x[:2], y[:2], np.bincount(y.numpy(), minlength=3))
    update = algo.client_update(3, 0, None, {"federated": federated}, data)
    request = next(update)
    assert request.params is federated  # an ungrouped client trains the federated model
    with pytest.raises(StopIteration) as stop:
        update.send(model_with(0.5, federated))
    _, reply = stop.value.value
    # by hand: h = ReLU(W x + b); s_u = #{x : h_u(x) = 0} / n
    pre = x @ federated["body.fc1.weight"].T + federated["body.fc1.bias"]
    expected = [sum(1 for row in range(12) if pre[row, unit] <= 0) / 12 for unit in range(4)]
    torch.testing.assert_close(reply["sparsity"], torch.tensor(expected))
    assert 0 < reply["sparsity"].sum() < 4  # a real mix of zero and non-zero units
    assert message_bytes(reply) == 4 * num_parameters(federated) + 8 + 4 * 4
    # a grouped client receives its group model and sends no sparsity vector
    grouped = algo.client_update(4, 0, None, {"params": federated}, data)
    next(grouped)
    with pytest.raises(StopIteration) as stop:
        grouped.send(federated)
    assert set(stop.value.value[1]) == {"params", "weight"}


# --- grouping ----------------------------------------------------------------------------------

def test_clearly_separated_sparsity_vectors_land_in_their_groups_with_canonical_labels():
    rng = np.random.default_rng(0)
    centres = {"a": np.full(8, 0.1), "b": np.full(8, 0.9), "c": np.r_[np.full(4, 0.1), np.full(4, 0.9)]}
    order = ["b", "a", "b", "c", "a", "c", "b"]
    vectors = np.stack([centres[k] + rng.uniform(-0.02, 0.02, 8) for k in order])
    labels = group_clients(vectors, 3)
    np.testing.assert_array_equal(labels, [0, 1, 0, 2, 1, 2, 0])  # group 0 holds row 0, and so on
    assert (group_clients(vectors, 1) == 0).all()
    np.testing.assert_array_equal(group_clients(vectors[:2], 3), [0, 1])  # capped at the rows given


def test_average_linkage_splits_a_chain_where_single_linkage_cuts_off_the_end():
    # gaps 1.0, 1.1, 1.2, 1.3, 1.4. Average linkage, by hand: {0, 1} at 1.0, {2.1, 3.3} at 1.2,
    # {4.6, 6} at 1.4, then {0, 1} + {2.1, 3.3} at 2.2 (< 2.6 to {4.6, 6}). Single linkage cuts
    # the largest gap (1.4) only.
    chain = np.array([[0.0], [1.0], [2.1], [3.3], [4.6], [6.0]])
    np.testing.assert_array_equal(group_clients(chain, 2, "average"), [0, 0, 0, 0, 1, 1])
    np.testing.assert_array_equal(group_clients(chain, 2, "single"), [0, 0, 0, 0, 0, 1])


def test_nearest_group_by_euclidean_distance():
    centroids = np.array([[0.0, 0.0], [1.0, 1.0], [0.0, 1.0]])
    assert nearest_group(np.array([0.9, 0.8]), centroids) == 1
    assert nearest_group(np.array([0.1, 0.7]), centroids) == 2
    assert nearest_group(np.array([0.5, 0.5]), centroids[:2]) == 0  # tie: the lowest index


def test_group_models_are_sample_weighted_means_and_late_joiners_take_the_nearest_group():
    algo = tiny_algorithm(switch_round=2, groups=2)
    base = algo.setup.ops.initial_params()
    server = algo.init_server(base)
    vectors = {0: [0.1, 0.1], 1: [0.9, 0.8], 2: [0.15, 0.1], 4: [0.8, 0.9]}
    sizes = {0: 10, 1: 30, 2: 50, 4: 20}
    replies = {cid: {"params": model_with(float(cid), base), "weight": sizes[cid],
                     "sparsity": torch.tensor(vectors[cid])} for cid in vectors}
    algo.diagnostics = {}
    server = algo.aggregate(3, server, replies)
    assert server["assignment"] == {0: 0, 2: 0, 1: 1, 4: 1}
    for group, members in ((0, (0, 2)), (1, (1, 4))):
        expected = weighted_mean([replies[c]["params"] for c in members], [sizes[c] for c in members])
        for name in base:
            torch.testing.assert_close(server["group_models"][group][name], expected[name])
    value = (0 * 10 + 2 * 50) / 60  # n_i-weighted, not the plain mean 1.0
    assert float(server["group_models"][0]["head.fc.bias"][0]) == pytest.approx(value)
    # round 4: client 5 joins (nearest to group 1's mean vector), client 2 trains in group 0
    joined = {5: {"params": model_with(5.0, base), "weight": 40, "sparsity": torch.tensor([0.7, 0.7])},
              2: {"params": model_with(7.0, base), "weight": 50}}
    new = algo.aggregate(4, server, joined)
    assert new["assignment"][5] == 1
    assert float(new["group_models"][0]["head.fc.bias"][0]) == pytest.approx(7.0)  # only client 2 this round
    assert float(new["group_models"][1]["head.fc.bias"][0]) == pytest.approx(5.0)  # only client 5 this round
    np.testing.assert_array_equal(algo.diagnostics["cluster_assignment"][4], [0, 1, 0, -1, 1, 1])
    # the evaluated models: the group model, the federated one for an ungrouped client
    assert algo.client_model(5, new, None) is new["group_models"][1]
    assert algo.client_model(3, new, None) is new["params"]
    # and the broadcast of round 5 follows the assignment
    messages = algo.broadcast(5, new, [2, 3])
    assert messages[2]["params"] is new["group_models"][0] and messages[3]["federated"] is new["params"]


def test_options_that_cannot_work_are_rejected():
    with pytest.raises(ConfigError, match="switch_round"):
        tiny_algorithm(rounds=0).check()
    tiny_algorithm(rounds=0, switch_round=3).check()
    with pytest.raises(ConfigError, match="groups"):
        tiny_algorithm(num_clients=2, groups=3).check()
    assert tiny_algorithm(rounds=9).switch_round == 4


# --- end to end ----------------------------------------------------------------------------

def test_before_the_switch_it_is_fedavg_and_with_one_group_always(small_config):
    config = {**small_config, "rounds": 4}
    fedavg = pfedkit.run(config).metrics
    two_phase = pfedkit.run({**config, "algorithm": "fedpfa", "fedpfa": {"groups": 2}}).metrics
    one_group = pfedkit.run({**config, "algorithm": "fedpfa", "fedpfa": {"groups": 1}}).metrics
    early = fedavg["round"] <= 2  # T0 = rounds // 2
    pd.testing.assert_frame_equal(two_phase.loc[early, COLUMNS], fedavg.loc[early, COLUMNS])
    assert not np.allclose(two_phase.loc[~early, "loss"], fedavg.loc[~early, "loss"])  # phase 2 differs
    pd.testing.assert_frame_equal(one_group[COLUMNS], fedavg[COLUMNS])


def test_digits_half_participation_bytes_groups_and_report(small_config, tmp_path):
    config = {**small_config, "num_clients": 6, "rounds": 4, "join_ratio": 0.5,
              "fedpfa": {"switch_round": 1, "groups": 2}, "algorithm": "fedpfa"}
    result = pfedkit.run(config)
    metrics, state = result.metrics, final_state(result)
    sigma = 4 * num_parameters(state.server["params"])
    units = 200  # digits' MLP body output
    joined = metrics[(metrics["round"] >= 1) & (metrics["participated"] == 1)]
    assert (joined["bytes_down"] == sigma).all()
    extra = joined["bytes_up"] - sigma - 8
    assert set(extra) <= {0, 4 * units}
    # the sparsity vector goes up once per client, at its first phase-2 participation
    senders = joined.loc[extra > 0].groupby("client")["round"].agg(list)
    phase2 = joined[joined["round"] >= 2].groupby("client")["round"].min()
    assert senders.map(len).eq(1).all() and (senders.str[0] == phase2[senders.index]).all()
    assert sorted(senders.index) == sorted(phase2.index)
    diagnostics = read_diagnostics(result.run_dir / "diagnostics.pt")
    assert diagnostics["groups"] == {2: 2}
    final = diagnostics["cluster_assignment"][4]
    assert final.shape == (6,) and set(final[final >= 0]) <= {0, 1}
    assert state.server["assignment"] == {cid: int(g) for cid, g in enumerate(final) if g >= 0}
    assert all(matrix.shape == (6, units) for matrix in diagnostics["sparsity"].values())
    written = draw_diagnostics(FedPFA, diagnostics, tmp_path / "report")
    assert {p.name for p in written} == {"fedpfa_clusters.png", "fedpfa_sparsity.png",
                                         "fedpfa_sparsity_distances.png"}
    assert metrics.loc[metrics["round"] == 4, "accuracy"].mean() > 0.3


def test_processes_backend_gives_the_same_metrics(small_config, tmp_path):
    config = {**small_config, "algorithm": "fedpfa", "join_ratio": 0.75, "fedpfa": {"switch_round": 1, "groups": 2}}
    sequential = pfedkit.run({**config, "backend": "sequential", "out_dir": str(tmp_path / "s")})
    processes = pfedkit.run({**config, "backend": "processes", "workers": 2, "out_dir": str(tmp_path / "p")})
    columns = COLUMNS + ["bytes_up", "bytes_down"]
    pd.testing.assert_frame_equal(sequential.metrics[columns], processes.metrics[columns])
