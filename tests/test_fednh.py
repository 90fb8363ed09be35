"""FedNH (baselines.md "FedNH"): unit-norm prototypes, the server's prototype update by hand, rho = 1
freezes them, local training never changes them, plain-mean aggregation, and end-to-end runs."""
from __future__ import annotations

import math

import pandas as pd
import pytest
import torch
import torch.nn.functional as F

import pfedkit
from pfedkit.core.contract import Forward
from pfedkit.algorithms.fednh import (class_prototype_sums, cosine_logits, fednh_loss, initial_prototypes,
                                      update_prototypes, upload_sums)
from pfedkit.config import load_config
from pfedkit.core.params import select
from pfedkit.core.seeds import SERVER, torch_generator
from pfedkit.engine.trainer import FitJob
from pfedkit.run_files import read_diagnostics
from pfedkit.runs import prepare

from conftest import final_state


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def config(small_config):
    return {**small_config, "algorithm": "fednh"}


def drive(prepared, cid, rnd=1):
    """One client_update of client `cid` on the round's broadcast, answered by the real trainer."""
    algo, data = prepared.simulation.algorithm, prepared.data.clients[cid]
    message = algo.broadcast(rnd, prepared.state.server, [cid])[cid]
    update = algo.client_update(rnd, cid, prepared.state.clients[cid], message, data)
    request = next(update)
    outcome = prepared.runtime.trainer.fit(FitJob(rnd, cid, 0, request, None), data.x_train, data.y_train)
    with pytest.raises(StopIteration) as stop:
        update.send(outcome.params)
    return message, request, outcome.params, *stop.value.value


def test_prototype_rows_stay_unit_norm_and_a_class_without_data_keeps_its_row():
    mu = initial_prototypes(5, 8, torch.Generator().manual_seed(0))
    torch.testing.assert_close(mu.norm(dim=1), torch.ones(5))
    torch.testing.assert_close(mu @ mu.T, torch.eye(5), atol=1e-6, rtol=0)  # C <= D: orthonormal rows
    wide = initial_prototypes(12, 4, torch.Generator().manual_seed(0))  # C > D: rows still unit norm
    torch.testing.assert_close(wide.norm(dim=1), torch.ones(12))
    sums = torch.randn(5, 8, generator=torch.Generator().manual_seed(1)) * 7
    counts = torch.tensor([3, 0, 9, 1, 0])
    for rho in (0.0, 0.5, 0.9):
        new = update_prototypes(mu, sums, counts, rho)
        torch.testing.assert_close(new.norm(dim=1), torch.ones(5))
        assert torch.equal(new[1], mu[1]) and torch.equal(new[4], mu[4])
        assert not torch.allclose(new[0], mu[0])


def test_prototype_update_equals_a_hand_computation():
    mu = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    # client A: two class-0 samples with h = (3, 4) and (6, 8): h/||h|| = (0.6, 0.8) -> r = 2 (0.6, 0.8)
    # client B: one class-0 sample h = (0, 2) -> r = (0, 1); class 1: h = (2, 0), (0, 10) -> normalised
    # (1, 0), (0, 1), mean (0.5, 0.5) -> normalize -> (1, 1)/sqrt2, r = 2 (1, 1)/sqrt2 (the raw mean
    # (1, 5) would point elsewhere: the per-sample normalisation matters)
    sums_a, counts_a = class_prototype_sums(torch.tensor([[3.0, 4.0], [6.0, 8.0]]), torch.tensor([0, 0]), 2)
    sums_b, counts_b = class_prototype_sums(torch.tensor([[0.0, 2.0], [2.0, 0.0], [0.0, 10.0]]),
                                            torch.tensor([0, 1, 1]), 2)
    root2 = math.sqrt(2)
    torch.testing.assert_close(sums_a[0], torch.tensor([1.2, 1.6]))
    torch.testing.assert_close(sums_b, torch.tensor([[0.0, 1.0], [root2, root2]]))
    assert counts_a.tolist() == [2, 0] and counts_b.tolist() == [1, 2]
    uploads = [({0: sums_a[0]}, {0: 2}), ({0: sums_b[0], 1: sums_b[1]}, {0: 1, 1: 2})]
    sums, counts = upload_sums(uploads, 2, 2)
    assert counts.tolist() == [3, 2]
    new = update_prototypes(mu, sums, counts, rho=0.75)
    # class 0: avg = normalize((1.2, 2.6) / 3); mu_0 = normalize(0.75 (1, 0) + 0.25 avg)
    norm = math.sqrt(1.2 ** 2 + 2.6 ** 2)
    moved = (0.75 + 0.25 * 1.2 / norm, 0.25 * 2.6 / norm)
    torch.testing.assert_close(new[0], torch.tensor(moved) / math.hypot(*moved))
    # class 1: avg = (1, 1)/sqrt2; mu_1 = normalize(0.75 (0, 1) + 0.25 (1, 1)/sqrt2)
    moved = (0.25 / root2, 0.75 + 0.25 / root2)
    torch.testing.assert_close(new[1], torch.tensor(moved) / math.hypot(*moved))


def test_cosine_logits_and_the_loss_use_normalised_features_and_the_scale():
    features = torch.tensor([[3.0, 4.0], [0.0, -2.0]])
    mu = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.6, 0.8]])
    expected = 2.5 * torch.tensor([[0.6, 0.8, 1.0], [0.0, -1.0, -0.8]])
    torch.testing.assert_close(cosine_logits(features, mu, 2.5), expected)
    torch.testing.assert_close(cosine_logits(5 * features, 3 * mu, 2.5), expected)  # scale-free in h and mu
    y = torch.tensor([2, 0])
    out = Forward(features, torch.zeros(2, 3))
    learned = fednh_loss(out, y, {"head.w": mu, "scale": torch.tensor(2.5)}, {}, weight_name="head.w")
    fixed = fednh_loss(out, y, {"head.w": mu}, {"scale": torch.tensor(2.5)}, weight_name="head.w")
    torch.testing.assert_close(learned, F.cross_entropy(expected, y))
    torch.testing.assert_close(fixed, learned)


def test_local_training_never_changes_the_prototypes_but_trains_body_and_scale(config):
    prepared = prepare(load_config(config))
    algo = prepared.simulation.algorithm
    message, request, trained, state, reply = drive(prepared, 1)
    assert request.trainable == "body" and set(request.extra) == {"scale"}
    assert torch.equal(trained[algo.weight_name], message["prototypes"])
    assert torch.count_nonzero(trained[algo.bias_name]) == 0
    assert any(not torch.equal(trained[n], message["body"][n]) for n in message["body"])
    assert float(trained["scale"]) != float(message["scale"]) and torch.equal(reply["scale"], trained["scale"])
    assert state is None  # evaluate="global": the client keeps nothing
    # the upload: n_c normalize(mean of the normalised features of class c), and the counts
    data = prepared.data.clients[1]
    features = F.normalize(algo.setup.ops.features(trained, data.x_train), dim=1)
    for c, vector in reply["prototypes"].items():
        mask = data.y_train == c
        assert reply["counts"][c] == int(mask.sum())
        torch.testing.assert_close(vector, int(mask.sum()) * F.normalize(features[mask].mean(0), dim=0))
    assert sorted(reply["prototypes"]) == sorted(set(data.y_train.tolist()))
    assert set(reply) == {"body", "scale", "prototypes", "counts"}
    assert set(reply["body"]) == set(select(trained, "body"))


def test_fixed_scale_is_neither_trained_nor_sent(config):
    prepared = prepare(load_config({**config, "fednh": {"learn_scale": False, "scale_init": 30.0}}))
    message, request, trained, _, reply = drive(prepared, 0)
    assert "scale" not in message and "scale" not in reply and not request.extra
    assert float(request.context["scale"]) == 30.0


def test_server_averages_body_and_scale_uniformly(config):
    prepared = prepare(load_config(config))
    algo, server = prepared.simulation.algorithm, prepared.state.server
    body = server["body"]
    d = server["prototypes"].shape[1]
    replies = {0: {"body": {n: t + 1.0 for n, t in body.items()}, "scale": torch.tensor(2.0),
                   "prototypes": {3: torch.ones(d)}, "counts": {3: 5}},
               2: {"body": {n: t + 4.0 for n, t in body.items()}, "scale": torch.tensor(5.0),
                   "prototypes": {3: torch.arange(float(d)), 7: torch.ones(d)}, "counts": {3: 50, 7: 1}}}
    new = algo.aggregate(1, server, replies)
    for n in body:  # not weighted by the clients' sample counts (5 and 51)
        torch.testing.assert_close(new["body"][n], body[n] + 2.5)
    assert float(new["scale"]) == 3.5
    moved = [c for c in range(10) if not torch.equal(new["prototypes"][c], server["prototypes"][c])]
    assert moved == [3, 7]  # only the classes with data this round


def test_rho_one_keeps_the_initial_prototypes(config):
    result = pfedkit.run({**config, "fednh": {"rho": 1.0}})
    c, d = final_state(result).server["prototypes"].shape
    initial = initial_prototypes(c, d, torch_generator(config["seed"], 0, SERVER, "fednh-prototypes"))
    # unchanged up to float32 rounding of the renormalisation (a moved prototype differs by ~1e-2)
    torch.testing.assert_close(final_state(result).server["prototypes"], initial, atol=1e-6, rtol=0)


def test_end_to_end_bytes_diagnostics_and_accuracy(config):
    result = pfedkit.run({**config, "grad_clip": 10.0, "fednh": {"learn_scale": False, "scale_init": 30.0}})
    prepared = prepare(load_config(config))
    counts = prepared.data.train_counts()
    body_bytes = sum(t.numel() for t in prepared.state.server["body"].values()) * 4
    c, d = prepared.state.server["prototypes"].shape
    m = result.metrics[result.metrics["round"] >= 1]
    for _, row in m.iterrows():
        assert row["bytes_down"] == body_bytes + c * d * 4
        assert row["bytes_up"] == body_bytes + (counts[int(row["client"])] > 0).sum() * (d * 4 + 8)
    state = final_state(result)
    torch.testing.assert_close(state.server["prototypes"].norm(dim=1), torch.ones(c))
    diagnostics = read_diagnostics(result.run_dir / "diagnostics.pt")
    assert sorted(diagnostics["prototypes"]) == [1, 2, 3] and diagnostics["prototypes"][3].shape == (c, d)
    assert all(v == 30.0 for v in diagnostics["scale"].values())
    assert (diagnostics["prototype_shift"][1] > 0).all()  # every class has data: every row moved
    last = m[m["round"] == 3]
    assert last["correct"].sum() / last["n_test"].sum() > 0.6


def test_personal_evaluation_uses_the_clients_trained_model_and_scale(config):
    result = pfedkit.run({**config, "rounds": 2, "fednh": {"evaluate": "personal"}})
    state = final_state(result)
    algo = prepare(load_config({**config, "fednh": {"evaluate": "personal"}})).simulation.algorithm
    for cid, client in enumerate(state.clients):
        assert set(client) == {"params", "scale"}
        assert algo.client_model(cid, state.server, client) is client["params"]
        # trained in round 2 from the prototypes the server had after round 1, not the new ones
        assert not torch.equal(client["params"][algo.weight_name], state.server["prototypes"])
        features = torch.randn(3, state.server["prototypes"].shape[1])
        predicting = algo.evaluation_state(cid, state.server, client, client["params"], None)
        torch.testing.assert_close(algo.predict(cid, state.server, predicting, features),
                                   cosine_logits(features, client["params"][algo.weight_name], client["scale"]))
    assert not result.metrics["accuracy"].isna().any()


def test_the_global_model_right_after_training_is_the_personal_model(config):
    """Every client trains every round: at eval_point=after_local_training each is scored with its
    trained body, the mu it trained with and its trained s, which is PM at the default eval point."""
    columns = ["round", "client", "accuracy", "loss"]
    after_training = pfedkit.run({**config, "rounds": 2, "eval_point": "after_local_training"})
    personal = pfedkit.run({**config, "rounds": 2, "fednh": {"evaluate": "personal"}})
    assert after_training.metrics["participated"].all()
    pd.testing.assert_frame_equal(after_training.metrics[columns], personal.metrics[columns])


def test_processes_backend_gives_the_sequential_metrics(config):
    columns = ["round", "client", "accuracy", "loss", "bytes_up", "bytes_down"]
    base = {**config, "rounds": 2, "join_ratio": 0.75, "fednh": {"evaluate": "personal"}}
    sequential = pfedkit.run({**base, "backend": "sequential"})
    processes = pfedkit.run({**base, "backend": "processes", "workers": 2})
    pd.testing.assert_frame_equal(sequential.metrics[columns], processes.metrics[columns])
