"""FedDBE: the DBE loss (CE on head(h + z̄_i) + kappa * MR on the running mean) and its gradients
against a hand computation, the initialisation round as plain FedAvg (bit for bit) that fixes the
n_i-weighted global mean once, the bias memory folded into the head's bias, and the bytes."""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from conftest import final_state, learned_run, num_parameters

import pfedkit
from pfedkit.algorithms.feddbe import MEMORY, RUNNING, FedDBE, dbe_loss, with_bias_memory
from pfedkit.core.contract import Forward, Setup

D, C = 5, 3


def leaves(seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    return {"h": torch.randn(6, D, generator=generator), "W": torch.randn(C, D, generator=generator),
            "b": torch.randn(C, generator=generator), "z": torch.randn(D, generator=generator),
            "r": torch.randn(D, generator=generator), "g": torch.randn(D, generator=generator)}


def test_dbe_loss_and_its_gradients_match_a_hand_computation():
    """L = CE(W(h + z) + b, y) + kappa * mean_k 0.5 ((1 - m) r + m mean_b h - g)_k^2; r is
    replaced in place by the new running mean and gets no gradient."""
    kappa, m, y = 3.0, 0.3, torch.tensor([0, 2, 1, 1, 0, 2])
    v = leaves(0)
    h, z = v["h"].clone().requires_grad_(True), v["z"].clone().requires_grad_(True)
    W, b = v["W"].clone().requires_grad_(True), v["b"].clone().requires_grad_(True)
    params = {"head.fc.weight": W, "head.fc.bias": b, MEMORY: z, RUNNING: v["r"].clone().requires_grad_(True)}
    loss = dbe_loss(Forward(h, h @ W.T + b), y, params, {"global_mean": v["g"]}, kappa=kappa, momentum=m)
    loss.backward()

    running = (1 - m) * v["r"] + m * v["h"].mean(0)
    logits = (v["h"] + v["z"]) @ v["W"].T + v["b"]
    expected = F.cross_entropy(logits, y) + kappa * (0.5 * (running - v["g"]) ** 2).mean()
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(params[RUNNING].detach(), running)
    assert params[RUNNING].grad is None
    d_logits = (torch.softmax(logits, 1) - F.one_hot(y, C)) / len(y)
    d_mean = kappa * (running - v["g"]) / D * m / len(y)  # d MR / d h_b, the same for every sample
    torch.testing.assert_close(z.grad, (d_logits @ v["W"]).sum(0))
    torch.testing.assert_close(h.grad, d_logits @ v["W"] + d_mean)
    torch.testing.assert_close(W.grad, d_logits.T @ (v["h"] + v["z"]))


def test_without_a_global_mean_the_loss_is_plain_cross_entropy_and_the_memory_gets_no_gradient():
    v, y = leaves(1), torch.tensor([0, 1, 2, 0, 1, 2])
    logits = v["h"] @ v["W"].T + v["b"]
    params = {"head.fc.weight": v["W"], "head.fc.bias": v["b"], MEMORY: v["z"].clone().requires_grad_(True),
              RUNNING: torch.zeros(D)}
    loss = dbe_loss(Forward(v["h"], logits), y, params, {}, kappa=50.0, momentum=1.0)
    torch.testing.assert_close(loss, F.cross_entropy(logits, y))
    assert not loss.requires_grad or torch.autograd.grad(loss, params[MEMORY], allow_unused=True)[0] is None
    torch.testing.assert_close(params[RUNNING], v["h"].mean(0))  # m = 1: the batch mean


def algorithm() -> FedDBE:
    algo = FedDBE(FedDBE.Hyper(), Setup(3, C, np.ones((3, C)), seed=0, local_epochs=1, ops=None))
    algo.feature_dim = D
    return algo


def reply(seed: int, weight: int, running: bool = True) -> dict:
    v = leaves(seed)
    message = {"params": {"head.fc.weight": v["W"], "head.fc.bias": v["b"]}, "weight": weight}
    return {**message, "running_mean": v["r"]} if running else message


def test_the_global_mean_is_the_n_i_weighted_mean_of_the_first_rounds_running_means_and_then_fixed():
    algo = algorithm()
    server = algo.init_server(reply(0, 1)["params"])
    first = {0: reply(1, 1), 2: reply(2, 3)}
    server = algo.aggregate(1, server, first)
    torch.testing.assert_close(server["global_mean"], (leaves(1)["r"] + 3 * leaves(2)["r"]) / 4)
    torch.testing.assert_close(server["params"]["head.fc.bias"], (leaves(1)["b"] + 3 * leaves(2)["b"]) / 4)
    fixed = server["global_mean"]
    server = algo.aggregate(2, server, {1: reply(3, 2, running=False)})
    assert server["global_mean"] is fixed
    assert "global_mean" in algo.broadcast(3, server, [0])[0]


def test_the_bias_memory_is_folded_into_the_head_bias_and_zero_memory_is_the_model_itself():
    v = leaves(2)
    params = {"body.fc1.weight": torch.randn(D, 4), "head.fc.weight": v["W"], "head.fc.bias": v["b"]}
    folded = with_bias_memory(params, v["z"])
    torch.testing.assert_close(v["h"] @ folded["head.fc.weight"].T + folded["head.fc.bias"],
                               (v["h"] + v["z"]) @ v["W"].T + v["b"])
    assert folded["body.fc1.weight"] is params["body.fc1.weight"]
    unchanged = with_bias_memory(params, torch.zeros(D))
    assert all(torch.equal(unchanged[n], params[n]) for n in params)


def test_the_initialisation_round_is_fedavg_bit_for_bit(small_config):
    config = {**small_config, "rounds": 1}
    fedavg = final_state(pfedkit.run({**config, "algorithm": "fedavg"})).server["params"]
    dbe = final_state(pfedkit.run({**config, "algorithm": "feddbe"})).server
    assert all(torch.equal(dbe["params"][name], fedavg[name]) for name in fedavg)
    assert dbe["global_mean"] is not None


def test_feddbe_learns_on_digits_and_the_memory_never_travels(small_config):
    _, metrics, state = learned_run({**small_config, "algorithm": "feddbe", "join_ratio": 0.75})
    model_bytes, mean_bytes = 4 * num_parameters(state.server["params"]), 4 * state.server["global_mean"].numel()
    joined = metrics[metrics["participated"] == 1]
    first, later = joined[joined["round"] == 1], joined[joined["round"] > 1]
    assert (first["bytes_up"] == model_bytes + 8 + mean_bytes).all() and (first["bytes_down"] == model_bytes).all()
    assert (later["bytes_up"] == model_bytes + 8).all() and (later["bytes_down"] == model_bytes + mean_bytes).all()
    assert all(set(client) == {"memory"} for client in state.clients)
    assert any(client["memory"].abs().sum() > 0 for client in state.clients)
