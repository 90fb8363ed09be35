"""pFedSim: an all-warm-up run is FedAvg, the warm-up's end, the classifier similarity (1) and the
weights (2) by hand, the server's similarity updates and stored models, the personalised download
(own head, mixed body; unchanged without a similar client), equal similarities giving FedPer's
body average, and a digits run that learns."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import TinyNet, final_state, tiny_params

import pfedkit
from pfedkit.algorithms.pfedsim import PFedSim, aggregation_weights, classifier_similarity
from pfedkit.core.aggregation import fedavg_aggregate
from pfedkit.core.contract import Setup
from pfedkit.core.model_ops import ModelOps
from pfedkit.core.params import select

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def algorithm(num_clients: int = 3, rounds: int = 10, **options) -> PFedSim:
    setup = Setup(num_clients, 3, np.ones((num_clients, 3)), 0, 1, ModelOps(TinyNet), rounds=rounds)
    return PFedSim(PFedSim.Hyper(**options), setup)


def test_an_all_warm_up_run_is_fedavg(small_config):
    fedavg = pfedkit.run({**small_config, "out_dir": small_config["out_dir"] + "-fedavg"}).metrics
    pfedsim = pfedkit.run({**small_config, "algorithm": "pfedsim", "pfedsim": {"warmup": 1.0}}).metrics
    for column in ["round", "client", "accuracy", "loss", "train_loss", "bytes_up", "bytes_down"]:
        np.testing.assert_array_equal(pfedsim[column].to_numpy(), fedavg[column].to_numpy(), err_msg=column)


def test_the_warm_up_lasts_int_warmup_R_rounds():
    assert [algorithm(rounds=10, warmup=0.55).warming_up(r) for r in range(1, 11)] == [True] * 5 + [False] * 5
    assert not algorithm(rounds=10, warmup=0.0).warming_up(1)


def test_classifier_similarity_by_hand():
    w_i = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    # rows: cos 1 and cos 45 degrees: mean (1 + 1/sqrt 2) / 2
    assert classifier_similarity(w_i, torch.tensor([[2.0, 0.0], [1.0, 1.0]])) == pytest.approx((1 + 2 ** -0.5) / 2)
    # rows: cos 45 degrees and -1: a negative mean is clipped to 0
    assert classifier_similarity(w_i, torch.tensor([[1.0, 1.0], [0.0, -1.0]])) == 0.0
    # row-wise, not over the flattened matrices (whose cosine here is 0.8)
    assert classifier_similarity(w_i, torch.tensor([[1.0, 0.0], [1.0, 0.0]])) == pytest.approx(0.5)


def test_aggregation_weights_by_hand():
    similarity = torch.tensor([[1.0, 0.5, 0.0, 0.2], [0.5, 1.0, 0.3, 0.0], [0.0, 0.3, 1.0, 0.0], [0.2, 0.0, 0.0, 1.0]])
    logits = [-math.log(1e-4), -math.log(0.5), 0.0, -math.log(0.8)]
    np.testing.assert_allclose(aggregation_weights(similarity, 0).numpy(), np.array(logits) / sum(logits))
    logits = [0.0, -math.log(0.7), -math.log(1e-4), 0.0]
    np.testing.assert_allclose(aggregation_weights(similarity, 2).numpy(), np.array(logits) / sum(logits))


def shifted(params, by):
    return {name: t + by for name, t in params.items()}


def test_server_stores_the_trained_models_and_updates_the_participants_similarities():
    algo = algorithm(num_clients=3, warmup=0.0)
    server = algo.init_server(tiny_params(0))
    server["similarity"][0, 1] = server["similarity"][1, 0] = 0.4  # from an earlier round
    earlier = {0: tiny_params(5), 1: tiny_params(6)}
    server = {**server, "models": earlier}
    trained = {0: tiny_params(1), 2: {n: t + 0.3 * tiny_params(2)[n] for n, t in tiny_params(1).items()}}
    after = algo.aggregate(1, server, {cid: {"params": p, "weight": 5} for cid, p in trained.items()})
    expected = classifier_similarity(trained[0]["head.weight"], trained[2]["head.weight"])
    assert 0 < expected < 0.99  # the test has power: an update changes the entry
    similarity = after["similarity"].numpy()
    np.testing.assert_allclose(similarity, [[1, 0.4, expected], [0.4, 1, 0], [expected, 0, 1]])
    assert after["models"].keys() == {0, 1, 2} and after["models"][1] is earlier[1]  # absent: kept
    assert after["models"][0] is trained[0] and after["models"][2] is trained[2]  # participants: replaced
    assert after["params"] is server["params"]  # the warm-up's model stays
    assert server["similarity"][0, 2] == 0  # the old state is not changed in place
    warm = algorithm(num_clients=3, warmup=0.5).aggregate(
        1, server, {0: {"params": tiny_params(1), "weight": 1}, 2: {"params": tiny_params(2), "weight": 3}})
    for name, value in fedavg_aggregate({0: {"params": tiny_params(1), "weight": 1},
                                         2: {"params": tiny_params(2), "weight": 3}}).items():
        torch.testing.assert_close(warm["params"][name], value)


def test_download_mixes_the_bodies_by_similarity_and_keeps_the_own_head():
    algo = algorithm(num_clients=3, warmup=0.0)
    server = algo.init_server(tiny_params(0))
    models = {0: tiny_params(1), 1: shifted(tiny_params(2), 1.0)}  # client 2 has not trained: the global model
    similarity = torch.tensor([[1.0, 0.6, 0.3], [0.6, 1.0, 0.0], [0.3, 0.0, 1.0]], dtype=torch.float64)
    server = {**server, "models": models, "similarity": similarity}
    got = algo.broadcast(2, server, [0, 1, 2])
    bodies = [models[0], models[1], tiny_params(0)]
    for cid, row in enumerate(similarity.tolist()):
        row[cid] = 0.9999
        logits = [-math.log(1 - s) for s in row]
        weights = [x / sum(logits) for x in logits]
        own = models.get(cid, tiny_params(0))
        for name in select(own, "body"):
            expected = sum(w * b[name].double() for w, b in zip(weights, bodies)).float()
            torch.testing.assert_close(got[cid]["params"][name], expected)
        for name in select(own, "head"):
            torch.testing.assert_close(got[cid]["params"][name], own[name], rtol=0, atol=0)
    lonely = {**server, "similarity": torch.eye(3, dtype=torch.float64)}  # no similar client: own model
    assert algo.broadcast(2, lonely, [1])[1]["params"] is models[1]
    warm = algorithm(num_clients=3, rounds=10, warmup=0.5)  # in the warm-up: the global model
    assert warm.broadcast(5, server, [0])[0]["params"] is server["params"]


def test_equal_similarities_give_fedpers_body_average():
    """s_ij = s_ii for all j: uniform weights, the mean of the bodies (FedPer's over equal n_i)."""
    algo = algorithm(num_clients=4, warmup=0.0)
    models = {cid: tiny_params(cid + 1) for cid in range(4)}
    server = {**algo.init_server(tiny_params(0)), "models": models,
              "similarity": torch.full((4, 4), 0.9999, dtype=torch.float64)}
    fedper = fedavg_aggregate({cid: {"params": select(p, "body"), "weight": 7} for cid, p in models.items()})
    for cid, message in algo.broadcast(3, server, [0, 1, 2, 3]).items():
        for name, value in fedper.items():
            torch.testing.assert_close(message["params"][name], value)


def test_digits_run_learns_with_similar_clients(small_config):
    config = {**small_config, "rounds": 4}
    result = pfedkit.run({**config, "algorithm": "pfedsim", "pfedsim": {"warmup": 0.25}})
    metrics = result.metrics
    assert metrics[metrics["round"] == 4]["accuracy"].mean() > 0.3
    state = final_state(result)
    assert sorted(state.server["models"]) == [0, 1, 2, 3]
    similarity = state.server["similarity"].numpy()
    np.testing.assert_array_equal(similarity, similarity.T)
    assert (similarity >= 0).all() and (similarity <= 1 + 1e-12).all()
    assert (similarity[~np.eye(4, dtype=bool)] > 0).any()  # some clients found similar ones
