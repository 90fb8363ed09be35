"""pFedMe: the inner solve and local-copy update against a hand computation, the server's
(1 - beta) mix with an UNWEIGHTED mean, and the personalised theta as the evaluated model."""
from __future__ import annotations

import numpy as np
import torch
from conftest import TinyNet as Tiny
from conftest import final_state, tiny_params
from torch import nn
from torch.func import functional_call

import pfedkit
from pfedkit.algorithms.pfedme import PFedMe
from pfedkit.config import load_config
from pfedkit.core.contract import ClientData, Setup
from pfedkit.core.params import weighted_mean
from pfedkit.core.seeds import torch_generator
from pfedkit.engine.trainer import FitJob, LocalTrainer, TrainSettings, batch_schedule
from pfedkit.runs import prepare


def client_data(cid: int, n: int) -> ClientData:
    g = torch.Generator().manual_seed(10 + cid)
    x, y = torch.randn(n, 3, generator=g), torch.randint(0, 3, (n,), generator=g)
    return ClientData(cid, x, y, x[:2], y[:2], np.bincount(y.numpy(), minlength=3))


def grad_at(params, x, y):
    point = {k: v.detach().requires_grad_(True) for k, v in params.items()}
    loss = nn.functional.cross_entropy(functional_call(Tiny(), point, (x,)), y)
    return dict(zip(point, torch.autograd.grad(loss, list(point.values()))))


def algorithm(**options) -> PFedMe:
    return PFedMe(PFedMe.Hyper(**options), Setup(3, 3, np.ones((3, 3)), seed=0, local_epochs=1, ops=None))


def run_client(algo, cid, client, message, data, settings):
    """Drive one client_update through a LocalTrainer; returns (state, reply, batch schedule)."""
    update = algo.client_update(1, cid, client, message, data)
    fit = next(update)
    trained = LocalTrainer(Tiny, settings).fit(FitJob(1, cid, 0, fit, None), data.x_train, data.y_train).params
    schedule = batch_schedule(fit, settings, data.n_train, torch_generator(settings.seed, 1, cid, "fit-0"))
    try:
        update.send(trained)
    except StopIteration as stop:
        state, reply = stop.value
    return state, reply, schedule


def test_local_steps_match_hand_computation():
    lam, inner_steps, personal_lr, mu, lr = 2.0, 3, 0.05, 0.1, 0.2
    algo = algorithm(lam=lam, inner_steps=inner_steps, personal_lr=personal_lr, mu=mu)
    settings = TrainSettings(local_epochs=1, batch_size=4, lr=lr, seed=3)
    data, received = client_data(0, 8), tiny_params()  # two batches: theta and w_i carry over
    state, reply, schedule = run_client(algo, 0, algo.init_client(0, received), {"params": received}, data, settings)
    assert len(schedule) == 2
    theta, local = dict(received), dict(received)  # both start at the received global model
    for batch in schedule:
        for _ in range(inner_steps):
            grad = grad_at(theta, data.x_train[batch], data.y_train[batch])
            theta = {k: theta[k] - personal_lr * (grad[k] + lam * (theta[k] - local[k]) + mu * theta[k]) for k in theta}
        local = {k: local[k] - lr * lam * (local[k] - theta[k]) for k in local}
    assert set(reply) == {"params"} and set(reply["params"]) == set(received)
    for k in received:
        torch.testing.assert_close(reply["params"][k], local[k])   # uploaded: w_i
        torch.testing.assert_close(state["theta"][k], theta[k])    # kept: theta
    assert algo.client_model(0, {"params": received}, state) is state["theta"]


def test_server_mixes_with_the_unweighted_mean_of_uploads():
    """Clients of different sizes: beta = 1 gives the plain mean (FedAvg's n_i weights would not)."""
    algo = algorithm(lam=5.0, inner_steps=2)
    settings = TrainSettings(local_epochs=1, batch_size=5, lr=0.1, seed=1)
    server = algo.init_server(tiny_params())
    uploads = [run_client(algo, cid, algo.init_client(cid, server["params"]), {"params": server["params"]},
                          client_data(cid, n), settings)[1]["params"] for cid, n in enumerate((5, 20, 40))]
    replies = {cid: {"params": p} for cid, p in enumerate(uploads)}
    mean = weighted_mean(uploads, [1, 1, 1])
    mixed = algo.aggregate(1, server, replies)["params"]
    for k in mean:
        torch.testing.assert_close(mixed[k], mean[k])
    by_size = weighted_mean(uploads, [5, 20, 40])
    assert max((mixed[k] - by_size[k]).abs().max() for k in mean) > 1e-4
    half = algorithm(beta=0.5).aggregate(1, server, replies)["params"]
    for k in mean:
        torch.testing.assert_close(half[k], 0.5 * server["params"][k] + 0.5 * mean[k])


def test_beta_zero_leaves_the_server_model_unchanged(small_config):
    config = {**small_config, "algorithm": "pfedme", "rounds": 1, "threads": 1, "pfedme": {"beta": 0.0}}
    state = final_state(pfedkit.run(config))
    init = prepare(load_config(config)).simulation.algorithm.setup.ops.initial_params()
    assert all(torch.equal(state.server["params"][k], init[k]) for k in init)
    assert any(not torch.equal(state.clients[0]["theta"][k], init[k]) for k in init)  # the round trained


def test_evaluated_model_is_theta_or_the_global_model_before_the_first_participation():
    algo, server = algorithm(), {"params": tiny_params(0)}
    assert algo.client_model(0, server, algo.init_client(0, tiny_params(0))) is server["params"]
    theta = tiny_params(1)
    assert algo.client_model(0, server, {"theta": theta}) is theta


def test_end_to_end_on_digits_beats_chance(small_config):
    result = pfedkit.run({**small_config, "algorithm": "pfedme", "threads": 1})
    assert result.summary["final_acc"] > 0.3


def test_one_inner_step_from_the_local_copy_reduces_to_fedavg(small_config):
    """The limit case: one client, one full batch per round, K = 1, mu = 0, beta = 1. Each round
    theta starts at w_i (= the received w), so theta_hat = w - eta_p grad F(w) and
    w_i <- w_i - lr lam (w_i - theta_hat) = w - (lr lam eta_p) grad F(w): FedAvg with lr * lam * eta_p."""
    base = {**small_config, "num_clients": 1, "rounds": 3, "batch_size": 10_000, "lr": 0.1,
            "partition": {"scheme": "iid"}}
    pfedme = final_state(pfedkit.run({**base, "algorithm": "pfedme",
                                      "pfedme": {"lam": 2.0, "personal_lr": 0.25, "inner_steps": 1, "mu": 0.0}}))
    fedavg = final_state(pfedkit.run({**base, "lr": 0.1 * 2.0 * 0.25}))
    for name, value in fedavg.server["params"].items():
        torch.testing.assert_close(pfedme.server["params"][name], value, rtol=1e-5, atol=1e-6)
