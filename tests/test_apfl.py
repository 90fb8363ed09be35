"""APFL: the simultaneous w, v, alpha updates against a hand computation, alpha = 0 without
adaptation against FedAvg, alpha clipped to [0, 1], and the mixed model as the evaluated one."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import TinyNet as Tiny
from conftest import final_state, tiny_params
from torch import nn
from torch.func import functional_call

import pfedkit
from pfedkit.algorithms.apfl import APFL
from pfedkit.core.contract import ClientData, Setup
from pfedkit.core.seeds import torch_generator
from pfedkit.engine.trainer import FitJob, LocalTrainer, TrainSettings, batch_schedule


def grad_at(params, x, y):
    point = {k: v.detach().requires_grad_(True) for k, v in params.items()}
    loss = nn.functional.cross_entropy(functional_call(Tiny(), point, (x,)), y)
    return dict(zip(point, torch.autograd.grad(loss, list(point.values()))))


def algorithm(**options) -> APFL:
    return APFL(APFL.Hyper(**options), Setup(1, 3, np.ones((1, 3)), seed=0, local_epochs=1, ops=None))


@pytest.mark.parametrize("alpha_lr", [None, 0.7, 1e3])  # None: the config's lr; 1e3: alpha hits a bound
def test_local_steps_match_hand_computation(alpha_lr):
    lr, alpha_init = 0.2, 0.3
    algo = algorithm(alpha_init=alpha_init, alpha_lr=alpha_lr)
    settings = TrainSettings(local_epochs=1, batch_size=4, lr=lr, seed=3)
    g = torch.Generator().manual_seed(4)
    x, y = torch.randn(8, 3, generator=g), torch.randint(0, 3, (8,), generator=g)
    data = ClientData(0, x, y, x[:2], y[:2], np.bincount(y.numpy(), minlength=3))
    received, client = tiny_params(0), {"personal": tiny_params(1), "alpha": alpha_init}  # v != w
    update = algo.client_update(1, 0, client, {"params": received}, data)
    fit = next(update)
    trained = LocalTrainer(Tiny, settings).fit(FitJob(1, 0, 0, fit, None), x, y).params
    with pytest.raises(StopIteration) as stop:
        update.send(trained)
    state, reply = stop.value.value

    w, v, alpha = dict(received), dict(client["personal"]), alpha_init
    schedule = batch_schedule(fit, settings, len(y), torch_generator(settings.seed, 1, 0, "fit-0"))
    assert len(schedule) == 2  # two steps: w, v and alpha carry over from the first to the second
    for batch in schedule:
        grad_w = grad_at(w, x[batch], y[batch])
        mixed = {k: alpha * v[k] + (1 - alpha) * w[k] for k in w}
        grad_mixed = grad_at(mixed, x[batch], y[batch])
        slope = sum(float(((v[k] - w[k]) * grad_mixed[k]).sum()) for k in w)
        new_alpha = min(1.0, max(0.0, alpha - (lr if alpha_lr is None else alpha_lr) * slope))
        v = {k: v[k] - lr * alpha * grad_mixed[k] for k in v}
        w = {k: w[k] - lr * grad_w[k] for k in w}
        alpha = new_alpha
    for k in w:
        torch.testing.assert_close(reply["params"][k], w[k])
        torch.testing.assert_close(state["personal"][k], v[k])
    assert state["alpha"] == pytest.approx(alpha, abs=1e-6)
    assert reply["weight"] == 8 and set(reply["params"]) == set(received)
    if alpha_lr == 1e3:
        assert state["alpha"] in (0.0, 1.0)
    else:
        assert 0.0 < state["alpha"] < 1.0 and state["alpha"] != pytest.approx(alpha_init, abs=1e-4)


def test_alpha_zero_without_adaptation_equals_fedavg(small_config):
    config = {**small_config, "rounds": 2, "threads": 1, "momentum": 0.0}
    apfl = final_state(pfedkit.run({**config, "algorithm": "apfl", "apfl": {"alpha_init": 0.0, "adaptive": False}}))
    fedavg = final_state(pfedkit.run({**config, "algorithm": "fedavg"}))
    for k in fedavg.server["params"]:
        torch.testing.assert_close(apfl.server["params"][k], fedavg.server["params"][k])
    assert all(client["alpha"] == 0.0 for client in apfl.clients)


def test_alpha_stays_in_the_unit_interval(small_config):
    """A huge alpha step would leave [0, 1] without the clip."""
    state = final_state(pfedkit.run({**small_config, "algorithm": "apfl", "threads": 1, "rounds": 2,
                                     "apfl": {"alpha_lr": 50.0}}))
    alphas = [client["alpha"] for client in state.clients]
    assert all(0.0 <= a <= 1.0 for a in alphas) and any(a in (0.0, 1.0) for a in alphas)


def test_evaluated_model_mixes_the_personal_and_current_global_model():
    algo = algorithm()
    global_, personal = tiny_params(0), tiny_params(1)
    model = algo.client_model(0, {"params": global_}, {"personal": personal, "alpha": 0.25})
    for k in global_:
        torch.testing.assert_close(model[k], 0.25 * personal[k] + 0.75 * global_[k])
    assert algo.init_client(0, global_)["alpha"] == 0.5


def test_end_to_end_on_digits_beats_chance(small_config):
    result = pfedkit.run({**small_config, "algorithm": "apfl", "threads": 1})
    assert result.summary["final_acc"] > 0.3


def test_after_local_training_evaluates_the_mixture_of_the_new_models(small_config):
    """eval_point=after_local_training: a participant is evaluated with alpha v + (1 - alpha) w of
    its just-trained w, v and alpha, not with the raw trained w."""
    from pfedkit.algorithms.apfl import APFL, mixture

    algo = APFL(APFL.Hyper(), None)
    client = {"personal": {"w": torch.tensor([2.0])}, "alpha": 0.25}
    trained = {"w": torch.tensor([6.0]), "personal.w": torch.tensor([2.0]), "alpha": torch.tensor(0.25)}
    got = algo.trained_model(0, client, trained)
    assert set(got) == {"w"} and got["w"].item() == 5.0
    assert mixture(client["personal"], {"w": torch.tensor([6.0])}, 0.25)["w"].item() == got["w"].item()
