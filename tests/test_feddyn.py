"""FedDyn: the local objective's value and gradient by hand; the client's gradient-state update by
hand; from a zero gradient state the client trains exactly as FedProx with mu = alpha; the server's
h (over all m clients) and theta (uniform mean - h / alpha) by hand; theta does not depend on alpha
(why alpha -> 0 is not FedAvg); h stays the mean of all the clients' gradient states over rounds;
by_size scales each client's alpha by mean n / n_k; the traffic is one model each way."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pfedkit.algorithms.feddyn import FedDyn, feddyn_loss
from pfedkit.algorithms.fedprox import FedProx
from pfedkit.core.contract import Forward, Setup
from pfedkit.engine.trainer import FitJob, LocalTrainer, TrainSettings
from tests.conftest import final_state
from tests.test_scaffold import (BATCH_SIZE, EPOCHS, LR, build_model, client_data,  # the same small client
                                 run_metrics, variates)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def train(request) -> dict:
    """The reference trainer's answer to one Fit on client 0's data."""
    trainer, data = LocalTrainer(build_model, TrainSettings(EPOCHS, BATCH_SIZE, LR)), client_data()
    return trainer.fit(FitJob(1, 0, 0, request, None), data.x_train, data.y_train).params


def drive(algorithm: FedDyn, client: dict, message: dict) -> tuple[object, dict, dict, dict]:
    """Client 0's update, its one Fit answered by the reference trainer -> (request, trained, state, reply)."""
    update = algorithm.client_update(1, 0, client, message, client_data())
    request = next(update)
    trained = train(request)
    with pytest.raises(StopIteration) as stop:
        update.send(trained)
    return request, trained, *stop.value.value


def test_local_objective_value_and_gradient_by_hand():
    """L - <g, w> + (alpha/2)||w - anchor||^2: gradient -g + alpha (w - anchor) = [-0.15, -0.9, 1.0]."""
    alpha = 0.3
    w = {"w": torch.tensor([1.0, -2.0, 0.5], requires_grad=True)}
    context = {"anchor": {"w": torch.tensor([0.5, 1.0, 0.5])}, "gradient": {"w": torch.tensor([0.3, 0.0, -1.0])}}
    logits = torch.zeros(1, 2, requires_grad=True)  # CE does not depend on w
    loss = feddyn_loss(Forward(torch.zeros(1, 1), logits), torch.tensor([0]), w, context, alpha=alpha)
    loss.backward()
    torch.testing.assert_close(w["w"].grad, torch.tensor([-0.15, -0.9, 1.0]))
    assert loss.item() == pytest.approx(np.log(2.0) + 0.5 * alpha * 9.25 + 0.2, rel=1e-6)  # -<g, w> = +0.2


def test_client_updates_its_gradient_state_by_the_first_order_condition():
    """g_k <- g_k - alpha (theta_k - theta^{t-1}); the Fit starts at and is anchored to the received
    model with the old g_k; only the trained model goes up (no n_i)."""
    x = dict(build_model().named_parameters())
    gradient = variates(x, 2)
    request, trained, state, reply = drive(FedDyn(FedDyn.Hyper(alpha=0.2), None), {"gradient": gradient},
                                           {"params": x})
    assert request.params is x and request.context["anchor"] is x and request.context["gradient"] is gradient
    assert request.loss.func is feddyn_loss and request.loss.keywords == {"alpha": 0.2}
    assert set(reply) == {"params"} and reply["params"] is trained
    for name in x:
        torch.testing.assert_close(state["gradient"][name], gradient[name] - 0.2 * (trained[name] - x[name]))
        assert not torch.equal(trained[name], x[name])


def test_zero_gradient_state_trains_as_fedprox_with_mu_alpha():
    """A client's first participation (g_k = 0): FedDyn's local problem is FedProx's, mu = alpha,
    and the trained models are the same bit for bit."""
    x = dict(build_model().named_parameters())
    zero = {name: torch.zeros_like(value) for name, value in x.items()}
    _, feddyn, _, _ = drive(FedDyn(FedDyn.Hyper(alpha=0.5), None), {"gradient": zero}, {"params": x})
    fedprox = train(FedProx(FedProx.Hyper(mu=0.5), None).local_fit({"params": x}))
    assert all(torch.equal(feddyn[name], fedprox[name]) for name in x)


def five_clients(sizes=(1, 2, 3, 4, 5)) -> Setup:
    return Setup(5, 1, np.array([[size] for size in sizes]), seed=0, local_epochs=1, ops=None)


def replies() -> dict:
    return {0: {"params": {"w": torch.tensor([3.0, 2.0])}}, 2: {"params": {"w": torch.tensor([0.0, 1.0])}}}


def test_server_h_and_model_by_hand():
    """m = 5, participants 0 and 2 from theta = [1, 2]: drifts [2, 0] and [-1, -1];
    h = [0.1, -0.2] - (0.5 / 5) [1, -1] = [0, -0.1]; theta = uniform mean [1.5, 1.5] - h / 0.5 = [1.5, 1.7]."""
    server = {"params": {"w": torch.tensor([1.0, 2.0])}, "h": {"w": torch.tensor([0.1, -0.2])}}
    new = FedDyn(FedDyn.Hyper(alpha=0.5), five_clients()).aggregate(1, server, replies())
    torch.testing.assert_close(new["h"]["w"], torch.tensor([0.0, -0.1]))
    torch.testing.assert_close(new["params"]["w"], torch.tensor([1.5, 1.7]))


def test_server_model_does_not_depend_on_alpha():
    """h / alpha = -(1/m) sum of the drifts: from h = 0, theta = mean + (1/m) sum drift = [1.7, 1.3]
    for any alpha, so alpha -> 0 does not give FedAvg (module docstring)."""
    server = {"params": {"w": torch.tensor([1.0, 2.0])}, "h": {"w": torch.zeros(2)}}
    for alpha in (1e-4, 0.01, 1.0):
        new = FedDyn(FedDyn.Hyper(alpha=alpha), five_clients()).aggregate(1, server, replies())
        torch.testing.assert_close(new["params"]["w"], torch.tensor([1.7, 1.3]))


def test_by_size_scales_each_clients_alpha_by_the_mean_size_over_its_own():
    """Sizes 1..5, mean 3: client 0's alpha_k = 3 alpha, client 4's 0.6 alpha; equal: alpha."""
    by_size = FedDyn(FedDyn.Hyper(alpha=0.1, client_alpha="by_size"), five_clients())
    assert by_size.client_alpha(0) == pytest.approx(0.3) and by_size.client_alpha(4) == pytest.approx(0.06)
    assert FedDyn(FedDyn.Hyper(alpha=0.1), five_clients()).client_alpha(0) == 0.1
    x = dict(build_model().named_parameters())
    request, trained, state, _ = drive(by_size, {"gradient": variates(x, 2)}, {"params": x})
    assert request.loss.keywords == {"alpha": pytest.approx(0.3)}
    name = next(iter(x))
    torch.testing.assert_close(state["gradient"][name], variates(x, 2)[name] - 0.3 * (trained[name] - x[name]))


@pytest.mark.parametrize("join_ratio", [1.0, 0.5])
def test_h_stays_the_mean_of_all_clients_gradient_states(small_config, join_ratio):
    """h^t = (1/m) sum over ALL m clients of g_k (both start at 0 and move by -alpha drift, h by 1/m
    of it): after 3 rounds, with every client and with half the clients a round."""
    result = run_metrics(small_config, f"h{join_ratio}", algorithm="feddyn", rounds=3, join_ratio=join_ratio,
                 feddyn={"alpha": 0.1})
    state = final_state(result)
    gradients = [state.clients[cid]["gradient"] for cid in range(small_config["num_clients"])]
    for name, h in state.server["h"].items():
        assert h.abs().max() > 0
        torch.testing.assert_close(h, torch.stack([g[name] for g in gradients]).mean(dim=0), rtol=1e-5, atol=1e-7)


def test_one_model_each_way(small_config):
    """Down: the model, as FedAvg. Up: the model without n_i: FedAvg's upload - 8 bytes."""
    feddyn = run_metrics(small_config, "d", algorithm="feddyn", rounds=2).metrics
    fedavg = run_metrics(small_config, "a", rounds=2).metrics
    assert (feddyn["bytes_down"] == fedavg["bytes_down"]).all()
    assert (feddyn["bytes_up"] == fedavg["bytes_up"] - 8 * fedavg["participated"]).all()
