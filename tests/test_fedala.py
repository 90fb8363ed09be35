"""FedALA: one weight-learning step against a hand computation (clipped gradient step on W, top
layers re-mixed, lower layers global), W = 1 as FedAvg's start (the global model bit for bit),
W = 0 as the local top layers, the first ALA's stopping rule and one epoch per later round, the
subset D_i^s, and the run on digits."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import TinyNet, final_state, learned_run, num_parameters, tiny_params
from torch.func import functional_call

from pfedkit.algorithms.fedala import (GLOBAL, LAST_LOSS, LOCAL, WEIGHT, FedALA, ala_step, converged,
                                       top_layer_names)
from pfedkit.core.contract import ClientData, Fit, Setup
from pfedkit.engine.trainer import FitJob, LocalTrainer, TrainSettings

TOP = ["head.weight", "head.bias"]  # TinyNet's last layer
SETTINGS = TrainSettings(local_epochs=1, batch_size=4, lr=0.1, seed=3)


def algorithm(**options) -> FedALA:
    return FedALA(FedALA.Hyper(**options), Setup(1, 3, np.ones((1, 3)), seed=0, local_epochs=1, ops=None))


def client_data(n: int = 12) -> ClientData:
    generator = torch.Generator().manual_seed(4)
    x, y = torch.randn(n, 3, generator=generator), torch.randint(0, 3, (n,), generator=generator)
    return ClientData(0, x, y, x[:2], y[:2], np.bincount(y.numpy(), minlength=3))


def run_update(algo: FedALA, rnd: int, client: dict, received: dict, data: ClientData):
    """Drive client_update with the reference trainer: (state, reply, [(request, answer)...])."""
    trainer, fits = LocalTrainer(TinyNet, SETTINGS), []
    update = algo.client_update(rnd, 0, client, {"params": received}, data)
    request = next(update)
    while True:
        answer = trainer.fit(FitJob(rnd, 0, len(fits), request, None), data.x_train, data.y_train).params
        fits.append((request, answer))
        try:
            request = update.send(answer)
        except StopIteration as stop:
            state, reply = stop.value
            return state, reply, fits


def same(a: dict, b: dict, names) -> bool:
    return all(torch.equal(a[name], b[name]) for name in names)


def test_one_step_is_the_clipped_gradient_step_on_w_then_the_top_layers_are_remixed():
    """W <- clip(W - eta g ⊙ (theta - theta_i), 0, 1) with g the gradient at theta_hat, then
    theta_hat = theta_i + (theta - theta_i) ⊙ W on the top layer; the lower layer stays global."""
    eta = 30.0  # large enough that some entries hit the bounds
    local, global_ = tiny_params(1), tiny_params(2)
    generator = torch.Generator().manual_seed(5)
    weights = {name: torch.rand(global_[name].shape, generator=generator) for name in TOP}
    start = {**global_, **{n: torch.lerp(local[n], global_[n], weights[n]) for n in TOP}}
    data = client_data(4)
    extra = {**{WEIGHT + n: weights[n] for n in TOP}, **{LOCAL + n: local[n] for n in TOP},
             **{GLOBAL + n: global_[n] for n in TOP}, LAST_LOSS: torch.zeros(())}
    request = Fit(start, step=ala_step, lr=eta, steps=1, extra=extra)
    answer = LocalTrainer(TinyNet, SETTINGS).fit(FitJob(1, 0, 0, request, None), data.x_train, data.y_train).params

    point = {name: value.clone().requires_grad_(name in TOP) for name, value in start.items()}
    loss = F.cross_entropy(functional_call(TinyNet(), point, (data.x_train,)), data.y_train)
    grads = dict(zip(TOP, torch.autograd.grad(loss, [point[n] for n in TOP])))
    clipped, inside = False, False
    for name in TOP:
        unclipped = weights[name] - eta * grads[name] * (global_[name] - local[name])
        expected = unclipped.clamp(0, 1)
        torch.testing.assert_close(answer[WEIGHT + name], expected)
        torch.testing.assert_close(answer[name], local[name] + (global_[name] - local[name]) * expected)
        clipped |= bool(((unclipped < 0) | (unclipped > 1)).any())
        inside |= bool(((expected > 0) & (expected < 1)).any())
    assert clipped and inside  # the bounds and the gradient step both matter here
    assert same(answer, global_, ["body.0.weight", "body.0.bias"])  # lower layer: the global one
    torch.testing.assert_close(answer[LAST_LOSS], loss.detach())


def test_weights_fixed_at_one_start_the_local_training_from_the_global_model_bit_for_bit():
    """eta = 0: W stays 1, so theta_hat = theta on every layer: FedAvg's client start (nothing
    local kept), whatever the old local model; the evaluated model is the global model too."""
    algo, received = algorithm(eta=0.0), tiny_params(2)
    client = {"local": tiny_params(1), "weights": {}}
    state, reply, fits = run_update(algo, 2, client, received, client_data())
    assert len(fits) > 1  # the ALA ran (its first time: the warm-up)
    assert same(fits[-1][0].params, received, received)
    assert all(torch.equal(w, torch.ones_like(w)) for w in state["weights"].values())
    assert same(algo.client_model(0, {"params": received}, state), received, received)
    assert reply["weight"] == 12 and same(reply["params"], fits[-1][1], received)


def test_zero_weights_keep_the_local_top_layers_and_take_the_global_lower_layers():
    algo, received, local = algorithm(eta=0.0), tiny_params(2), tiny_params(1)
    client = {"local": local, "weights": {name: torch.zeros_like(received[name]) for name in TOP}}
    _, _, fits = run_update(algo, 3, client, received, client_data())
    assert len(fits) == 2  # W exists: one ALA epoch, then the local training
    start = fits[-1][0].params
    assert same(start, local, TOP) and same(start, received, ["body.0.weight", "body.0.bias"])
    assert same(algo.client_model(0, {"params": received}, client), start, start)


def test_the_first_ala_runs_until_the_loss_std_is_below_the_threshold_then_one_epoch_a_round():
    received, data = tiny_params(2), client_data()
    never_converges = algorithm(threshold=1e-12, max_warmup_epochs=6)
    _, _, fits = run_update(never_converges, 2, {"local": tiny_params(1), "weights": {}}, received, data)
    assert len(fits) == 6 + 1  # the bound, then the local training
    at_once = algorithm(threshold=1e9, num_pre_loss=3)  # any window of losses has std < 1e9
    state, _, fits = run_update(at_once, 2, {"local": tiny_params(1), "weights": {}}, received, data)
    assert len(fits) == 3 + 1 + 1  # more than num_pre_loss losses are needed
    _, _, later = run_update(at_once, 3, state, received, data)
    assert len(later) == 1 + 1


def test_stopping_rule_reads_the_population_std_of_the_last_window():
    assert not converged([1.0, 1.0, 1.0], window=3, threshold=0.1)  # not more than `window` losses
    assert converged([9.0, 1.0, 1.1, 1.0], window=3, threshold=0.05)  # std([1, 1.1, 1]) = 0.047
    assert not converged([9.0, 1.0, 1.2, 1.0], window=3, threshold=0.09)  # population std 0.094 (sample: 0.115)
    assert converged([9.0, 1.0, 1.2, 1.0], window=3, threshold=0.1)


def test_weights_are_learned_on_a_fraction_s_of_the_training_set_drawn_each_round():
    algo, received, data = algorithm(sample_fraction=0.5, max_warmup_epochs=3), tiny_params(2), client_data(12)
    state, _, fits = run_update(algo, 2, {"local": tiny_params(1), "weights": {}}, received, data)
    subsets = [request.samples for request, _ in fits[:-1]]
    assert all(len(s) == 6 and len(set(s.tolist())) == 6 for s in subsets)
    assert all(torch.equal(s, subsets[0]) for s in subsets) and fits[-1][0].samples is None
    _, _, later = run_update(algo, 3, state, received, data)
    assert not torch.equal(later[0][0].samples, subsets[0])  # drawn again in the next round


def test_a_subset_smaller_than_one_batch_still_learns_w_under_the_configs_drop_last():
    """The ALA requests keep the last, incomplete batch (the authors' loader): 3 rows of D_i^s at
    B = 4 with drop_last on still take a W step, so W leaves 1 (else the client would be FedAvg)."""
    algo, received, data = algorithm(sample_fraction=0.5, max_warmup_epochs=2), tiny_params(2), client_data(6)
    trainer = LocalTrainer(TinyNet, TrainSettings(local_epochs=1, batch_size=4, lr=0.1, seed=3, drop_last=True))
    update = algo.client_update(2, 0, {"local": tiny_params(1), "weights": {}}, {"params": received}, data)
    request = next(update)
    assert request.drop_last is False and len(request.samples) == 3
    answer = trainer.fit(FitJob(2, 0, 0, request, None), data.x_train, data.y_train)
    assert answer.steps == 1
    assert any(not torch.equal(answer.params[WEIGHT + name], torch.ones_like(received[name])) for name in TOP)


def test_top_layers_are_the_last_p_layers_and_a_newcomer_starts_from_the_global_model():
    params = tiny_params(0)
    assert top_layer_names(params, 1) == TOP
    assert top_layer_names(params, 2) == list(params)
    received = tiny_params(2)
    state, _, fits = run_update(algorithm(), 1, FedALA.init_client(algorithm(), 0, received), received, client_data())
    assert len(fits) == 1 and fits[0][0].params is received  # no local model yet: no ALA
    assert state["weights"] == {}


def test_fedala_learns_on_digits_and_keeps_w_on_the_clients(small_config):
    config = {**small_config, "algorithm": "fedala", "join_ratio": 0.75, "fedala": FedALA.quick_test_options}
    _, metrics, state = learned_run(config)
    model_bytes = 4 * num_parameters(state.server["params"])
    joined = metrics[(metrics["round"] >= 1) & (metrics["participated"] == 1)]
    assert (joined["bytes_up"] == model_bytes + 8).all() and (joined["bytes_down"] == model_bytes).all()
    trained = [client for client in state.clients if client["weights"]]
    assert trained and all(set(client["weights"]) == {"head.fc.weight", "head.fc.bias"} for client in trained)
    assert any(not torch.equal(w, torch.ones_like(w)) for client in trained for w in client["weights"].values())


@pytest.mark.parametrize("layers", [5])
def test_more_layers_than_the_model_has_is_a_one_line_config_error(small_config, layers):
    from conftest import refusal

    import pfedkit
    message = refusal(pfedkit.run, {**small_config, "algorithm": "fedala", "fedala": {"layers": layers}})
    assert "fedala.layers=5" in message and "3 layers" in message
