"""GPFL: the conditional valve, the conditional inputs and the four-term loss against hand
computations (the magnitude guidance reads the frozen received embeddings, weight decay only on
CoV and GCE), what travels (body, CoV, GCE; never the head), the prediction through the
personalised route, both readings of the conditional inputs, and the run on digits."""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from conftest import learned_run, num_parameters

from pfedkit.algorithms.gpfl import (COV, GCE, GPFL, conditional_inputs, conditional_valve, gpfl_loss,
                                     initial_valve_and_embeddings)
from pfedkit.core.contract import ClientData, Forward, Setup
from pfedkit.core.params import select

D, C = 4, 3


def valve_params(seed: int = 0) -> dict:
    params = initial_valve_and_embeddings(D, C, torch.Generator().manual_seed(seed))
    generator = torch.Generator().manual_seed(seed + 10)  # non-trivial LayerNorm affine parameters
    return {n: (v + 0.3 * torch.randn(v.shape, generator=generator) if ".norm." in n else v) for n, v in params.items()}


def by_hand_layer_norm(x, weight, bias):
    mean, variance = x.mean(-1, keepdim=True), x.var(-1, unbiased=False, keepdim=True)
    return (x - mean) / torch.sqrt(variance + 1e-5) * weight + bias


def by_hand_valve(p, h, c):
    branch = {b: by_hand_layer_norm(torch.relu(p[f"{COV}.{b}.linear.weight"] @ c + p[f"{COV}.{b}.linear.bias"]),
                                    p[f"{COV}.{b}.norm.weight"], p[f"{COV}.{b}.norm.bias"]) for b in ("gamma", "beta")}
    return torch.relu(h * (1 + branch["gamma"]) + branch["beta"])


def test_the_valve_is_relu_of_h_times_gamma_plus_one_plus_beta():
    p, generator = valve_params(), torch.Generator().manual_seed(1)
    h, c = torch.randn(5, D, generator=generator), torch.randn(D, generator=generator)
    torch.testing.assert_close(conditional_valve(p, h, c), by_hand_valve(p, h, c))


def test_conditional_inputs_are_the_plain_and_the_class_proportion_weighted_means_of_the_embeddings():
    embeddings = torch.tensor([[1.0, 0.0], [0.0, 2.0], [4.0, 4.0]])
    generic, personal = conditional_inputs(embeddings, np.array([1, 0, 3]))
    torch.testing.assert_close(generic, torch.tensor([5 / 3, 2.0]))
    torch.testing.assert_close(personal, torch.tensor([0.25 + 3.0, 3.0]))


def test_the_loss_is_task_ce_plus_angle_ce_plus_lam_magnitude_plus_half_mu_squared_norms():
    lam, mu, y = 0.7, 0.3, torch.tensor([0, 2, 1, 2, 0])
    generator = torch.Generator().manual_seed(2)
    p = {**valve_params(), "head.fc.weight": torch.randn(C, D, generator=generator), "head.fc.bias": torch.randn(C, generator=generator)}
    p = {n: v.clone().requires_grad_(True) for n, v in p.items()}
    h = torch.randn(5, D, generator=generator)
    frozen = torch.randn(C, D, generator=generator)  # the received embeddings, not the live ones
    generic, personal = torch.randn(D, generator=generator), torch.randn(D, generator=generator)
    loss = gpfl_loss(Forward(h, torch.zeros(5, C)), y, p, {"generic": generic, "personal": personal, "frozen": frozen},
                     lam=lam, mu=mu)

    live = {n: v.detach() for n, v in p.items()}
    f_p, f_g = by_hand_valve(live, h, personal), by_hand_valve(live, h, generic)
    task = F.cross_entropy(f_p @ live["head.fc.weight"].T + live["head.fc.bias"], y)
    cosine = torch.stack([torch.stack([torch.dot(f, e) / (f.norm() * e.norm()) for e in live[GCE]]) for f in f_g])
    angle = F.cross_entropy(cosine, y)
    magnitude = torch.sqrt(((f_g - frozen[y]) ** 2).sum())
    squares = sum((v ** 2).sum() for n, v in live.items() if n.startswith((COV, GCE)))
    torch.testing.assert_close(loss, task + angle + lam * magnitude + 0.5 * mu * squares)
    loss.backward()  # the head is not decayed: its gradient is the task term's alone
    head_only = torch.autograd.grad(F.cross_entropy(f_p @ p["head.fc.weight"].T + p["head.fc.bias"], y),
                                    p["head.fc.weight"])[0]
    torch.testing.assert_close(p["head.fc.weight"].grad, head_only)


def algorithm(mode: str = "received") -> GPFL:
    counts = np.array([[3, 0, 1], [1, 1, 1]])
    return GPFL(GPFL.Hyper(conditional_inputs=mode), Setup(2, C, counts, seed=0, local_epochs=1, ops=None))


def shared_and_head(seed: int = 3) -> tuple[dict, dict]:
    generator = torch.Generator().manual_seed(seed)
    shared = {"body.fc1.weight": torch.randn(D, 2, generator=generator), **valve_params(seed)}
    return shared, {"head.fc.weight": torch.randn(C, D, generator=generator), "head.fc.bias": torch.randn(C, generator=generator)}


def test_body_valve_and_embeddings_travel_the_head_stays_and_the_prediction_takes_the_personal_route():
    algo, (shared, head) = algorithm(), shared_and_head()
    data = ClientData(0, torch.zeros(4, 2), torch.tensor([0, 0, 0, 2]), torch.zeros(1, 2), torch.zeros(1), np.array([3, 0, 1]))
    update = algo.client_update(1, 0, {"head": head}, {"params": shared}, data)
    request = next(update)
    assert set(request.extra) == {n for n in shared if not n.startswith("body.")}
    assert set(select(request.params, "head")) == set(head) and set(select(request.params, "body")) == {"body.fc1.weight"}
    generic, personal = conditional_inputs(shared[GCE], np.array([3, 0, 1]))
    torch.testing.assert_close(request.context["personal"], personal)
    torch.testing.assert_close(request.context["generic"], generic)
    assert request.context["frozen"] is shared[GCE]
    trained = {n: v + 1 for n, v in {**request.params, **request.extra}.items()}
    try:
        update.send(trained)
    except StopIteration as stop:
        state, reply = stop.value
    assert set(reply["params"]) == set(shared) and reply["weight"] == 4
    assert torch.equal(state["head"]["head.fc.bias"], head["head.fc.bias"] + 1)

    features = torch.randn(6, D, generator=torch.Generator().manual_seed(4))
    expected = by_hand_valve(shared, features, personal) @ head["head.fc.weight"].T + head["head.fc.bias"]
    torch.testing.assert_close(algo.predict(0, {"shared": shared}, {"head": head}, features), expected)


def test_trained_inputs_start_at_zero_and_then_come_from_the_clients_own_trained_embeddings():
    algo, (shared, head) = algorithm("trained"), shared_and_head()
    client = {"head": head, "inputs": {"generic": torch.zeros(D), "personal": torch.zeros(D)}}
    data = ClientData(1, torch.zeros(3, 2), torch.tensor([0, 1, 2]), torch.zeros(1, 2), torch.zeros(1), np.array([1, 1, 1]))
    update = algo.client_update(1, 1, client, {"params": shared}, data)
    request = next(update)
    assert request.context["personal"].eq(0).all() and request.context["generic"].eq(0).all()
    trained = {n: v * 2 for n, v in {**request.params, **request.extra}.items()}
    try:
        update.send(trained)
    except StopIteration as stop:
        state, _ = stop.value
    torch.testing.assert_close(state["inputs"]["personal"], trained[GCE].mean(0))  # equal class counts
    features = torch.randn(2, D)
    torch.testing.assert_close(algo.predict(1, {"shared": shared}, state, features),
                               by_hand_valve(shared, features, state["inputs"]["personal"])
                               @ state["head"]["head.fc.weight"].T + state["head"]["head.fc.bias"])


def test_gpfl_learns_on_digits_and_keeps_its_head(small_config):
    _, metrics, state = learned_run({**small_config, "algorithm": "gpfl", "join_ratio": 0.75})
    shared_bytes = 4 * num_parameters(state.server["shared"])
    joined = metrics[(metrics["round"] >= 1) & (metrics["participated"] == 1)]
    assert (joined["bytes_up"] == shared_bytes + 8).all() and (joined["bytes_down"] == shared_bytes).all()
    assert not any(name.startswith("head.") for name in state.server["shared"])
    assert all(set(client) == {"head"} for client in state.clients)
