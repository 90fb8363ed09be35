"""pFedLA: the aggregation weights are a distribution over clients per layer (ReLU-normalised or
softmax), a uniform hypernetwork output mixes as FedAvg does (per layer, equal weights), the
server's step is the vector-Jacobian product through the mixture by hand (only the participant's
hypernetwork moves; its stored model becomes theta_bar + Delta), the step moves the mixture
towards the trained model (away with FL-bench's sign), the client uploads theta~ - theta_bar, and
a short digits run (bytes)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import learned_run, num_parameters
from torch import nn

from pfedkit.algorithms.pfedla import PFedLA, aggregation_weights, client_hypernetwork, layer_groups, relu_normalised
from pfedkit.core.aggregation import fedavg_aggregate
from pfedkit.core.contract import ClientData, Setup
from pfedkit.core.model_ops import ModelOps
from pfedkit.models.base import BodyHeadModel

pytestmark = pytest.mark.usefixtures("one_torch_thread")
NUM_CLIENTS = 4


def tiny_model() -> BodyHeadModel:
    return BodyHeadModel([("fc1", nn.Linear(3, 4)), ("relu", nn.ReLU()), ("fc", nn.Linear(4, 3))], "fc")


def tiny_algorithm(**hyper) -> PFedLA:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        ops = ModelOps(tiny_model)
    hyper = {"embed_dim": 3, "hidden_dim": 5, **hyper}
    setup = Setup(NUM_CLIENTS, 3, np.ones((NUM_CLIENTS, 3)), seed=5, local_epochs=1, ops=ops)
    return PFedLA(PFedLA.Hyper(**hyper), setup)


def random_models(algo: PFedLA, seed: int) -> dict:
    """Every client's stored model, different ones (stacked on the client axis)."""
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(NUM_CLIENTS, *v.shape, generator=g) for n, v in algo.setup.ops.initial_params().items()}


def server_with_models(algo: PFedLA, seed: int = 1) -> dict:
    server = algo.init_server(algo.setup.ops.initial_params())
    return {**server, "models": random_models(algo, seed)}


def random_delta(algo: PFedLA, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(v.shape, generator=g) for n, v in algo.setup.ops.initial_params().items()}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def weights_of(algo: PFedLA, server: dict, cid: int) -> dict:
    return aggregation_weights(client_hypernetwork(server["hn"], cid), cid, list(algo.groups), algo.hyper.normalisation)


def test_layers_group_a_modules_tensors_or_one_per_tensor():
    names = ["body.fc1.weight", "body.fc1.bias", "head.fc.weight", "head.fc.bias"]
    assert layer_groups(names, "layer") == {"body.fc1": names[:2], "head.fc": names[2:]}
    assert layer_groups(names, "tensor") == {name: [name] for name in names}


@pytest.mark.parametrize("normalisation", ["relu", "softmax"])
def test_aggregation_weights_are_a_distribution_over_clients_per_layer(normalisation):
    algo = tiny_algorithm(normalisation=normalisation)
    server = algo.init_server(algo.setup.ops.initial_params())
    hn = server["hn"]
    for cid in range(NUM_CLIENTS):
        alpha = weights_of(algo, server, cid)
        assert set(alpha) == {"body.fc1", "head.fc"}
        for layer, weights in alpha.items():
            assert weights.shape == (NUM_CLIENTS,) and (weights >= 0).all()
            assert float(weights.sum()) == pytest.approx(1.0, abs=1e-6)
            feature = hn["embeddings"][cid]
            for k in range(3):
                feature = torch.relu(hn[f"mlp.{k}.weight"][cid] @ feature + hn[f"mlp.{k}.bias"][cid])
            scores = hn[f"out.{layer}.weight"][cid] @ feature + hn[f"out.{layer}.bias"][cid]
            expected = torch.softmax(scores, 0) if normalisation == "softmax" else torch.relu(scores) / torch.relu(scores).sum()
            torch.testing.assert_close(weights, expected)


def test_relu_weights_that_are_all_zero_keep_the_clients_own_model():
    assert torch.equal(relu_normalised(torch.tensor([-1.0, -2.0, 0.0, -0.5]), 2), torch.tensor([0.0, 0.0, 1.0, 0.0]))
    assert torch.equal(relu_normalised(torch.tensor([-1.0, 3.0, 1.0, 0.0]), 2), torch.tensor([0.0, 0.75, 0.25, 0.0]))


def uniform_output(server: dict) -> dict:
    """Every output layer 0 weights, equal biases: ReLU-normalised or softmax weights 1/N."""
    hn = {n: (torch.zeros_like(v) if n.startswith("out.") and n.endswith(".weight") else v)
          for n, v in server["hn"].items()}
    hn = {n: (torch.full_like(v, 0.7) if n.startswith("out.") and n.endswith(".bias") else v) for n, v in hn.items()}
    return {**server, "hn": hn}


@pytest.mark.parametrize("normalisation", ["relu", "softmax"])
def test_a_uniform_hypernetwork_output_mixes_every_layer_as_fedavg_with_equal_weights(normalisation):
    algo = tiny_algorithm(normalisation=normalisation, hn_lr=0.0)
    server = uniform_output(server_with_models(algo))
    models = server["models"]
    fedavg = fedavg_aggregate({j: {"params": {n: v[j] for n, v in models.items()}, "weight": 7}
                               for j in range(NUM_CLIENTS)})
    for cid in range(NUM_CLIENTS):
        torch.testing.assert_close(algo.broadcast(1, server, [cid])[cid]["params"], fedavg)
    # a full round with the hypernetworks fixed: next round's model is FedAvg of the trained models
    sent = algo.broadcast(1, server, list(range(NUM_CLIENTS)))
    deltas = {cid: random_delta(algo, 10 + cid) for cid in range(NUM_CLIENTS)}
    after = algo.aggregate(1, server, {cid: {"delta": d} for cid, d in deltas.items()})
    trained = {cid: {n: sent[cid]["params"][n] + deltas[cid][n] for n in deltas[cid]} for cid in deltas}
    fedavg = fedavg_aggregate({cid: {"params": p, "weight": 1} for cid, p in trained.items()})
    torch.testing.assert_close(algo.client_model(2, after, None), fedavg)


def by_hand_gradient(hn: dict, cid: int, models: dict, delta: dict, sign: float) -> dict:
    """hidden_layers = 1: f = ReLU(A v + a); per layer z = W f + b, r = ReLU(z), alpha = r / S,
    theta_bar = sum_j alpha_j theta_j. Loss <theta_bar, sign Delta>: dL/dalpha_j = g_j =
    sign <theta_j, Delta> over the layer's tensors; dL/dr = (g - <alpha, g>) / S; dz = dL/dr [z > 0];
    dW = dz f^T, db = dz, df = sum_l W^T dz; dpre = df [A v + a > 0]; dA = dpre v^T, da = dpre, dv = A^T dpre."""
    d = {n: v[cid].double() for n, v in hn.items()}
    v, pre = d["embeddings"], d["mlp.0.weight"] @ d["embeddings"] + d["mlp.0.bias"]
    f = torch.relu(pre)
    grads, df = {}, torch.zeros_like(f)
    for layer in ("body.fc1", "head.fc"):
        z = d[f"out.{layer}.weight"] @ f + d[f"out.{layer}.bias"]
        r = torch.relu(z)
        alpha, total = r / r.sum(), r.sum()
        g = sum(sign * (models[name].double().reshape(NUM_CLIENTS, -1) @ delta[name].double().reshape(-1))
                for name in (f"{layer}.weight", f"{layer}.bias"))
        dz = (g - alpha @ g) / total * (z > 0)
        grads[f"out.{layer}.weight"], grads[f"out.{layer}.bias"] = torch.outer(dz, f), dz
        df += d[f"out.{layer}.weight"].T @ dz
    dpre = df * (pre > 0)
    grads["mlp.0.weight"], grads["mlp.0.bias"] = torch.outer(dpre, v), dpre
    grads["embeddings"] = d["mlp.0.weight"].T @ dpre
    return grads


@pytest.mark.parametrize("direction,sign", [("towards_trained", -1.0), ("fl_bench", 1.0)])
def test_server_update_is_the_vjp_through_the_mixture_by_hand(direction, sign):
    algo = tiny_algorithm(hidden_layers=1, hn_lr=0.3, update_direction=direction)
    server = server_with_models(algo)
    hn, models = server["hn"], server["models"]
    sent = algo.broadcast(1, server, [1])[1]["params"]
    delta = random_delta(algo, 2)
    after = algo.aggregate(1, server, {1: {"delta": delta}})
    grads = by_hand_gradient(hn, 1, models, delta, sign)
    for name, value in hn.items():
        torch.testing.assert_close(after["hn"][name][1].double(), value[1].double() - 0.3 * grads[name],
                                   rtol=1e-5, atol=1e-6)
        others = [j for j in range(NUM_CLIENTS) if j != 1]
        assert torch.equal(after["hn"][name][others], value[others])  # other hypernetworks untouched
    for name, value in models.items():  # eq. 4: the stored model is the trained one
        torch.testing.assert_close(after["models"][name][1], sent[name] + delta[name])
        assert torch.equal(after["models"][name][[0, 2, 3]], value[[0, 2, 3]])


@pytest.mark.parametrize("direction", ["towards_trained", "fl_bench"])
def test_the_step_moves_the_mixture_towards_the_trained_model_or_away_with_fl_benchs_sign(direction):
    algo = tiny_algorithm(hn_lr=0.01, update_direction=direction)
    server = server_with_models(algo)
    sent = algo.broadcast(1, server, [0])[0]["params"]
    trained = {n: v + 0.5 * torch.randn(v.shape, generator=torch.Generator().manual_seed(4)) for n, v in sent.items()}
    after = algo.aggregate(1, server, {0: {"delta": {n: trained[n] - sent[n] for n in sent}}})
    # the stored model of client 0 changed too: compare the same mixture of the round's stored models
    moved = algo.client_model(0, {**after, "models": server["models"]}, None)

    def distance(model):
        return sum(float(((model[n] - trained[n]) ** 2).sum()) for n in trained)
    assert (distance(moved) < distance(sent)) == (direction == "towards_trained")


def test_client_trains_the_mixture_and_uploads_trained_minus_received():
    algo = tiny_algorithm()
    server = server_with_models(algo)
    message = algo.broadcast(1, server, [3])[3]
    x = torch.randn(5, 3, generator=torch.Generator().manual_seed(7))
    data = ClientData(3, x, torch.tensor([0, 1, 2, 0, 1]), x, torch.tensor([0, 1, 2, 0, 1]), np.array([2, 2, 1]))
    update = algo.client_update(1, 3, None, message, data)
    request = next(update)
    assert request.trainable == "all" and request.steps is None and same(request.params, message["params"])
    trained = {n: v * 0.5 for n, v in request.params.items()}
    with pytest.raises(StopIteration) as stop:
        update.send(trained)
    state, reply = stop.value.value
    assert state is None and set(reply) == {"delta"}
    assert same(reply["delta"], {n: trained[n] - message["params"][n] for n in trained})


def test_pfedla_learns_on_digits_with_the_model_both_ways(small_config):
    config = {**small_config, "algorithm": "pfedla", "rounds": 6}
    result, metrics, state = learned_run(config)
    model = 4 * num_parameters(state.server["models"]) // small_config["num_clients"]
    assert (metrics["bytes_down"] == model).all() and (metrics["bytes_up"] == model).all()
    weights = state.diagnostics["aggregation_weights"][6]  # [client, layer, client], rows sum to one
    assert weights.shape == (4, len(layer_groups(list(state.server["models"]), "layer")), 4)
    np.testing.assert_allclose(weights.sum(axis=2), 1.0, rtol=1e-5)
