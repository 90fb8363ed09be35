"""FedGH: the server's head is exactly one seeded SGD pass over the uploaded (class mean, label)
pairs, bodies never leave the clients, and a client predicts with its own body + the global head."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import final_state, num_parameters
from torch import nn

import pfedkit
from pfedkit.algorithms.fedgh import FedGH
from pfedkit.config import load_config
from pfedkit.core.contract import ClientData, Setup
from pfedkit.core.errors import ConfigError
from pfedkit.core.model_ops import ModelOps
from pfedkit.core.params import select
from pfedkit.core.seeds import SERVER, torch_generator
from pfedkit.models.base import BodyHeadModel
from pfedkit.runs import prepare


def tiny_model(feature_dim: int = 5) -> BodyHeadModel:
    return BodyHeadModel([("fc1", nn.Linear(3, feature_dim)), ("relu", nn.ReLU()), ("fc", nn.Linear(feature_dim, 4))], "fc")


def tiny_algorithm(client_ops=None, **hyper) -> FedGH:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        ops = ModelOps(tiny_model)
    return FedGH(FedGH.Hyper(**hyper), Setup(3, 4, np.ones((3, 4)), seed=5, local_epochs=1, ops=ops,
                                             client_ops=client_ops))


def test_server_head_is_one_sgd_pass_over_the_uploaded_pairs():
    algo = tiny_algorithm(server_lr=0.7, server_batch_size=3)
    head = select(algo.setup.ops.initial_params(), "head")
    generator = torch.Generator().manual_seed(2)
    replies = {2: {"features": torch.randn(2, 5, generator=generator), "classes": torch.tensor([1, 3])},
               0: {"features": torch.randn(3, 5, generator=generator), "classes": torch.tensor([0, 1, 2])},
               1: {"features": torch.randn(3, 5, generator=generator), "classes": torch.tensor([0, 2, 3])}}
    new = algo.aggregate(4, {"head": head}, replies)["head"]

    # by hand: pairs in client order, one seeded permutation, batches of 3, W -= lr (P - Y)^T X / B
    x = torch.cat([replies[c]["features"] for c in (0, 1, 2)]).double()
    y = torch.cat([replies[c]["classes"] for c in (0, 1, 2)])
    weight, bias = head["head.fc.weight"].double().clone(), head["head.fc.bias"].double().clone()
    order = torch.randperm(8, generator=torch_generator(5, 4, SERVER, "fedgh"))
    for batch in order.split(3):
        residual = (torch.softmax(x[batch] @ weight.T + bias, dim=1) - F.one_hot(y[batch], 4).double()) / len(batch)
        weight, bias = weight - 0.7 * residual.T @ x[batch], bias - 0.7 * residual.sum(0)
    torch.testing.assert_close(new["head.fc.weight"].double(), weight, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(new["head.fc.bias"].double(), bias, atol=1e-6, rtol=1e-5)
    assert not torch.allclose(new["head.fc.weight"], head["head.fc.weight"])


def test_client_trains_own_body_with_the_global_head_and_uploads_only_class_means():
    algo = tiny_algorithm()
    initial = algo.setup.ops.initial_params()
    own = {name: value + 0.5 for name, value in initial.items()}
    global_head = {name: value - 1.0 for name, value in select(initial, "head").items()}
    x, y = torch.randn(9, 3, generator=torch.Generator().manual_seed(1)), torch.tensor([0, 2, 2, 0, 3, 3, 3, 0, 2])
    data = ClientData(1, x, y, x[:2], y[:2], np.array([3, 0, 3, 3]))
    update = algo.client_update(1, 1, {"params": own}, {"head": global_head}, data)
    request = next(update)
    assert request.trainable == "all"
    for name, value in request.params.items():
        assert torch.equal(value, global_head[name] if name.startswith("head.") else own[name])
    trained = {name: value * 0.9 for name, value in request.params.items()}
    try:
        update.send(trained)
    except StopIteration as stop:
        state, reply = stop.value
    assert set(reply) == {"features", "classes"}  # no body, no head
    features = algo.setup.ops.features(trained, x)
    assert reply["classes"].tolist() == [0, 2, 3]
    torch.testing.assert_close(reply["features"], torch.stack([features[y == c].mean(0) for c in (0, 2, 3)]))
    assert state["params"] is trained
    server = {"head": global_head}
    model = algo.client_model(1, server, state)
    assert all(torch.equal(model[n], trained[n]) for n in select(trained, "body"))
    assert all(torch.equal(model[n], global_head[n]) for n in global_head) and set(model) == set(initial)


def test_heads_of_other_shapes_are_refused():
    ops = [ModelOps(tiny_model), ModelOps(tiny_model), ModelOps(lambda: tiny_model(6))]
    with pytest.raises(ConfigError, match="fedgh shares one head"):
        tiny_algorithm(client_ops=tuple(ops)).check()
    tiny_algorithm(client_ops=tuple(ops[:2] + ops[:1])).check()  # same head everywhere: accepted


def test_fedgh_learns_on_digits_keeps_bodies_private(small_config, tmp_path):
    # server_lr 0.1: PFLlib's default 1.0 makes the head jump between rounds (accuracy 0.1-0.4 in
    # the first 3 rounds of this tiny run, 0.9 by round 10); 0.1 learns steadily.
    config = {**small_config, "algorithm": "fedgh", "join_ratio": 0.75, "fedgh": {"server_lr": 0.1}}
    sequential = pfedkit.run(config)  # processes == sequential: tests/test_backends.py

    metrics = sequential.metrics
    assert metrics[metrics["round"] == metrics["round"].max()]["accuracy"].mean() > 0.3
    state = final_state(sequential)
    head_bytes = 4 * num_parameters(state.server["head"])
    d = state.server["head"]["head.fc.weight"].shape[1]
    joined = metrics[metrics["participated"] == 1]
    assert (joined["bytes_down"] == head_bytes).all()
    data = prepare(load_config(config)).simulation.data
    classes = {cid: int((client.class_counts > 0).sum()) for cid, client in enumerate(data.clients)}
    assert all(row.bytes_up == classes[row.client] * (4 * d + 8) for row in joined.itertuples())
    bodies = [select(client["params"], "body") for client in state.clients]
    assert not all(torch.equal(bodies[0][n], bodies[1][n]) for n in bodies[0])  # not averaged
