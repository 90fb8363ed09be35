"""FedNova and the step probe it measures ||a_i||_1 with: the probe holds K lr after K plain SGD steps
and FedNova's momentum formula with momentum, without changing the training; the normalised average
of two clients of different step counts by hand; a client without steps adds nothing; equal step
counts give FedAvg; the upload is FedAvg's + one number."""
from __future__ import annotations

from functools import partial

import numpy as np
import pytest
import torch

import pfedkit
from pfedkit.algorithms.fednova import FedNova, normalised_average
from pfedkit.algorithms.step_probe import STEP_PROBE, effective_step, step_probe_start, with_step_probe
from pfedkit.core.contract import ClientData, Fit, cross_entropy
from pfedkit.engine.trainer import FitJob, LocalTrainer, TrainSettings
from pfedkit.models.mlp import MLP

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NUM_SAMPLES, BATCH_SIZE, LR = 23, 5, 0.1  # 5 batches per epoch (the last holds 3 samples)


def build_model() -> MLP:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return MLP((4,), num_classes=3)


def train(request: Fit, **settings):
    generator = torch.Generator().manual_seed(1)
    x, y = torch.randn(NUM_SAMPLES, 4, generator=generator), torch.randint(0, 3, (NUM_SAMPLES,), generator=generator)
    trainer = LocalTrainer(build_model, TrainSettings(**{"local_epochs": 3, "batch_size": BATCH_SIZE, "lr": LR,
                                                         "seed": 0, **settings}))
    return trainer.fit(FitJob(1, 0, 0, request, None), x, y)


def probed(params) -> Fit:
    return Fit(params, loss=partial(with_step_probe, loss=cross_entropy), extra=step_probe_start())


@pytest.mark.parametrize("settings, steps", [({}, 15), ({"local_steps": 7}, 7), ({"drop_last": True}, 12)])
@pytest.mark.parametrize("rho", [0.0, 0.9])
def test_step_probe_holds_lr_times_the_solvers_coefficient_sum(settings, steps, rho):
    """Plain SGD: s = tau lr; momentum rho: s = lr [tau - rho (1 - rho^tau) / (1 - rho)] / (1 - rho)
    (FedNova, sec. 4), for epochs, local_steps and drop_last schedules alike."""
    params = dict(build_model().named_parameters())
    outcome = train(probed(params), momentum=rho, **settings)
    assert outcome.steps == steps
    expected = LR * steps if rho == 0 else LR * (steps - rho * (1 - rho ** steps) / (1 - rho)) / (1 - rho)
    assert effective_step(outcome.params) == pytest.approx(expected, rel=1e-6)


def test_step_probe_changes_neither_the_model_nor_the_loss():
    params = dict(build_model().named_parameters())
    with_probe, without = train(probed(params), momentum=0.9), train(Fit(params), momentum=0.9)
    assert with_probe.mean_loss == without.mean_loss
    assert all(torch.equal(with_probe.params[name], without.params[name]) for name in without.params)


def test_normalised_average_of_two_clients_by_hand():
    """x = 0; client 0: n = 1, s = 2, y = [-2, 2]; client 1: n = 3, s = 6, y = [3, 0].
    p = [1/4, 3/4], tau_eff = 1/4 * 2 + 3/4 * 6 = 5, d = [(x - y_0)/2, (x - y_1)/6] = [[1, -1], [-1/2, 0]],
    x <- -5 (1/4 [1, -1] + 3/4 [-1/2, 0]) = [0.625, 1.25] (FedAvg: [1.75, 0.5])."""
    x = {"w": torch.zeros(2)}
    result = normalised_average(x, [{"w": torch.tensor([-2.0, 2.0])}, {"w": torch.tensor([3.0, 0.0])}],
                                steps=[2.0, 6.0], weights=[1.0, 3.0])
    torch.testing.assert_close(result["w"], torch.tensor([0.625, 1.25]))


def test_a_client_that_took_no_step_adds_no_update():
    """s_0 = 0 (no batch): tau_eff = 3/4 * 6 = 4.5; x <- -4.5 * 3/4 * [-1/2, 0] = [1.6875, 0]."""
    x = {"w": torch.zeros(2)}
    result = normalised_average(x, [{"w": torch.zeros(2)}, {"w": torch.tensor([3.0, 0.0])}],
                                steps=[0.0, 6.0], weights=[1.0, 3.0])
    torch.testing.assert_close(result["w"], torch.tensor([1.6875, 0.0]))


def test_client_trains_with_the_probe_and_uploads_its_value():
    algorithm = FedNova(FedNova.Hyper(), None)
    received = {"w": torch.tensor([1.0, 2.0])}
    data = ClientData(0, torch.zeros(7, 3), torch.zeros(7), torch.zeros(2, 3), torch.zeros(2), np.array([4, 3]))
    update = algorithm.client_update(1, 0, None, {"params": received}, data)
    request = next(update)
    assert request.params is received and float(request.extra[STEP_PROBE]) == 0.0
    assert request.loss.keywords == {"loss": cross_entropy}
    with pytest.raises(StopIteration) as stop:
        update.send({"w": torch.tensor([0.0, 1.0]), STEP_PROBE: torch.tensor(0.75)})
    state, reply = stop.value.value
    assert state is None and reply["local_step"] == 0.75 and reply["weight"] == 7
    assert list(reply["params"]) == ["w"] and torch.equal(reply["params"]["w"], torch.tensor([0.0, 1.0]))


def test_equal_step_counts_give_fedavg_and_unequal_ones_do_not(small_config):
    """local_steps=3: every client takes 3 steps, so tau_eff / s_i = 1 and the rule is FedAvg's mean
    (up to float rounding); with epochs the clients' step counts follow n_i and the runs differ."""
    def run(algorithm: str, **changes):
        return pfedkit.run({**small_config, "algorithm": algorithm, "join_ratio": 0.75, **changes,
                            "out_dir": f"{small_config['out_dir']}/{algorithm}-{len(changes)}"}).metrics
    equal_nova, equal_avg = run("fednova", local_steps=3), run("fedavg", local_steps=3)
    for column in ("accuracy", "loss"):
        np.testing.assert_allclose(equal_nova[column], equal_avg[column], rtol=0, atol=1e-5)
    nova, fedavg = run("fednova"), run("fedavg")
    assert not np.allclose(nova["loss"], fedavg["loss"], atol=1e-3)
    # the upload: FedAvg's model + n_i, and the effective step (8 bytes)
    assert ((nova["bytes_up"] - fedavg["bytes_up"])[nova["participated"] == 1] == 8).all()
