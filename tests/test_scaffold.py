"""SCAFFOLD: the loss makes plain SGD the corrected step g - c_i + c; option II divides the
displacement by K lr (K counted here independently), option I is the full local gradient at x;
the server's x and c updates by hand (c over all N clients, x uniform or by n_i); one round from
zero control variates is FedAvg whatever the option; the two options then differ."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import pfedkit
from pfedkit.algorithms.scaffold import SCAFFOLD, scaffold_loss
from pfedkit.algorithms.step_probe import STEP_PROBE, with_step_probe
from pfedkit.core.contract import ClientData, Forward, Setup
from pfedkit.core.params import clone
from pfedkit.engine.trainer import FitJob, LocalTrainer, TrainSettings
from pfedkit.models.mlp import MLP
from tests.conftest import final_state

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NUM_SAMPLES, BATCH_SIZE, EPOCHS, LR = 23, 5, 3, 0.1  # K = 3 epochs * 5 batches = 15 steps


def build_model() -> MLP:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return MLP((4,), num_classes=3)


def client_data() -> ClientData:
    generator = torch.Generator().manual_seed(1)
    x, y = torch.randn(NUM_SAMPLES, 4, generator=generator), torch.randint(0, 3, (NUM_SAMPLES,), generator=generator)
    return ClientData(0, x, y, x[:2], y[:2], np.bincount(y.numpy(), minlength=3))


def drive(algorithm: SCAFFOLD, client: dict, message: dict, data: ClientData) -> tuple[dict, dict, list]:
    """Client 0's update with every Fit answered by the reference trainer -> (state, reply, answers)."""
    trainer = LocalTrainer(build_model, TrainSettings(EPOCHS, BATCH_SIZE, LR))
    update, answers = algorithm.client_update(1, 0, client, message, data), []
    request = next(update)
    while True:
        answers.append(trainer.fit(FitJob(1, 0, len(answers), request, None), data.x_train, data.y_train).params)
        try:
            request = update.send(answers[-1])
        except StopIteration as stop:
            return *stop.value, answers


def variates(x: dict, seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    return {name: 0.1 * torch.randn(value.shape, generator=generator) for name, value in x.items()}


def test_scaffold_loss_keeps_the_value_and_adds_c_minus_ci_to_the_gradient():
    w = {"w": torch.tensor([1.0, -2.0, 0.5], requires_grad=True)}
    correction = {"w": torch.tensor([0.3, 0.0, -1.0])}
    logits = torch.zeros(1, 2, requires_grad=True)  # CE does not depend on w: only the linear term does
    loss = scaffold_loss(Forward(torch.zeros(1, 1), logits), torch.tensor([0]), w, {"correction": correction})
    loss.backward()
    assert loss.item() == pytest.approx(np.log(2.0))
    torch.testing.assert_close(w["w"].grad, correction["w"])


def test_option_two_divides_the_displacement_by_k_lr():
    """c_i+ = c_i - c + (x - y_i) / (K lr), K = 15 steps of this client's schedule; the upload is
    y_i, c_i+ - c_i and n_i; the Fit corrects by c - c_i and measures K lr with the step probe."""
    x = dict(build_model().named_parameters())
    c, c_i = variates(x, 1), variates(x, 2)
    algorithm = SCAFFOLD(SCAFFOLD.Hyper(option="II"), None)
    state, reply, answers = drive(algorithm, {"control": c_i}, {"params": x, "control": c}, client_data())
    (answer,) = answers
    assert float(answer[STEP_PROBE]) == pytest.approx(15 * LR, rel=1e-6)
    y = {name: answer[name] for name in x}
    for name in x:
        expected = c_i[name] - c[name] + (x[name] - y[name]) / (15 * LR)
        torch.testing.assert_close(state["control"][name], expected, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(reply["control_delta"][name], state["control"][name] - c_i[name])
        assert torch.equal(reply["params"][name], y[name])
    assert set(reply) == {"params", "control_delta", "weight"} and reply["weight"] == NUM_SAMPLES


def test_option_two_fit_is_the_corrected_step():
    x = dict(build_model().named_parameters())
    c, c_i = variates(x, 1), variates(x, 2)
    update = SCAFFOLD(SCAFFOLD.Hyper(), None).client_update(1, 0, {"control": c_i}, {"params": x, "control": c},
                                                           client_data())
    request = next(update)
    assert request.params is x and request.loss.func is with_step_probe and request.loss.keywords == {"loss": scaffold_loss}
    for name in x:
        torch.testing.assert_close(request.context["correction"][name], c[name] - c_i[name])


def test_option_one_is_the_gradient_of_the_local_loss_at_the_server_model():
    """c_i+ = grad f_i(x) over all 23 samples (batches of 5 and a last one of 3, weighted by size)."""
    x = dict(build_model().named_parameters())
    data = client_data()
    algorithm = SCAFFOLD(SCAFFOLD.Hyper(option="I"), None)
    state, reply, answers = drive(algorithm, {"control": variates(x, 2)}, {"params": x, "control": variates(x, 1)}, data)
    assert len(answers) == 2  # the training, then the gradient pass (which leaves the model as it was)
    assert all(torch.equal(answers[1][name], x[name]) for name in x)
    model, live = build_model(), clone(x)
    for name, value in live.items():
        value.requires_grad_(True)
    logits = torch.func.functional_call(model, live, (data.x_train,))
    full = torch.autograd.grad(torch.nn.functional.cross_entropy(logits, data.y_train), list(live.values()))
    for (name, value), gradient in zip(live.items(), full):
        torch.testing.assert_close(state["control"][name], gradient, rtol=1e-5, atol=1e-6)


def test_server_steps_x_by_the_mean_change_and_c_by_the_changes_over_all_clients():
    """N = 5; participants 0 (n = 1) and 2 (n = 3): x = [1, 2], y = [3, 2] and [0, 1];
    x <- x + 0.5 * uniform mean(y - x) = [1.25, 1.75]; by n_i: [0.875, 1.625];
    c <- c + (dc_0 + dc_2) / 5 = [0.1, 0.1] + [1, 2] / 5."""
    setup = Setup(5, 1, np.array([[1], [2], [3], [4], [5]]), seed=0, local_epochs=1, ops=None)
    server = {"params": {"w": torch.tensor([1.0, 2.0])}, "control": {"w": torch.tensor([0.1, 0.1])}}
    replies = {0: {"params": {"w": torch.tensor([3.0, 2.0])}, "control_delta": {"w": torch.tensor([0.5, 1.0])}, "weight": 1},
               2: {"params": {"w": torch.tensor([0.0, 1.0])}, "control_delta": {"w": torch.tensor([0.5, 1.0])}, "weight": 3}}
    uniform = SCAFFOLD(SCAFFOLD.Hyper(global_lr=0.5), setup).aggregate(1, server, replies)
    torch.testing.assert_close(uniform["params"]["w"], torch.tensor([1.25, 1.75]))
    torch.testing.assert_close(uniform["control"]["w"], torch.tensor([0.3, 0.5]))
    by_samples = SCAFFOLD(SCAFFOLD.Hyper(global_lr=0.5, weights="samples"), setup).aggregate(1, server, replies)
    torch.testing.assert_close(by_samples["params"]["w"], torch.tensor([0.875, 1.625]))


def run_metrics(config: dict, name: str, **changes):
    return pfedkit.run({**config, "out_dir": f"{config['out_dir']}/{name}", **changes})


@pytest.mark.parametrize("option", ["I", "II"])
def test_first_round_from_zero_control_variates_is_fedavg(small_config, option):
    """Zero c and c_i and eta_g = 1 (n_i weights): round 1 is FedAvg's, whichever the option; the
    control variates it leaves make round 2 differ."""
    scaffold = run_metrics(small_config, f"s{option}", algorithm="scaffold", rounds=2,
                           scaffold={"option": option, "weights": "samples"}).metrics
    fedavg = run_metrics(small_config, "a", rounds=2).metrics
    first = fedavg["round"] == 1
    np.testing.assert_allclose(scaffold.loc[first, "loss"], fedavg.loc[first, "loss"], rtol=0, atol=1e-5)
    assert scaffold.loc[first, "accuracy"].equals(fedavg.loc[first, "accuracy"])
    assert not np.allclose(scaffold.loc[~first, "loss"], fedavg.loc[~first, "loss"], atol=1e-4)


def test_options_one_and_two_agree_in_round_one_and_then_differ(small_config):
    """Both start from zero variates (the same round-1 models) but set different c_i."""
    one = run_metrics(small_config, "I", algorithm="scaffold", rounds=2, scaffold={"option": "I"})
    two = run_metrics(small_config, "II", algorithm="scaffold", rounds=2, scaffold={"option": "II"})
    first = one.metrics["round"] == 1
    np.testing.assert_allclose(one.metrics.loc[first, "loss"], two.metrics.loc[first, "loss"], rtol=0, atol=1e-6)
    assert not np.allclose(one.metrics.loc[~first, "loss"], two.metrics.loc[~first, "loss"], atol=1e-5)
    controls = [final_state(run).clients for run in (one, two)]
    assert any(not torch.allclose(controls[0][0]["control"][name], controls[1][0]["control"][name])
               for name in controls[0][0]["control"])


def test_uniform_server_mean_is_not_fedavg_on_unequal_clients(small_config):
    """The paper's uniform mean (the default) differs from FedAvg's n_i mean already in round 1."""
    scaffold = run_metrics(small_config, "s", algorithm="scaffold", rounds=1).metrics
    fedavg = run_metrics(small_config, "a", rounds=1).metrics
    assert not np.allclose(scaffold["loss"], fedavg["loss"], atol=1e-4)
    # two models down (x, c), two up (y_i, c_i+ - c_i) and n_i
    assert (scaffold["bytes_down"] == 2 * fedavg["bytes_down"]).all()
    assert (scaffold["bytes_up"] == 2 * fedavg["bytes_up"] - 8 * fedavg["participated"]).all()


@pytest.mark.parametrize("option, join_ratio", [("II", 1.0), ("I", 1.0), ("II", 0.5)])
def test_server_control_stays_the_mean_of_the_client_controls(small_config, option, join_ratio):
    """c = (1/N) sum_i c_i after every round (all start at 0; c moves by (1/N) sum of the
    participants' changes): with full participation, and with half the clients a round too."""
    run = run_metrics(small_config, f"m{option}{join_ratio}", algorithm="scaffold", rounds=3, join_ratio=join_ratio,
                      scaffold={"option": option})
    state = final_state(run)
    clients = [state.clients[cid]["control"] for cid in range(small_config["num_clients"])]
    for name, value in state.server["control"].items():
        assert value.abs().max() > 0  # the variates did move
        mean = torch.stack([control[name] for control in clients]).mean(dim=0)
        torch.testing.assert_close(value, mean, rtol=1e-5, atol=1e-6)
