"""FedCAC: critical parameters by |update ⊙ theta| with the authors' tie rules, the overlap of
critical sets and the rising threshold against hand computations, customised models as plain
means over collaborators next to the n_i-weighted global model, the composition, and tau -> 0
(nothing critical) as FedAvg bit for bit."""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
import torch
from conftest import learned_run, num_parameters

import pfedkit
from pfedkit.algorithms.fedcac import (FedCAC, collaboration_threshold, collaborators, compose, critical_mask,
                                       overlap_matrix)
from pfedkit.core.contract import Setup


def mask_of(sensitivities: list[float], tau: float) -> list[bool]:
    """critical_mask of one tensor whose sensitivities |(after - before) * after| are the given
    values: after = 1, before = 1 - s."""
    after = torch.ones(len(sensitivities), dtype=torch.float64)
    before = after - torch.tensor(sensitivities, dtype=torch.float64)
    return critical_mask({"w": before}, {"w": after}, tau)["w"].tolist()


def test_critical_entries_are_the_top_tau_of_update_times_value_per_tensor():
    before = {"a": torch.tensor([1.0, 2.0, 3.0, 4.0]), "b": torch.tensor([[0.0, 1.0], [1.0, -1.0]])}
    after = {"a": torch.tensor([1.5, 1.0, 3.1, -4.0]), "b": torch.tensor([[0.3, 1.0], [0.0, -3.0]])}
    # sensitivities: a = [0.75, 1.0, 0.31, 32.0]; b = [0.09, 0, 0, 6.0]
    masks = critical_mask(before, after, tau=0.5)
    assert masks["a"].tolist() == [False, True, False, True]
    assert masks["b"].tolist() == [[True, False], [False, True]]  # per tensor: its own top half


def test_the_authors_tie_rules():
    assert mask_of([0.5, 0.2, 0.5, 0.1], tau=0.25) == [True, False, True, False]  # ties at the threshold count
    assert mask_of([0.5, 0.2, 0.1, 0.3], tau=0.2) == [False] * 4  # int(0.2 * 4) = 0 critical entries
    assert mask_of([0.0, 0.0, 0.0, 2e-10, 0.4, 0.0], tau=0.5) == [False, False, False, True, True, False]
    assert mask_of([0.0, 0.0, 0.0, 0.0], tau=0.5) == [True] * 4  # nothing moved: all >= 0


def test_overlap_threshold_and_collaborators_match_a_hand_computation():
    masks = [{"w": torch.tensor([1, 1, 0, 0], dtype=torch.bool)}, {"w": torch.tensor([1, 0, 1, 0], dtype=torch.bool)},
             {"w": torch.tensor([1, 1, 1, 0], dtype=torch.bool)}]
    overlap = overlap_matrix(masks)
    expected = np.array([[np.nan, 0.5, 0.75], [0.5, np.nan, 0.75], [5 / 6, 5 / 6, np.nan]])  # 1 - |m_i - m_j| / (2 |m_i|)
    np.testing.assert_allclose(overlap, expected)
    mean, top = (0.5 + 0.75 + 0.5 + 0.75 + 5 / 6 + 5 / 6) / 6, 5 / 6
    assert math.isclose(collaboration_threshold(overlap, 3, 10.0), mean + 0.3 * (top - mean))
    chosen = collaborators(overlap, collaboration_threshold(overlap, 3, 10.0))
    assert chosen.tolist() == [[True, False, True], [False, True, True], [True, True, True]]
    assert collaborators(overlap, collaboration_threshold(overlap, 10, 10.0)).tolist() == \
        [[True, False, False], [False, True, False], [True, True, True]]  # t = beta: only the largest overlaps


def algorithm(**options) -> FedCAC:
    return FedCAC(FedCAC.Hyper(**options), Setup(3, 2, np.ones((3, 2)), seed=0, local_epochs=1, ops=None))


def test_customised_models_are_plain_means_over_collaborators_and_the_global_model_is_weighted_by_n_i():
    algo = algorithm(tau=0.5, beta=1.0)  # t = beta in round 1: only the largest overlap, 5/6 (client 2's)
    masks = [torch.tensor([True, True, False, False]), torch.tensor([True, False, True, False]),
             torch.tensor([True, True, True, False])]
    models = [torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([5.0, 6.0, 7.0, 8.0]), torch.tensor([0.0, 0.0, 0.0, 1.0])]
    replies = {cid: {"params": {"w": models[cid]}, "weight": n, "critical": {"w": masks[cid]}}
               for cid, n in zip(range(3), [1, 2, 5])}
    server = algo.aggregate(1, algo.init_server({"w": torch.zeros(4)}), replies)
    torch.testing.assert_close(server["params"]["w"], (models[0] + 2 * models[1] + 5 * models[2]) / 8)
    torch.testing.assert_close(server["customised"][2]["w"], (models[0] + models[1] + models[2]) / 3)  # o_2j = 5/6
    torch.testing.assert_close(server["customised"][0]["w"], models[0])  # o_0j <= 0.75 < 5/6
    received = algo.broadcast(2, server, [2])[2]["params"]["w"]
    expected = torch.where(masks[2], (models[0] + models[1] + models[2]) / 3, server["params"]["w"])
    torch.testing.assert_close(received, expected)
    assert torch.equal(algo.client_model(2, server, None)["w"], received)
    assert torch.equal(received[3], server["params"]["w"][3]) and not torch.equal(received[:3], server["params"]["w"][:3])
    assert algo.client_model(1, algo.init_server({"w": torch.zeros(4)}), None)["w"].eq(0).all()  # never trained


def test_composition_takes_critical_entries_from_the_customised_model():
    mask = {"w": torch.tensor([True, False, True])}
    composed = compose({"w": torch.tensor([1.0, 2.0, 3.0])}, {"w": torch.tensor([7.0, 8.0, 9.0])}, mask)
    assert composed["w"].tolist() == [7.0, 2.0, 9.0]


def test_with_nothing_critical_fedcac_is_fedavg_bit_for_bit(small_config):
    """tau so small that no tensor has a critical entry: every client receives the global model."""
    config = {**small_config, "join_ratio": 0.75}
    fedavg = pfedkit.run({**config, "algorithm": "fedavg"}).metrics
    fedcac = pfedkit.run({**config, "algorithm": "fedcac", "fedcac": {"tau": 1e-9}}).metrics
    columns = ["round", "client", "accuracy", "loss", "train_loss", "bytes_down"]
    pd.testing.assert_frame_equal(fedcac[columns], fedavg[columns])


def test_fedcac_learns_on_digits_and_uploads_the_mask(small_config):
    _, metrics, state = learned_run({**small_config, "algorithm": "fedcac", "join_ratio": 0.75})
    entries = num_parameters(state.server["params"])
    joined = metrics[(metrics["round"] >= 1) & (metrics["participated"] == 1)]
    assert (joined["bytes_up"] == 4 * entries + 8 + entries).all() and (joined["bytes_down"] == 4 * entries).all()
    assert state.server["critical"] and set(state.server["customised"]) == set(state.server["critical"])
