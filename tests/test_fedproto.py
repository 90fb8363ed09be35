"""FedProto (baselines.md "FedProto"): uploads are the class means of the body outputs, prediction is
the nearest global prototype, round 1 has no regulariser, bytes match, and an end-to-end run."""
from __future__ import annotations

import pandas as pd
import pytest
import torch

import pfedkit
from pfedkit.algorithms.fedproto import FedProto, prototype_logits
from pfedkit.algorithms.prototype_exchange import prototype_loss
from pfedkit.config import load_config
from pfedkit.core.contract import Forward, cross_entropy
from pfedkit.engine.trainer import FitJob
from pfedkit.runs import prepare

from conftest import final_state


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def config(small_config):
    return {**small_config, "algorithm": "fedproto"}


def drive(algo, trainer, rnd, cid, client, message, data):
    """Run one client_update to completion, answering its Fit requests with `trainer`; returns
    (first request, new state, reply)."""
    update = algo.client_update(rnd, cid, client, message, data)
    request = first = next(update)
    index = 0
    while True:
        outcome = trainer.fit(FitJob(rnd, cid, index, request, data.buffers), data.x_train, data.y_train)
        index += 1
        try:
            request = update.send(outcome.params)
        except StopIteration as stop:
            return (first, *stop.value)


def test_uploaded_prototypes_are_the_class_means_of_the_trained_body_outputs(config):
    prepared = prepare(load_config(config))
    algo, trainer, data = prepared.simulation.algorithm, prepared.runtime.trainer, prepared.data.clients[1]
    client = algo.init_client(1, algo.setup.ops.initial_params())
    received = {"features": {c: torch.randn(algo.feature_dim, generator=torch.Generator().manual_seed(c))
                             for c in range(0, 10, 2)}}
    _, state, reply = drive(algo, trainer, 2, 1, client, received, data)
    features = algo.setup.ops.features(state["params"], data.x_train)
    owned = sorted(set(data.y_train.tolist()))
    assert sorted(reply["features"]) == owned and sorted(reply["counts"]) == owned
    for c in owned:
        mask = data.y_train == c
        torch.testing.assert_close(reply["features"][c], features[mask].mean(dim=0))
        assert reply["counts"][c] == int(mask.sum())
    assert set(state) == {"params"}  # no weights leave the client; it keeps only its model


def test_global_prototype_is_the_plain_mean_of_the_owners_uploads_by_default(config):
    algo = prepare(load_config(config)).simulation.algorithm
    server = algo.init_server(algo.setup.ops.initial_params())
    d = algo.feature_dim
    replies = {0: {"features": {2: torch.full((d,), 1.0), 5: torch.full((d,), 7.0)}, "counts": {2: 90, 5: 3}},
               3: {"features": {2: torch.full((d,), 4.0)}, "counts": {2: 10}}}
    server = algo.aggregate(1, server, replies)
    assert server["present"].nonzero().squeeze(1).tolist() == [2, 5]
    torch.testing.assert_close(server["features"][2], torch.full((d,), 2.5))  # not (90 + 40) / 100
    torch.testing.assert_close(server["features"][5], torch.full((d,), 7.0))
    counted = FedProto(FedProto.Hyper(global_feature_weighting="count"), algo.setup)
    server = counted.aggregate(1, counted.init_server(algo.setup.ops.initial_params()), replies)
    torch.testing.assert_close(server["features"][2], torch.full((d,), 1.3))
    # a later round keeps the classes nobody uploaded
    server = counted.aggregate(2, server, {1: {"features": {5: torch.zeros(d)}, "counts": {5: 4}}})
    torch.testing.assert_close(server["features"][2], torch.full((d,), 1.3))
    assert torch.count_nonzero(server["features"][5]) == 0


def test_predict_returns_the_class_of_the_nearest_global_prototype(config):
    algo = prepare(load_config(config)).simulation.algorithm
    prototypes = torch.tensor([[0.0, 0.0], [10.0, 0.0], [0.0, 10.0], [0.0, 0.0]])
    present = torch.tensor([True, True, True, False])  # class 3 has no global prototype
    features = torch.tensor([[1.0, 1.0], [9.0, -2.0], [4.0, 7.0], [0.1, 0.0]])
    logits = algo.predict(0, {"features": prototypes, "present": present}, {}, features)
    assert logits.argmax(dim=1).tolist() == [0, 1, 2, 0]  # never class 3, though it sits on sample 3
    torch.testing.assert_close(logits[:, :3], -torch.cdist(features, prototypes[:3]))
    assert torch.isneginf(logits[:, 3]).all()
    torch.testing.assert_close(prototype_logits(features, prototypes, present), logits)


def test_predict_with_head_option_uses_the_clients_own_head(config):
    prepared = prepare(load_config({**config, "fedproto": {"prediction": "head"}}))
    algo, client = prepared.simulation.algorithm, prepared.state.clients[0]
    features = torch.randn(5, algo.feature_dim)
    server = {"features": torch.zeros(10, algo.feature_dim), "present": torch.ones(10, dtype=torch.bool)}
    torch.testing.assert_close(algo.predict(0, server, client, features),
                               algo.setup.ops.head_logits(client["params"], features))


def test_no_regulariser_in_round_one_then_every_class_with_a_global_prototype_is_pulled(config):
    one_round = {**config, "rounds": 1}
    fedproto = final_state(pfedkit.run(one_round)).clients
    local = final_state(pfedkit.run({**one_round, "algorithm": "local"})).clients
    for a, b in zip(fedproto, local):
        assert all(torch.equal(a["params"][n], b["params"][n]) for n in a["params"])
    # a = 0: the target is the received prototype even on a client's first participation
    algo = FedProto(FedProto.Hyper(lam=2.0), prepare(load_config(config)).simulation.algorithm.setup)
    update = algo.client_update(2, 0, algo.init_client(0, algo.setup.ops.initial_params()),
                                {"features": {3: torch.ones(algo.feature_dim)}}, None)
    request = next(update)
    targets = request.context["prototypes"]
    assert (~torch.isnan(targets).any(dim=1)).nonzero().squeeze(1).tolist() == [3]
    torch.testing.assert_close(targets[3], torch.ones(algo.feature_dim))
    # FedProto's per-sample MSE: mean over the B = 2 samples and d dimensions; class 4 (no global
    # prototype) contributes 0 but counts in B
    features = torch.zeros(2, algo.feature_dim, requires_grad=True)
    out = Forward(features, torch.zeros(2, 10))
    y = torch.tensor([3, 4])
    loss = request.loss(out, y, {}, request.context)
    torch.testing.assert_close(loss, cross_entropy(out, y, {}, {}) + 2.0 * 0.5)
    loss.backward()  # d/df of 2 * sum (f - 1)^2 / (2 d) on sample 0: -2 / d; 0 on sample 1
    torch.testing.assert_close(features.grad[0], torch.full((algo.feature_dim,), -2.0 / algo.feature_dim))
    assert torch.count_nonzero(features.grad[1]) == 0


def test_class_distance_regulariser_option_uses_the_batch_class_means(config):
    algo = FedProto(FedProto.Hyper(lam=1.0, regulariser="class_distance"),
                    prepare(load_config(config)).simulation.algorithm.setup)
    request = next(algo.client_update(2, 0, algo.init_client(0, algo.setup.ops.initial_params()),
                                      {"features": {3: torch.ones(algo.feature_dim)}}, None))
    assert request.loss.func is prototype_loss and request.loss.keywords["regulariser"] == "class_distance"
    features = torch.zeros(3, algo.feature_dim)
    features[1] = 4.0  # batch mean of class 3 = 2 -> ||2 - 1||^2 = d
    out = Forward(features, torch.zeros(3, 10))
    y = torch.tensor([3, 3, 4])
    torch.testing.assert_close(request.loss(out, y, {}, request.context),
                               cross_entropy(out, y, {}, {}) + float(algo.feature_dim))


def test_end_to_end_bytes_prototypes_and_accuracy(config):
    result = pfedkit.run(config)
    counts = prepare(load_config(config)).data.train_counts()  # [N, C]
    state = final_state(result)
    d = 200  # digits MLP feature dimension
    assert state.server["features"].shape == (10, d)
    owned = (counts > 0).sum(axis=1)
    m = result.metrics[result.metrics["round"] >= 1]
    for _, row in m.iterrows():
        assert row["bytes_up"] == owned[int(row["client"])] * (4 * d + 8)  # d float32 + one count per class
        present = 0 if row["round"] == 1 else int(state.server["present"].sum())
        assert row["bytes_down"] == present * 4 * d
    assert int(state.server["present"].sum()) == int((counts.sum(axis=0) > 0).sum())
    last = m[m["round"] == m["round"].max()]
    assert last["correct"].sum() / last["n_test"].sum() > 0.6  # 10 classes: chance is 0.1
    assert set(result.metrics.columns) >= {"accuracy"} and result.summary is not None


def test_processes_backend_gives_the_sequential_metrics(config):
    columns = ["round", "client", "accuracy", "loss", "bytes_up", "bytes_down"]
    base = {**config, "rounds": 2, "join_ratio": 0.75}
    sequential = pfedkit.run({**base, "backend": "sequential"})
    processes = pfedkit.run({**base, "backend": "processes", "workers": 2})
    pd.testing.assert_frame_equal(sequential.metrics[columns], processes.metrics[columns])
