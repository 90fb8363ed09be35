"""FedRoD: the generic head learns on the balanced softmax, the personal head on the detached
generic logits, the two losses do not leak gradients into each other's parameters, prediction adds
both heads' logits, and the personal head never travels."""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from conftest import learned_run, num_parameters
from torch import nn

from pfedkit.algorithms.fedrod import ABSENT_LOG_COUNT, FedRoD, fedrod_loss, log_class_counts
from pfedkit.core.contract import ClientData, Forward, Setup
from pfedkit.core.model_ops import ModelOps
from pfedkit.models.base import BodyHeadModel

COUNTS = np.array([5, 0, 2, 9])  # class 1 absent


def tiny_model() -> BodyHeadModel:
    return BodyHeadModel([("fc1", nn.Linear(3, 5)), ("relu", nn.ReLU()), ("fc", nn.Linear(5, 4))], "fc")


def tiny_algorithm(gamma: float = 1.0) -> FedRoD:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        ops = ModelOps(tiny_model)
    return FedRoD(FedRoD.Hyper(gamma=gamma), Setup(2, 4, np.stack([COUNTS, COUNTS]), seed=0, local_epochs=1, ops=ops))


def test_log_counts_are_finite_with_a_large_negative_value_for_absent_classes():
    logs = log_class_counts(COUNTS)
    torch.testing.assert_close(logs, torch.tensor([np.log(5), ABSENT_LOG_COUNT, np.log(2), np.log(9)], dtype=torch.float32))
    assert torch.isfinite(logs).all()


def test_gradients_are_the_balanced_softmax_for_body_and_generic_head_and_plain_ce_for_the_personal_head():
    """With h, W_G, b_G, W_P, b_P all leaves: dL/dz_G = (softmax(z_G + g log n) - onehot)/B reaches
    W_G, b_G and h only; dL/dz_P = (softmax(z_G + z_P) - onehot)/B reaches W_P, b_P only."""
    gamma = 0.7
    generator = torch.Generator().manual_seed(1)
    features = torch.randn(6, 5, generator=generator, requires_grad=True)
    w_g = torch.randn(4, 5, generator=generator, requires_grad=True)
    b_g = torch.randn(4, generator=generator, requires_grad=True)
    params = {"personal.weight": torch.randn(4, 5, generator=generator, requires_grad=True),
              "personal.bias": torch.randn(4, generator=generator, requires_grad=True)}
    y = torch.tensor([0, 2, 3, 3, 0, 2])
    logits = features @ w_g.T + b_g
    loss = fedrod_loss(Forward(features, logits), y, params, {"log_counts": log_class_counts(COUNTS)}, gamma=gamma)
    loss.backward()

    h, z_g = features.detach(), logits.detach()
    onehot = F.one_hot(y, 4).double()
    log_n = torch.tensor(np.where(COUNTS > 0, np.log(np.maximum(COUNTS, 1)), ABSENT_LOG_COUNT))
    d_generic = (torch.softmax(z_g.double() + gamma * log_n, dim=1) - onehot) / len(y)
    z_p = h @ params["personal.weight"].detach().T + params["personal.bias"].detach()
    d_personal = (torch.softmax((z_g + z_p).double(), dim=1) - onehot) / len(y)

    check = dict(atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(w_g.grad.double(), d_generic.T @ h.double(), **check)
    torch.testing.assert_close(b_g.grad.double(), d_generic.sum(0), **check)
    torch.testing.assert_close(features.grad.double(), d_generic @ w_g.detach().double(), **check)  # no L_P term
    torch.testing.assert_close(params["personal.weight"].grad.double(), d_personal.T @ h.double(), **check)
    torch.testing.assert_close(params["personal.bias"].grad.double(), d_personal.sum(0), **check)
    assert d_generic[:, 1].abs().max() < 1e-12  # the absent class gets no probability mass


def test_gamma_zero_makes_the_generic_loss_plain_cross_entropy():
    features = torch.randn(5, 5)
    logits = torch.randn(5, 4)
    y = torch.tensor([0, 2, 3, 0, 2])
    personal = {"personal.weight": torch.zeros(4, 5), "personal.bias": torch.zeros(4)}
    loss = fedrod_loss(Forward(features, logits), y, personal, {"log_counts": log_class_counts(COUNTS)}, gamma=0.0)
    torch.testing.assert_close(loss, 2 * F.cross_entropy(logits, y))  # zero personal head: L_P = CE(z_G)


def test_client_update_trains_the_personal_head_as_extra_and_uploads_only_body_and_generic_head():
    algo = tiny_algorithm()
    initial = algo.setup.ops.initial_params()
    client = algo.init_client(0, initial)
    assert set(client["personal"]) == {"personal.weight", "personal.bias"}
    torch.testing.assert_close(client["personal"]["personal.weight"], initial["head.fc.weight"])
    data = ClientData(0, torch.randn(16, 3), torch.tensor([0, 2, 3, 0] * 4), torch.zeros(2, 3),
                      torch.zeros(2, dtype=torch.long), COUNTS)
    update = algo.client_update(1, 0, client, {"params": initial}, data)
    request = next(update)
    assert request.trainable == "all" and request.params is initial
    assert set(request.extra) == set(client["personal"])
    torch.testing.assert_close(request.context["log_counts"], log_class_counts(COUNTS))
    trained = {name: value + 1.0 for name, value in {**initial, **request.extra}.items()}
    try:
        update.send(trained)
    except StopIteration as stop:
        state, reply = stop.value
    assert set(reply["params"]) == set(initial) and reply["weight"] == 16  # no personal.* uploaded
    assert all(torch.equal(state["personal"][n], trained[n]) for n in state["personal"])


def test_evaluated_model_predicts_the_sum_of_generic_and_personal_logits():
    """z_G + z_P as one head (W_G + W_P, b_G + b_P), after download and after local training."""
    algo = tiny_algorithm()
    initial = algo.setup.ops.initial_params()
    server = algo.init_server(initial)
    personal = {"personal.weight": torch.randn(4, 5), "personal.bias": torch.randn(4)}
    features = torch.randn(7, 5)
    expected = (features @ initial["head.fc.weight"].T + initial["head.fc.bias"]
                + features @ personal["personal.weight"].T + personal["personal.bias"])
    evaluated = algo.client_model(0, server, {"personal": personal})
    torch.testing.assert_close(algo.setup.ops.head_logits(evaluated, features), expected)
    assert all(torch.equal(evaluated[n], initial[n]) for n in initial if n.startswith("body."))
    assert not algo.has_custom_predict()
    trained = {**{n: v + 1 for n, v in initial.items()}, **personal}
    after = algo.trained_model(0, {"personal": personal}, trained)
    assert set(after) == set(initial)
    torch.testing.assert_close(after["head.fc.bias"], initial["head.fc.bias"] + 1 + personal["personal.bias"])


def test_fedrod_learns_on_digits_uploads_no_personal_head(small_config, tmp_path):
    config = {**small_config, "algorithm": "fedrod", "join_ratio": 0.75}
    sequential, metrics, state = learned_run(config)  # processes == sequential: tests/test_backends.py
    model_bytes = 4 * num_parameters(state.server["params"])
    joined = metrics[(metrics["round"] >= 1) & (metrics["participated"] == 1)]
    assert (joined["bytes_up"] == model_bytes + 8).all() and (joined["bytes_down"] == model_bytes).all()
    assert all(set(client) == {"personal"} for client in state.clients)
    assert not any(name.startswith("personal") for name in state.server["params"])
    # every personal head starts as the same copy of the initial head: distinct ones were trained
    distinct = {tuple(client["personal"]["personal.weight"].flatten()[:20].tolist()) for client in state.clients}
    assert len(distinct) >= 3
