"""pFedHN: a client's generated model depends on its own embedding only, the server's update is the
vector-Jacobian product of the client's Delta theta, clipped, then SGD with momentum and weight
decay (by hand on a tiny hypernetwork), it moves the generated model towards the trained one, the
client uploads theta - theta~ after k steps, pFedHN-PC keeps and trains the client's own head, and
short digits runs (bytes)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import learned_run, num_parameters
from torch import nn

from pfedkit.algorithms.pfedhn import PFedHN, generate_model
from pfedkit.core.contract import ClientData, Setup
from pfedkit.core.model_ops import ModelOps
from pfedkit.core.params import select
from pfedkit.models.base import BodyHeadModel

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def tiny_model() -> BodyHeadModel:
    return BodyHeadModel([("fc1", nn.Linear(3, 4)), ("relu", nn.ReLU()), ("fc", nn.Linear(4, 3))], "fc")


def tiny_algorithm(**hyper) -> PFedHN:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        ops = ModelOps(tiny_model)
    hyper = {"embed_dim": 2, "hidden_dim": 5, **hyper}
    return PFedHN(PFedHN.Hyper(**hyper), Setup(4, 3, np.ones((4, 3)), seed=5, local_epochs=1, ops=ops))


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def test_a_generated_model_depends_on_the_clients_own_embedding_only():
    algo = tiny_algorithm()
    server = algo.init_server(algo.setup.ops.initial_params())
    hn = server["hn"]
    before = algo.client_model(1, server, None)
    assert {n: v.shape for n, v in before.items()} == {n: v.shape for n, v in algo.setup.ops.initial_params().items()}
    changed = {**hn, "embeddings": hn["embeddings"].clone()}
    changed["embeddings"][2] += 3.0  # another client's embedding: client 1's model is untouched
    assert same(algo.client_model(1, {"hn": changed}, None), before)
    assert not same(algo.client_model(2, {"hn": changed}, None), algo.client_model(2, server, None))
    copied = {**hn, "embeddings": hn["embeddings"].clone()}
    copied["embeddings"][3] = hn["embeddings"][1]  # the same embedding: the same model
    assert same(algo.client_model(3, {"hn": copied}, None), before)
    assert not same(algo.client_model(0, server, None), before)


def by_hand_gradient(hn: dict, cid: int, delta: dict) -> dict:
    """hidden_layers = 0: f = A v + a, theta_t = W_t f + b_t. For the loss <theta, delta>:
    dW_t = delta_t f^T, db_t = delta_t, df = sum_t W_t^T delta_t, dA = df v^T, da = df, dv_cid = A^T df."""
    v, a_w, a_b = hn["embeddings"][cid].double(), hn["mlp.0.weight"].double(), hn["mlp.0.bias"].double()
    f = a_w @ v + a_b
    grads = {name: torch.zeros_like(value, dtype=torch.float64) for name, value in hn.items()}
    df = torch.zeros_like(f)
    for name, d in delta.items():
        d = d.double().reshape(-1)
        grads[f"out.{name}.weight"] = torch.outer(d, f)
        grads[f"out.{name}.bias"] = d
        df += hn[f"out.{name}.weight"].double().T @ d
    grads["mlp.0.weight"], grads["mlp.0.bias"] = torch.outer(df, v), df
    grads["embeddings"][cid] = a_w.T @ df
    return grads


def random_delta(algo: PFedHN, seed: int, scale: float = 1.0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {n: scale * torch.randn(v.shape, generator=g) for n, v in algo.setup.ops.initial_params().items()}


def test_server_update_is_the_clipped_vjp_then_sgd_with_momentum_and_weight_decay_by_hand():
    algo = tiny_algorithm(hidden_layers=0, hn_lr=0.1, hn_momentum=0.5, hn_weight_decay=0.01, max_grad_norm=1e9)
    server = algo.init_server(algo.setup.ops.initial_params())
    hn = server["hn"]
    delta = random_delta(algo, 1)
    first = algo.aggregate(1, server, {2: {"delta": delta}})
    grads = by_hand_gradient(hn, 2, delta)
    step1 = {n: grads[n] + 0.01 * hn[n].double() for n in hn}  # first step: buf = d
    for name in hn:
        torch.testing.assert_close(first["hn"][name].double(), hn[name].double() - 0.1 * step1[name],
                                   rtol=1e-5, atol=1e-6)
    assert torch.equal(first["hn"]["embeddings"][0], hn["embeddings"][0] * (1 - 0.1 * 0.01))  # only decay
    # second step: buf = 0.5 buf + d, at the updated hypernetwork
    delta2 = random_delta(algo, 2)
    second = algo.aggregate(2, first, {0: {"delta": delta2}})
    grads2 = by_hand_gradient(first["hn"], 0, delta2)
    for name in hn:
        buffer = 0.5 * step1[name] + grads2[name] + 0.01 * first["hn"][name].double()
        torch.testing.assert_close(second["hn"][name].double(), first["hn"][name].double() - 0.1 * buffer,
                                   rtol=1e-5, atol=1e-6)


def test_gradient_norm_is_clipped_and_mean_mode_takes_one_step_with_the_mean():
    algo = tiny_algorithm(hidden_layers=0, hn_lr=0.1, hn_momentum=0.0, hn_weight_decay=0.0, max_grad_norm=0.5)
    server = algo.init_server(algo.setup.ops.initial_params())
    hn, delta = server["hn"], random_delta(algo, 3, scale=10.0)
    new = algo.aggregate(1, server, {1: {"delta": delta}})["hn"]
    moved = torch.sqrt(sum(((new[n].double() - hn[n].double()) ** 2).sum() for n in hn))
    assert float(moved) == pytest.approx(0.1 * 0.5, rel=1e-4)  # lr * max_grad_norm
    mean = tiny_algorithm(hidden_layers=0, hn_lr=0.1, hn_momentum=0.0, hn_weight_decay=0.0, max_grad_norm=1e9,
                          server_steps="mean")
    deltas = {0: random_delta(algo, 4), 3: random_delta(algo, 5)}
    new = mean.aggregate(1, server, {cid: {"delta": d} for cid, d in deltas.items()})["hn"]
    grads = [by_hand_gradient(hn, cid, d) for cid, d in deltas.items()]
    for name in hn:
        torch.testing.assert_close(new[name].double(), hn[name].double() - 0.1 * (grads[0][name] + grads[1][name]) / 2,
                                   rtol=1e-5, atol=1e-6)


def test_the_update_moves_the_generated_model_towards_the_trained_one():
    algo = tiny_algorithm(hn_lr=0.01, hn_momentum=0.0, hn_weight_decay=0.0)
    server = algo.init_server(algo.setup.ops.initial_params())
    generated = algo.client_model(1, server, None)
    trained = {n: v + 0.1 * torch.randn(v.shape, generator=torch.Generator().manual_seed(6)) for n, v in generated.items()}
    new = algo.aggregate(1, server, {1: {"delta": {n: generated[n] - trained[n] for n in generated}}})

    def distance(model):
        return sum(float(((model[n] - trained[n]) ** 2).sum()) for n in trained)
    assert distance(algo.client_model(1, new, None)) < distance(generated)


def test_client_trains_k_steps_from_the_generated_model_and_uploads_theta_minus_trained():
    algo = tiny_algorithm(inner_steps=7)
    server = algo.init_server(algo.setup.ops.initial_params())
    message = algo.broadcast(1, server, [2])[2]
    assert same(message["params"], generate_model(server["hn"], 2, algo.targets))
    x = torch.randn(5, 3, generator=torch.Generator().manual_seed(7))
    data = ClientData(2, x, torch.tensor([0, 1, 2, 0, 1]), x, torch.tensor([0, 1, 2, 0, 1]), np.array([2, 2, 1]))
    update = algo.client_update(1, 2, None, message, data)
    request = next(update)
    assert request.steps == 7 and request.trainable == "all" and same(request.params, message["params"])
    trained = {n: v * 0.5 for n, v in request.params.items()}
    with pytest.raises(StopIteration) as stop:
        update.send(trained)
    state, reply = stop.value.value
    assert state is None and set(reply) == {"delta"}
    assert same(reply["delta"], {n: message["params"][n] - trained[n] for n in trained})


def test_pfedhn_pc_generates_the_body_and_the_client_keeps_and_trains_its_own_head():
    algo = tiny_algorithm(personal_head=True, inner_steps=3)
    initial = algo.setup.ops.initial_params()
    server = algo.init_server(initial)
    assert not any(name.startswith("out.head.") for name in server["hn"])  # no head is generated
    client = algo.init_client(1, initial)
    assert same(client["head"], select(initial, "head"))
    message = algo.broadcast(1, server, [1])[1]
    assert set(message["params"]) == {"body.fc1.weight", "body.fc1.bias"}
    x = torch.randn(5, 3, generator=torch.Generator().manual_seed(8))
    data = ClientData(1, x, torch.tensor([0, 1, 2, 0, 1]), x, torch.tensor([0, 1, 2, 0, 1]), np.array([2, 2, 1]))
    update = algo.client_update(1, 1, client, message, data)
    request = next(update)
    assert same(request.params, {**message["params"], **client["head"]}) and request.trainable == "all"
    trained = {n: v * 0.5 for n, v in request.params.items()}
    with pytest.raises(StopIteration) as stop:
        update.send(trained)
    state, reply = stop.value.value
    assert same(state["head"], select(trained, "head"))  # the trained head stays on the client
    assert same(reply["delta"], {n: message["params"][n] - trained[n] for n in message["params"]})
    assert same(algo.client_model(1, server, state), {**message["params"], **state["head"]})


@pytest.mark.parametrize("personal_head", [False, True])
def test_pfedhn_learns_on_digits_with_the_model_both_ways(small_config, personal_head):
    config = {**small_config, "algorithm": "pfedhn", "rounds": 6,
              "pfedhn": {"inner_steps": 20, "personal_head": personal_head}}
    result, metrics, state = learned_run(config)
    generated = 4 * sum(v.numel() for n, v in state.server["hn"].items() if n.startswith("out.") and n.endswith(".bias"))
    assert (metrics["bytes_down"] == generated).all() and (metrics["bytes_up"] == generated).all()
    assert num_parameters(state.server["momentum"]) == num_parameters(state.server["hn"])
    assert all((set(client) == {"head"}) if personal_head else client is None for client in state.clients)
