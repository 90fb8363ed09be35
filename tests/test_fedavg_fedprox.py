"""FedAvg's n_i weighting and FedProx's proximal pull, checked against hand-computed values: a
uniform average, a flipped sign or an anchor of zeros (plain weight decay) each fails a test here."""
from __future__ import annotations

import numpy as np
import torch

from pfedkit.algorithms.fedavg import FedAvg
from pfedkit.algorithms.fedprox import FedProx, proximal_loss
from pfedkit.core.aggregation import fedavg_aggregate
from pfedkit.core.contract import ClientData, Forward, HyperParams, Setup


def test_fedavg_weights_each_reply_by_its_sample_count():
    replies = {0: {"params": {"w": torch.tensor([1.0, 0.0])}, "weight": 1},
               1: {"params": {"w": torch.tensor([4.0, 8.0])}, "weight": 3}}
    torch.testing.assert_close(fedavg_aggregate(replies)["w"], torch.tensor([3.25, 6.0]))  # uniform: 2.5, 4


def test_fedavg_reply_weight_is_the_clients_training_set_size():
    algo = FedAvg(HyperParams(), Setup(1, 2, np.ones((1, 2)), seed=0, local_epochs=1, ops=None))
    data = ClientData(0, torch.zeros(7, 3), torch.zeros(7), torch.zeros(2, 3), torch.zeros(2), np.array([4, 3]))
    update = algo.client_update(1, 0, None, {"params": {"w": torch.ones(2)}}, data)
    next(update)
    try:
        update.send({"w": torch.zeros(2)})
    except StopIteration as stop:
        _, reply = stop.value
    assert reply["weight"] == 7


def test_proximal_term_gradient_pulls_toward_the_anchor():
    mu = 0.3
    w = {"w": torch.tensor([1.0, -2.0, 0.5], requires_grad=True)}
    anchor = {"w": torch.tensor([0.5, 1.0, 0.5])}
    logits = torch.zeros(1, 2, requires_grad=True)  # CE does not depend on w: only the proximal term does
    loss = proximal_loss(Forward(torch.zeros(1, 1), logits), torch.tensor([0]), w, {"anchor": anchor}, mu=mu)
    loss.backward()
    torch.testing.assert_close(w["w"].grad, mu * (w["w"].detach() - anchor["w"]))  # [0.15, -0.9, 0]
    expected = torch.log(torch.tensor(2.0)) + 0.5 * mu * (0.25 + 9.0)
    torch.testing.assert_close(loss, expected)


def test_fedprox_anchor_is_the_received_global_model():
    received = {"w": torch.tensor([2.0, 3.0])}
    fit = FedProx(FedProx.Hyper(mu=0.1), None).local_fit({"params": received})
    assert fit.context["anchor"] is received and fit.params is received
    assert fit.loss.keywords == {"mu": 0.1}
