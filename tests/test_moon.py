"""MOON: the contrastive term (log 2 when z_g = z_p, a hand-computed batch, read at the batch's
positions), mu = 0 is FedAvg, the representations sent with the Fit, and a short digits run."""
from __future__ import annotations

import math

import pandas as pd
import pytest
import torch
import torch.nn.functional as F

import pfedkit
from pfedkit.algorithms.moon import contrastive_loss, moon_loss
from pfedkit.config import load_config
from pfedkit.core.contract import Forward, message_bytes
from pfedkit.runs import prepare
from tests.conftest import final_state, num_parameters

COLUMNS = ["round", "client", "accuracy", "loss", "bytes_up", "bytes_down"]
CONFIG = {"dataset": "digits", "num_clients": 4, "rounds": 3, "threads": 1, "batch_size": 20, "lr": 0.05,
          "seed": 3, "join_ratio": 0.75, "partition": {"scheme": "dirichlet", "alpha": 0.5}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Digits runs shared by the end-to-end tests (3 of 4 clients per round): MOON, FedAvg."""
    out = tmp_path_factory.mktemp("runs")
    return {algorithm: pfedkit.run({**CONFIG, "algorithm": algorithm, "out_dir": str(out / algorithm)})
            for algorithm in ("moon", "fedavg")}


def test_contrastive_loss_is_log_two_with_zero_gradient_when_global_equals_previous():
    generator = torch.Generator().manual_seed(0)
    z = torch.randn(7, 5, generator=generator, requires_grad=True)
    same = torch.randn(7, 5, generator=generator)
    for tau in (0.5, 0.1, 2.0):
        loss = contrastive_loss(z, same, same.clone(), tau)
        assert loss.item() == pytest.approx(math.log(2), abs=1e-6)
        (grad,) = torch.autograd.grad(loss, z)
        assert grad.abs().max() < 1e-6


def test_contrastive_loss_matches_a_hand_computation():
    z = torch.tensor([[1.0, 0.0], [1.0, 1.0], [0.0, 2.0]])
    z_global = torch.tensor([[3.0, 0.0], [1.0, 0.0], [0.0, -1.0]])
    z_prev = torch.tensor([[0.0, 1.0], [-2.0, -2.0], [1.0, 0.0]])
    tau = 0.5
    # cosines (global, previous) per row: (1, 0), (1/sqrt 2, -1), (-1, 0)
    cosines = [(1.0, 0.0), (1 / math.sqrt(2), -1.0), (-1.0, 0.0)]
    by_hand = [-math.log(math.exp(g / tau) / (math.exp(g / tau) + math.exp(p / tau))) for g, p in cosines]
    assert contrastive_loss(z, z_global, z_prev, tau).item() == pytest.approx(sum(by_hand) / 3, rel=1e-6)
    # swapping the roles of the two models changes the loss (the positive is the global one)
    swapped = contrastive_loss(z, z_prev, z_global, tau).item()
    assert swapped == pytest.approx(sum(math.log(1 + math.exp((g - p) / tau)) for g, p in cosines) / 3, rel=1e-6)
    assert swapped > contrastive_loss(z, z_global, z_prev, tau).item()


def test_moon_loss_reads_the_representations_at_the_batch_positions():
    generator = torch.Generator().manual_seed(1)
    n, d, classes = 10, 4, 3
    context = {"z_global": torch.randn(n, d, generator=generator), "z_prev": torch.randn(n, d, generator=generator)}
    index = torch.tensor([7, 2, 9])
    out = Forward(torch.randn(3, d, generator=generator), torch.randn(3, classes, generator=generator), index)
    y = torch.tensor([0, 2, 1])
    loss = moon_loss(out, y, {}, context, mu=2.0, tau=0.5)
    expected = F.cross_entropy(out.logits, y) + 2.0 * contrastive_loss(
        out.features, context["z_global"][index], context["z_prev"][index], 0.5)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    first_rows = F.cross_entropy(out.logits, y) + 2.0 * contrastive_loss(
        out.features, context["z_global"][:3], context["z_prev"][:3], 0.5)
    assert loss.item() != pytest.approx(first_rows.item(), rel=1e-3)
    ce = F.cross_entropy(out.logits, y).item()
    assert moon_loss(out, y, {}, context, mu=0.0, tau=0.5).item() == pytest.approx(ce)


def test_mu_zero_gives_fedavg_metrics_exactly(runs, tmp_path):
    moon = pfedkit.run({**CONFIG, "algorithm": "moon", "moon": {"mu": 0.0}, "out_dir": str(tmp_path)})
    pd.testing.assert_frame_equal(moon.metrics[COLUMNS], runs["fedavg"].metrics[COLUMNS])


def test_fit_gets_the_global_and_previous_representations_of_every_training_sample(tmp_path):
    prepared = prepare(load_config({"algorithm": "moon", "dataset": "digits", "num_clients": 3, "rounds": 1,
                                    "threads": 1, "seed": 3, "out_dir": str(tmp_path), "moon": {"mu": 3.0}}))
    algo, data = prepared.simulation.algorithm, prepared.data.clients[1]
    ops = algo.setup.ops
    initial = prepared.state.clients[1]["params"]
    previous = {name: value + 0.01 * torch.randn_like(value) for name, value in initial.items()}
    received = {name: value - 0.02 for name, value in initial.items()}
    update = algo.client_update(2, 1, {"params": previous}, {"params": received}, data)
    fit = next(update)
    assert fit.params is received and fit.loss.keywords == {"mu": 3.0, "tau": 0.5}
    assert fit.context["z_global"].shape == (data.n_train, ops.features(initial, data.x_train[:1]).shape[1])
    torch.testing.assert_close(fit.context["z_global"], ops.features(received, data.x_train))
    torch.testing.assert_close(fit.context["z_prev"], ops.features(previous, data.x_train))
    trained = {name: value + 1.0 for name, value in received.items()}
    with pytest.raises(StopIteration) as stop:
        update.send(trained)
    state, reply = stop.value.value
    assert state["params"] is trained and reply["params"] is trained and reply["weight"] == data.n_train


def test_digits_run_learns_keeps_previous_models_and_sends_one_model_each_way(runs):
    moon, fedavg = runs["moon"], runs["fedavg"]
    metrics = moon.metrics[moon.metrics["round"] >= 1]
    assert metrics.groupby("round")["accuracy"].mean().iloc[-1] > 0.3  # 10 classes: chance is 0.1
    state = final_state(moon)
    model_bytes = 4 * num_parameters(state.server["params"])
    took_part = metrics["bytes_down"] > 0
    assert (metrics.loc[took_part, "bytes_down"] == model_bytes).all()
    assert (metrics.loc[took_part, "bytes_up"] == model_bytes + 8).all()  # the model and n_i
    assert message_bytes(state.clients[0]["params"]) == model_bytes
    # round 1: every client's previous model is the global one, so l_con = log 2 has no gradient
    first = lambda result: result.metrics.loc[result.metrics["round"] == 1, COLUMNS]  # noqa: E731
    pd.testing.assert_frame_equal(first(moon), first(fedavg))
    assert not moon.metrics["accuracy"].equals(fedavg.metrics["accuracy"])


def test_processes_backend_equals_sequential(runs, tmp_path):
    processes = pfedkit.run({**CONFIG, "algorithm": "moon", "backend": "processes", "workers": 2,
                             "out_dir": str(tmp_path)})
    assert (runs["moon"].run_dir / "metrics.csv").read_bytes() == (processes.run_dir / "metrics.csv").read_bytes()
