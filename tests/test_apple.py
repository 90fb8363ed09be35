"""APPLE: two local steps against a hand computation (own core through p_ii, every p_ij by
<g, w_j> plus the proximal pull); with the simplex constraint p_i is a distribution after every
update; with one client it is Local training; the loss scheduler; the server keeps each client's
core in its slot and sends a client the others'; the evaluated model is the DR mix."""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import TinyNet as Tiny
from conftest import tiny_params
from torch import nn
from torch.func import functional_call

import pfedkit
from pfedkit.algorithms.apple import APPLE, DR, apple_step, core_prefix, loss_scheduler, project_to_simplex
from pfedkit.core.contract import Batch, ClientData, Setup
from pfedkit.core.seeds import torch_generator
from pfedkit.engine.trainer import FitJob, LocalTrainer, TrainSettings, batch_schedule

pytestmark = pytest.mark.usefixtures("one_torch_thread")

COUNTS = np.array([[2, 1, 1], [1, 1, 2], [3, 2, 3]])  # n = 4, 4, 8: p_0 = (0.25, 0.25, 0.5)


def algorithm(rounds: int = 10, **options) -> APPLE:
    return APPLE(APPLE.Hyper(**options), Setup(3, 3, COUNTS, seed=0, local_epochs=1, ops=None, rounds=rounds))


def ce_grad(params, x, y):
    point = {k: v.detach().requires_grad_(True) for k, v in params.items()}
    loss = nn.functional.cross_entropy(functional_call(Tiny(), point, (x,)), y)
    return dict(zip(point, torch.autograd.grad(loss, list(point.values()))))


@pytest.mark.parametrize("options", [{"mu": 0.5, "dr_lr": 0.05, "scheduler": "cosine", "decay_fraction": 1.0},
                                     {"mu": 0.5, "dr_lr": 0.05, "core_lr": "lr_times_clients"},
                                     {"mu": 0.5, "dr_lr": 5.0, "dr_gradient": "layer_mean"}])
def test_two_steps_match_a_hand_computation(options):
    lr, rnd, own = 0.3, 3, 1
    algo = algorithm(**options)
    h = algo.hyper
    settings = TrainSettings(local_epochs=1, batch_size=4, lr=lr, seed=2)
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(8, 3, generator=g), torch.randint(0, 3, (8,), generator=g)
    data = ClientData(own, x, y, x[:2], y[:2], np.bincount(y.numpy(), minlength=3))
    cores = [tiny_params(0), tiny_params(1), tiny_params(2)]
    p_start = torch.tensor([0.2, 0.5, 0.3])
    message = algo.broadcast(rnd, {"cores": cores}, [own])[own]
    assert set(message["cores"]) == {0, 2} and message["cores"][0] is cores[0]
    update = algo.client_update(rnd, own, {"core": cores[own], "p": p_start, "personal": cores[own]}, message, data)
    fit = next(update)
    assert fit.params is cores[own] and set(fit.extra) == {DR} | {core_prefix(j) + k for j in (0, 2) for k in cores[0]}
    trained = LocalTrainer(Tiny, settings).fit(FitJob(rnd, own, 0, fit, None), x, y).params
    with pytest.raises(StopIteration) as stop:
        update.send(trained)
    state, reply = stop.value.value

    pull = h.mu * loss_scheduler(rnd, 10, h.decay_fraction, h.scheduler)
    p0 = torch.tensor([0.25, 0.25, 0.5])
    scale = 3.0 if h.core_lr == "lr_times_clients" else 1.0
    w, p = [dict(c) for c in cores], p_start.clone()
    schedule = batch_schedule(fit, settings, len(y), torch_generator(settings.seed, rnd, own, "fit-0"))
    assert len(schedule) == 2
    for batch in schedule:
        personal = {k: sum(p[j] * w[j][k] for j in range(3)) for k in w[own]}
        grad = ce_grad(personal, x[batch], y[batch])
        if h.dr_gradient == "exact":
            grad_ce = torch.stack([sum((grad[k] * w[j][k]).sum() for k in grad) for j in range(3)])
        else:  # PFLlib: each layer's mean of g * w_j, averaged over the layers
            grad_ce = torch.stack([sum((grad[k] * w[j][k]).mean() for k in grad) / len(grad) for j in range(3)])
        grad_p = grad_ce + 2 * pull * (p - p0)
        w[own] = {k: w[own][k] - lr * scale * p[own] * grad[k] for k in grad}
        p = p - h.dr_lr * grad_p
    torch.testing.assert_close(state["p"], p)
    for k in cores[own]:
        torch.testing.assert_close(reply["core"][k], w[own][k])
        torch.testing.assert_close(state["personal"][k], sum(p[j] * w[j][k] for j in range(3)))
    assert reply["weight"] == 8 and algo.client_model(own, {}, state) is state["personal"]


class FunctionalTools:
    """StepTools over TinyNet without a trainer: the step's live tensors, CE's gradient anywhere."""

    def __init__(self, params, lr):
        self.params, self.trainable, self.lr = params, [k for k in params if k.startswith(("body.", "head."))], lr

    def loss_and_grad(self, batch, at=None, wrt=None):
        at, wrt = at or self.params, wrt or self.trainable
        point = {k: (v.detach().requires_grad_(True) if k in wrt else v.detach()) for k, v in at.items()}
        model = {k: v for k, v in point.items() if k.startswith(("body.", "head."))}
        loss = nn.functional.cross_entropy(functional_call(Tiny(), model, (batch.x,)), batch.y)
        return loss.detach(), dict(zip(wrt, torch.autograd.grad(loss, [point[k] for k in wrt])))


def test_with_the_simplex_constraint_p_is_a_distribution_after_every_update():
    cores = [tiny_params(0), tiny_params(1), tiny_params(2)]
    params = {**{k: v.clone() for k, v in cores[0].items()},
              **{core_prefix(j) + k: v for j in (1, 2) for k, v in cores[j].items()},
              DR: torch.tensor([0.6, 0.3, 0.1])}
    tools = FunctionalTools(params, lr=0.1)
    g = torch.Generator().manual_seed(3)
    moved = []
    for _ in range(20):  # a huge DR step: without the projection p leaves the simplex at once
        batch = Batch(torch.randn(4, 3, generator=g), torch.randint(0, 3, (4,), generator=g), torch.arange(4))
        before = params[DR].clone()
        apple_step(tools, [batch], own=0, num_clients=3, core_lr_scale=1.0, dr_lr=50.0, pull=0.0,
                   p0=(0.25, 0.25, 0.5), constraint="simplex", dr_gradient="exact")
        p = params[DR]
        assert (p >= 0).all() and float(p.sum()) == pytest.approx(1.0, abs=1e-6)
        moved.append(not torch.equal(p, before))
    assert any(moved)


def test_simplex_projection_by_hand():
    torch.testing.assert_close(project_to_simplex(torch.tensor([0.5, 0.2, 0.3])), torch.tensor([0.5, 0.2, 0.3]))
    torch.testing.assert_close(project_to_simplex(torch.tensor([2.0, 0.0, -1.0])), torch.tensor([1.0, 0.0, 0.0]))
    torch.testing.assert_close(project_to_simplex(torch.tensor([0.6, 0.6, 0.0])), torch.tensor([0.5, 0.5, 0.0]))


def test_one_client_with_the_simplex_constraint_is_local_training(tmp_path):
    config = {"dataset": "digits", "num_clients": 1, "rounds": 2, "threads": 1, "batch_size": 20, "lr": 0.05,
              "seed": 3, "out_dir": str(tmp_path), "momentum": 0.0}
    apple = pfedkit.run({**config, "algorithm": "apple", "apple": {"constraint": "simplex"}})
    local = pfedkit.run({**config, "algorithm": "local"})
    columns = ["round", "client", "correct", "loss", "train_loss"]
    pd.testing.assert_frame_equal(apple.metrics[columns], local.metrics[columns])


def test_loss_scheduler_shapes():
    assert loss_scheduler(1, 100, 0.1, "cosine") == 1.0 and loss_scheduler(1, 100, 0.1, "exponential") == 1.0
    assert loss_scheduler(6, 100, 0.1, "cosine") == pytest.approx((math.cos(math.pi * 5 / 10) + 1) / 2)
    assert loss_scheduler(6, 100, 0.1, "exponential") == pytest.approx(0.001 ** 0.5)
    assert loss_scheduler(11, 100, 0.1, "cosine") == 0.0 and loss_scheduler(3, 10, 0.1, "exponential") == 0.0


def test_server_keeps_each_core_in_its_slot_and_p_starts_at_the_sample_shares():
    algo = algorithm()
    server = algo.init_server(tiny_params(0))
    new = {0: {"core": tiny_params(5), "weight": 4}, 2: {"core": tiny_params(6), "weight": 8}}
    cores = algo.aggregate(1, server, new)["cores"]
    assert cores[0] is new[0]["core"] and cores[2] is new[2]["core"] and cores[1] is server["cores"][1]
    torch.testing.assert_close(algo.init_client(1, tiny_params(0))["p"], torch.tensor([0.25, 0.25, 0.5]))
    torch.testing.assert_close(algorithm(p_init="uniform").init_client(1, tiny_params(0))["p"], torch.full((3,), 1 / 3))


def test_runs_on_digits_and_learns(small_config):
    result = pfedkit.run({**small_config, "algorithm": "apple", "rounds": 5, "apple": {"core_lr": "lr_times_clients"}})
    assert result.summary["final_acc"] > 0.3
