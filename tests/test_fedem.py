"""FedEM: the E-step by hand, pi a distribution, the responsibility-weighted loss, the
mixture's log-probabilities, the per-component n_i-weighted server mean, K = 1 as FedAvg's request
and FedAvg's numbers, a newcomer's EM fit of pi with the components fixed."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import pfedkit
from pfedkit.algorithms.fedem import (NEW_CLIENT_EM_STEPS, FedEM, mixture_log_probs, mixture_weights, responsibilities,
                                      responsibility_weighted_loss)
from pfedkit.core.contract import ClientData, Forward, Setup, cross_entropy
from pfedkit.core.model_ops import ModelOps

from conftest import TinyNet, tiny_params


def tiny_algo(k: int = 2, num_clients: int = 2) -> FedEM:
    setup = Setup(num_clients, 3, np.full((num_clients, 3), 2), 0, 1, ModelOps(TinyNet))
    return FedEM(FedEM.Hyper(num_components=k), setup)


def client_data(labels: list[int], cid: int = 0) -> ClientData:
    n = len(labels)
    x = torch.linspace(-1, 1, 3 * n).reshape(n, 3)
    y = torch.tensor(labels)
    return ClientData(cid, x, y, x[:1], y[:1], np.bincount(labels, minlength=3))


def constant_classifier(favoured: int, strength: float = 5.0) -> dict:
    """TinyNet parameters whose logits are `strength` on class `favoured` and 0 elsewhere."""
    params = {name: torch.zeros_like(value) for name, value in tiny_params().items()}
    params["head.bias"][favoured] = strength
    return params


def scalar(value: float) -> dict:
    return {"w": torch.tensor([value], dtype=torch.float64)}


# --- E-step and pi --------------------------------------------------------------------------------

def test_responsibilities_by_hand():
    losses = torch.tensor([[0.5, 2.0, 1.0],
                           [1.5, 0.1, 1.0]], dtype=torch.float64)
    pi = torch.tensor([0.25, 0.75], dtype=torch.float64)
    q = responsibilities(losses, pi)
    for s in range(3):
        a, b = 0.25 * math.exp(-losses[0, s]), 0.75 * math.exp(-losses[1, s])
        assert q[0, s].item() == pytest.approx(a / (a + b), rel=1e-12)
        assert q[1, s].item() == pytest.approx(b / (a + b), rel=1e-12)
    # equal losses: q is the prior pi
    assert torch.allclose(q[:, 2], pi)


def test_responsibilities_do_not_underflow_for_large_losses():
    q = responsibilities(torch.tensor([[1000.0], [1001.0]], dtype=torch.float64), torch.tensor([0.5, 0.5]))
    assert torch.allclose(q[:, 0], torch.tensor([1 / (1 + math.exp(-1)), math.exp(-1) / (1 + math.exp(-1))],
                                                dtype=torch.float64))


def test_pi_stays_a_distribution():
    generator = torch.Generator().manual_seed(0)
    pi = torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64)
    for _ in range(5):
        q = responsibilities(torch.rand(3, 17, generator=generator, dtype=torch.float64) * 4, pi)
        pi = mixture_weights(q)
        assert (pi >= 0).all() and pi.sum().item() == pytest.approx(1.0, abs=1e-12)


def test_client_update_e_step_m_step_and_uploads():
    """Component 0 favours class 0, component 1 class 1: labels 0 go to component 0, labels 1 to
    component 1; the client keeps pi = the mean responsibility and uploads both trained models."""
    algo = tiny_algo(k=2)
    components = [constant_classifier(0), constant_classifier(1)]
    labels = [0, 0, 1, 0]
    data = client_data(labels)
    pi = torch.tensor([0.5, 0.5], dtype=torch.float64)
    update = algo.client_update(1, 0, {"pi": pi}, {"components": components}, data)
    first = next(update)
    assert first.params is components[0] and first.loss is responsibility_weighted_loss
    # by hand: CE under component k of label y is logsumexp(logits) - logit_y
    lse = math.log(math.exp(5) + 2)
    loss_true, loss_other = lse - 5, lse
    expected_q0 = [1 / (1 + math.exp(loss_true - loss_other)) if y == 0 else 1 / (1 + math.exp(loss_other - loss_true))
                   for y in labels]
    assert torch.allclose(first.context["responsibility"], torch.tensor(expected_q0, dtype=torch.float32))
    second = update.send(tiny_params(1))
    assert second.params is components[1] and second.optimizer != first.optimizer
    assert torch.allclose(second.context["responsibility"], 1 - torch.tensor(expected_q0, dtype=torch.float32))
    with pytest.raises(StopIteration) as stop:
        update.send(tiny_params(2))
    state, reply = stop.value.value
    assert state["pi"][0].item() == pytest.approx(np.mean(expected_q0), rel=1e-12)
    assert state["pi"].sum().item() == pytest.approx(1.0, abs=1e-12)
    assert reply["weight"] == 4 and len(reply["components"]) == 2
    assert torch.equal(reply["components"][1]["head.bias"], tiny_params(2)["head.bias"])


# --- the M-step loss --------------------------------------------------------------------------

def test_responsibility_weighted_loss_by_hand():
    logits = torch.tensor([[2.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 3.0]])
    y = torch.tensor([0, 2, 2])
    index = torch.tensor([4, 0, 2])
    q = torch.tensor([0.1, 0.9, 0.3, 0.7, 0.5])
    out = Forward(logits, logits, index)
    loss = responsibility_weighted_loss(out, y, {}, {"responsibility": q})
    per_sample = F.cross_entropy(logits, y, reduction="none")
    by_hand = (0.5 * per_sample[0] + 0.1 * per_sample[1] + 0.3 * per_sample[2]) / 3  # q read at index
    assert loss.item() == pytest.approx(by_hand.item(), rel=1e-6)


def test_unit_responsibilities_give_fedavgs_cross_entropy():
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(8, 3, generator=generator, requires_grad=True)
    y = torch.randint(0, 3, (8,), generator=generator)
    out = Forward(logits, logits, torch.arange(8))
    ours = responsibility_weighted_loss(out, y, {}, {"responsibility": torch.ones(8)})
    plain = cross_entropy(out, y, {}, {})
    assert torch.allclose(ours, plain, rtol=1e-6, atol=0)
    (g_ours,) = torch.autograd.grad(ours, logits)
    (g_plain,) = torch.autograd.grad(plain, logits)
    assert torch.allclose(g_ours, g_plain, rtol=1e-6, atol=1e-9)


# --- prediction -------------------------------------------------------------------------------

def test_mixture_log_probs_by_hand():
    z0 = torch.tensor([[1.0, 0.0, 0.0]])
    z1 = torch.tensor([[0.0, 0.0, 2.0]])
    pi = torch.tensor([0.3, 0.7], dtype=torch.float64)
    mixed = mixture_log_probs([z0, z1], pi).exp()
    by_hand = 0.3 * torch.softmax(z0, 1) + 0.7 * torch.softmax(z1, 1)
    assert torch.allclose(mixed, by_hand, atol=1e-6)
    assert mixed.sum().item() == pytest.approx(1.0, abs=1e-6)
    # K = 1: the component's own log-probabilities
    assert torch.allclose(mixture_log_probs([z0], torch.tensor([1.0])), F.log_softmax(z0, 1))


def test_mixture_is_not_the_mixture_of_logits():
    """FL-bench mixes logits; the paper mixes probabilities: they differ (the test has power)."""
    z0, z1 = torch.tensor([[4.0, 0.0]]), torch.tensor([[0.0, 1.0]])
    pi = torch.tensor([0.5, 0.5])
    of_logits = torch.softmax(0.5 * z0 + 0.5 * z1, 1)
    assert not torch.allclose(mixture_log_probs([z0, z1], pi).exp(), of_logits, atol=1e-3)


# --- the server -------------------------------------------------------------------------------

def test_server_averages_each_component_by_sample_count():
    algo = tiny_algo(k=2)
    server = {"components": [scalar(0), scalar(0)]}
    replies = {0: {"components": [scalar(1), scalar(10)], "weight": 1},
               3: {"components": [scalar(4), scalar(40)], "weight": 3}}
    new = algo.aggregate(1, server, replies)["components"]
    assert new[0]["w"].item() == pytest.approx((1 * 1 + 3 * 4) / 4)   # not uniform: 2.5
    assert new[1]["w"].item() == pytest.approx((1 * 10 + 3 * 40) / 4)


def test_k1_client_asks_fedavgs_request():
    """K = 1: q = 1 everywhere, pi = [1], one Fit from the server model on FedAvg's optimizer slot."""
    algo = tiny_algo(k=1)
    server = algo.init_server(tiny_params(3))
    assert torch.equal(server["components"][0]["head.weight"], tiny_params(3)["head.weight"])
    update = algo.client_update(1, 0, algo.init_client(0, tiny_params(3)), algo.broadcast(1, server, [0])[0],
                                client_data([0, 1, 2, 1]))
    fit = next(update)
    assert fit.optimizer == "default" and torch.equal(fit.context["responsibility"], torch.ones(4))
    with pytest.raises(StopIteration) as stop:
        update.send(tiny_params(4))
    state, reply = stop.value.value
    assert torch.equal(state["pi"], torch.ones(1, dtype=torch.float64))


# --- new clients and K = 1 ------------------------------------------------------------------

def test_newcomer_fits_pi_by_em_with_the_components_fixed():
    """pi from uniform by NEW_CLIENT_EM_STEPS EM steps on the newcomer's training data (by hand in
    numpy); the components are not changed and the fresh state is not written."""
    algo = tiny_algo(k=2)
    server = {"components": [constant_classifier(0, 2.0), constant_classifier(1, 2.0)]}
    fresh = algo.init_client(0, tiny_params())
    labels = [0, 0, 0, 1, 2]
    joined = algo.joining_state(0, server, fresh, client_data(labels))
    lse = math.log(math.exp(2) + 2)
    losses = np.array([[lse - 2 if y == k else lse for y in labels] for k in (0, 1)])
    pi = np.array([0.5, 0.5])
    for _ in range(NEW_CLIENT_EM_STEPS):
        joint = pi[:, None] * np.exp(-losses)
        pi = (joint / joint.sum(axis=0)).mean(axis=1)
    assert np.allclose(joined["pi"].numpy(), pi, rtol=1e-10, atol=1e-12)
    assert joined["pi"][0] > 0.7  # most of the newcomer's labels are component 0's class
    assert torch.equal(fresh["pi"], torch.full((2,), 0.5, dtype=torch.float64))


def test_k1_runs_fedavgs_numbers(tmp_path):
    """K = 1: q = 1, pi = [1], the mixture is the component's log-softmax: FedAvg's training bit for
    bit: its accuracies exactly and its losses to rounding (log_softmax applied twice)."""
    config = {"dataset": "digits", "num_clients": 4, "rounds": 2, "threads": 1, "batch_size": 20, "lr": 0.05,
              "seed": 2, "join_ratio": 1.0, "partition": {"scheme": "dirichlet", "alpha": 0.5}}
    fedavg = pfedkit.run({**config, "algorithm": "fedavg", "out_dir": str(tmp_path / "a")}).metrics
    fedem = pfedkit.run({**config, "algorithm": "fedem", "fedem": {"num_components": 1},
                         "out_dir": str(tmp_path / "b")}).metrics
    assert fedavg["accuracy"].equals(fedem["accuracy"])
    assert np.allclose(fedavg["loss"], fedem["loss"], rtol=1e-6, atol=0, equal_nan=True)
