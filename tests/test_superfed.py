"""SuPerFed: FedAvg before the mixing phase (mu = 0), the mixing phase's start, the local step of
eq. (1) against a hand computation (both proximity forms), the regularisers by hand, what is
uploaded and kept, the evaluated mixture, and a digits run that learns."""
from __future__ import annotations

from dataclasses import replace
from functools import partial

import numpy as np
import pytest
import torch
from conftest import TinyNet, final_state, tiny_params
from torch import nn
from torch.func import functional_call

import pfedkit
from pfedkit.algorithms.superfed import LambdaSampler, SuPerFed, proximity, regulariser, squared_cosine
from pfedkit.core.contract import ClientData, Fit, Setup
from pfedkit.core.model_ops import ModelOps
from pfedkit.core.seeds import torch_generator
from pfedkit.engine.trainer import FitJob, LocalTrainer, TrainSettings, batch_schedule

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def algorithm(rounds: int = 10, **options) -> SuPerFed:
    setup = Setup(2, 3, np.ones((2, 3)), 0, 1, ModelOps(TinyNet), rounds=rounds)
    return SuPerFed(SuPerFed.Hyper(**options), setup)


def test_before_the_mixing_phase_with_mu_zero_it_is_fedavg(small_config):
    fedavg = pfedkit.run({**small_config, "out_dir": small_config["out_dir"] + "-fedavg"}).metrics
    superfed = pfedkit.run({**small_config, "algorithm": "superfed",
                            "superfed": {"mu": 0.0, "nu": 1.0, "mix_start": 1.0}}).metrics
    for column in ["round", "client", "accuracy", "loss", "train_loss", "bytes_up", "bytes_down"]:
        np.testing.assert_array_equal(superfed[column].to_numpy(), fedavg[column].to_numpy(), err_msg=column)


def test_before_the_mixing_phase_the_squared_proximity_is_fedproxs_term(small_config):
    """mu ||w_f - w_g||^2 is FedProx's (mu'/2) ||w - w_g||^2 at mu' = 2 mu."""
    fedprox = pfedkit.run({**small_config, "algorithm": "fedprox", "fedprox": {"mu": 0.4},
                           "out_dir": small_config["out_dir"] + "-fedprox"}).metrics
    superfed = pfedkit.run({**small_config, "algorithm": "superfed",
                            "superfed": {"mu": 0.2, "mix_start": 1.0}}).metrics
    for column in ["accuracy", "loss", "train_loss"]:
        np.testing.assert_allclose(superfed[column].to_numpy(), fedprox[column].to_numpy(), rtol=1e-5,
                                   err_msg=column)


def test_the_mixing_phase_starts_after_floor_L_R_rounds():
    algo = algorithm(rounds=10, mix_start=0.6)
    assert [algo.mixing(r) for r in range(1, 11)] == [False] * 6 + [True] * 4
    assert all(algorithm(rounds=10, mix_start=0.0).mixing(r) for r in range(1, 11))
    assert not any(algorithm(rounds=10, mix_start=1.0).mixing(r) for r in range(1, 11))


def test_regularisers_by_hand():
    f = {"a": torch.tensor([1.0, 0.0]), "b": torch.tensor([[2.0]])}
    l = {"a": torch.tensor([1.0, 1.0]), "b": torch.tensor([[0.0]])}
    g = {"a": torch.tensor([1.0, 3.0]), "b": torch.tensor([[-2.0]])}
    # <f, l> = 1, ||f||^2 = 5, ||l||^2 = 2: cos^2 = 1 / 10
    assert float(squared_cosine(f, l)) == pytest.approx(0.1)
    assert float(squared_cosine(f, {n: -3 * t for n, t in f.items()})) == pytest.approx(1.0)  # sign-free
    # f - g = ([0, -3], [4]): squared 9 + 16 = 25; per-tensor norms 3 + 4 = 7
    assert float(proximity(f, g, "squared")) == pytest.approx(25.0)
    assert float(proximity(f, g, "layer_norms")) == pytest.approx(7.0)
    total = regulariser(f, l, g, mu=0.5, nu=3.0, proximal="squared")
    assert float(total) == pytest.approx(0.5 * 25 + 3.0 * 0.1)
    assert float(regulariser(f, l, g, mu=0.0, nu=0.0, proximal="squared")) == 0.0


def grad_at(params, x, y):
    point = {k: v.detach().requires_grad_(True) for k, v in params.items()}
    loss = nn.functional.cross_entropy(functional_call(TinyNet(), point, (x,)), y)
    return dict(zip(point, torch.autograd.grad(loss, list(point.values()))))


def hand_regulariser_gradients(f, l, g, mu, nu, proximal):
    """d/dw_f and d/dw_l of mu P(w_f, w_g) + nu cos^2(w_f, w_l), differentiated by hand:
    cos^2 = a^2 / (b c), a = <f, l>, b = ||f||^2, c = ||l||^2:
    d/df = 2 a l / (b c) - 2 a^2 f / (b^2 c), d/dl = 2 a f / (b c) - 2 a^2 l / (b c^2);
    d/df ||f - g||^2 = 2 (f - g); d/df ||f - g||_2 = (f - g) / ||f - g||_2 per tensor (0 where f = g)."""
    a = sum(float((f[n] * l[n]).sum()) for n in f)
    b = sum(float((f[n] ** 2).sum()) for n in f)
    c = sum(float((l[n] ** 2).sum()) for n in f)
    grad_f, grad_l = {}, {}
    for n in f:
        distance = torch.linalg.vector_norm(f[n] - g[n])
        if proximal == "squared":
            prox = 2 * (f[n] - g[n])
        else:  # at w_f = w_g (the first step) the subgradient 0, as autograd's
            prox = (f[n] - g[n]) / distance if distance > 0 else torch.zeros_like(f[n])
        grad_f[n] = mu * prox + nu * (2 * a * l[n] / (b * c) - 2 * a * a * f[n] / (b * b * c))
        grad_l[n] = nu * (2 * a * f[n] / (b * c) - 2 * a * a * l[n] / (b * c * c))
    return grad_f, grad_l


@pytest.mark.parametrize("proximal,mixing", [("squared", "model"), ("layer_norms", "model"), ("squared", "layer")])
def test_mixing_steps_match_a_hand_computation(proximal, mixing):
    lr, mu, nu = 0.3, 0.2, 0.7
    algo = algorithm(rounds=10, mix_start=0.0, mu=mu, nu=nu, proximal=proximal, mixing=mixing)
    g = torch.Generator().manual_seed(4)
    x, y = torch.randn(8, 3, generator=g), torch.randint(0, 3, (8,), generator=g)
    data = ClientData(1, x, y, x[:2], y[:2], np.bincount(y.numpy(), minlength=3))
    anchor, personal = tiny_params(0), tiny_params(1)
    update = algo.client_update(2, 1, {"personal": personal, "mixed": True}, {"params": anchor}, data)
    fit = next(update)
    settings = TrainSettings(local_epochs=1, batch_size=4, lr=lr, seed=3)
    trained = LocalTrainer(TinyNet, settings).fit(FitJob(2, 1, 0, fit, None), x, y).params
    with pytest.raises(StopIteration) as stop:
        update.send(trained)
    state, reply = stop.value.value

    f, l = dict(anchor), dict(personal)
    draws = LambdaSampler(torch_generator(0, 2, 1, "superfed-lambda"))  # (seed, round, client)
    schedule = batch_schedule(fit, settings, len(y), torch_generator(settings.seed, 2, 1, "fit-0"))
    assert len(schedule) == 2
    for batch in schedule:
        if mixing == "model":
            lam = dict.fromkeys(f, draws())
        else:  # one draw per layer, in the model's order; a layer's weight and bias share it
            layers = {n.rsplit(".", 1)[0]: None for n in f}
            by_layer = {layer: draws() for layer in layers}
            lam = {n: by_layer[n.rsplit(".", 1)[0]] for n in f}
            assert len(set(lam.values())) == 2
        grad = grad_at({n: (1 - lam[n]) * f[n] + lam[n] * l[n] for n in f}, x[batch], y[batch])
        reg_f, reg_l = hand_regulariser_gradients(f, l, anchor, mu, nu, proximal)
        f, l = ({n: f[n] - lr * ((1 - lam[n]) * grad[n] + reg_f[n]) for n in f},
                {n: l[n] - lr * (lam[n] * grad[n] + reg_l[n]) for n in l})
    assert all(0 < value < 1 for value in lam.values())
    assert set(reply["params"]) == set(anchor) and reply["weight"] == 8  # w_l is never uploaded
    assert state["mixed"] and set(state["personal"]) == set(anchor)
    for n in f:
        torch.testing.assert_close(reply["params"][n], f[n])
        torch.testing.assert_close(state["personal"][n], l[n])


def test_lambda_at_zero_without_regularisers_trains_the_federated_model_as_fedavg():
    """Every draw lam = 0, mu = nu = 0: w_f takes FedAvg's SGD steps, w_l does not move."""
    algo = algorithm(rounds=10, mix_start=0.0, mu=0.0, nu=0.0)
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(8, 3, generator=g), torch.randint(0, 3, (8,), generator=g)
    data = ClientData(0, x, y, x[:2], y[:2], np.bincount(y.numpy(), minlength=3))
    anchor, personal = tiny_params(0), tiny_params(1)
    fit = next(algo.client_update(1, 0, {"personal": personal, "mixed": True}, {"params": anchor}, data))
    at_zero = replace(fit, step=partial(fit.step.func, **{**fit.step.keywords, "sampler": lambda: 0.0}))
    settings = TrainSettings(local_epochs=1, batch_size=4, lr=0.3, seed=3)
    mixed = LocalTrainer(TinyNet, settings).fit(FitJob(1, 0, 0, at_zero, None), x, y).params
    plain = LocalTrainer(TinyNet, settings).fit(FitJob(1, 0, 0, Fit(anchor), None), x, y).params
    for n in anchor:
        torch.testing.assert_close(mixed[n], plain[n])
        torch.testing.assert_close(mixed["personal." + n], personal[n], rtol=0, atol=0)


def test_evaluated_model_is_the_mixture_at_eval_lambda_and_the_federated_model_before():
    algo = algorithm(eval_lambda=0.25)
    federated, personal = tiny_params(0), tiny_params(1)
    model = algo.client_model(0, {"params": federated}, {"personal": personal, "mixed": True})
    for n in federated:
        torch.testing.assert_close(model[n], 0.75 * federated[n] + 0.25 * personal[n])
    assert algo.client_model(0, {"params": federated}, {"personal": personal, "mixed": False}) is federated


def test_personal_models_start_apart_from_the_federated_one_and_from_each_other():
    algo, params = algorithm(), tiny_params(0)
    first, second, again = algo.init_client(0, params), algo.init_client(1, params), algo.init_client(0, params)
    assert not first["mixed"]
    for n in params:
        assert not torch.equal(first["personal"][n], params[n]) and not torch.equal(first["personal"][n],
                                                                                    second["personal"][n])
        torch.testing.assert_close(first["personal"][n], again["personal"][n], rtol=0, atol=0)


def test_digits_run_learns_the_line_and_sends_only_the_federated_model(small_config):
    config = {**small_config, "rounds": 4}
    fedavg = pfedkit.run({**config, "out_dir": config["out_dir"] + "-fedavg"}).metrics
    result = pfedkit.run({**config, "algorithm": "superfed", "superfed": {"mix_start": 0.5}})
    metrics = result.metrics
    np.testing.assert_array_equal(metrics["bytes_up"].to_numpy(), fedavg["bytes_up"].to_numpy())
    np.testing.assert_array_equal(metrics["bytes_down"].to_numpy(), fedavg["bytes_down"].to_numpy())
    assert metrics[metrics["round"] == 4]["accuracy"].mean() > 0.3
    state = final_state(result)
    assert all(client["mixed"] for client in state.clients)
