"""FedRS: the class scales (presence and proportional) and the restricted-softmax loss and its
gradient against hand computations, a client holding every class unaffected, alpha = 1 is FedAvg,
and the Fit built from the client's own counts."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import switched_off_is_fedavg

from pfedkit.algorithms.fedrs import FedRS, class_scales, restricted_softmax_loss
from pfedkit.core.contract import ClientData, Forward, Setup

CONFIG = {"dataset": "digits", "num_clients": 4, "rounds": 3, "threads": 1, "batch_size": 20, "lr": 0.05,
          "seed": 3, "partition": {"scheme": "dirichlet", "alpha": 0.5}}


def loss_of(logits, y, scales):
    return restricted_softmax_loss(Forward(None, logits), y, {}, {"scales": scales})


def test_scales_by_hand():
    counts = np.array([3, 0, 5])
    torch.testing.assert_close(class_scales(counts, 0.3, "presence"), torch.tensor([1.0, 0.3, 1.0]))
    # alpha + (1 - alpha) n / max n: 0.3 + 0.7 * 3/5, 0.3, 1
    torch.testing.assert_close(class_scales(counts, 0.3, "proportional"), torch.tensor([0.72, 0.3, 1.0]))


def test_restricted_softmax_loss_and_its_gradient_match_a_hand_computation():
    alpha = 0.25
    scales = class_scales(np.array([4, 0, 2]), alpha, "presence")  # class 1 missing
    z = [1.0, 3.0, -2.0]
    o = [z[0], alpha * z[1], z[2]]
    p = [math.exp(v) / sum(math.exp(u) for u in o) for v in o]
    logits = torch.tensor([z], dtype=torch.float64, requires_grad=True)
    loss = loss_of(logits, torch.tensor([0]), scales.double())
    assert loss.item() == pytest.approx(-math.log(p[0]), rel=1e-12)
    (grad,) = torch.autograd.grad(loss, logits)
    # d/dz_c = s_c (p_c - [c = y]): the missing class's push is scaled by alpha
    expected = [p[0] - 1.0, alpha * p[1], p[2]]
    torch.testing.assert_close(grad[0], torch.tensor(expected, dtype=torch.float64))
    assert loss.item() < F.cross_entropy(logits.detach(), torch.tensor([0])).item()  # the missing class is muted


def test_a_client_holding_every_class_trains_on_plain_cross_entropy():
    logits = torch.randn(5, 4, generator=torch.Generator().manual_seed(0))
    y = torch.tensor([0, 1, 2, 3, 0])
    everything = class_scales(np.array([2, 9, 1, 4]), 0.1, "presence")
    assert torch.equal(loss_of(logits, y, everything), F.cross_entropy(logits, y))
    assert torch.equal(loss_of(logits, y, class_scales(np.array([2, 0, 1, 4]), 1.0, "presence")),
                       F.cross_entropy(logits, y))  # alpha = 1: nothing restricted
    assert loss_of(logits, y, class_scales(np.array([2, 0, 1, 4]), 0.1, "presence")) != F.cross_entropy(logits, y)


def test_the_fit_carries_the_clients_own_scales_and_the_reply_its_sample_count():
    counts = np.array([0, 6, 2])
    algo = FedRS(FedRS.Hyper(alpha=0.2, scaling="proportional"),
                 Setup(2, 3, np.array([[5, 5, 5], counts]), seed=0, local_epochs=1, ops=None))
    data = ClientData(1, torch.zeros(8, 2), torch.zeros(8), torch.zeros(1, 2), torch.zeros(1), counts)
    received = {"w": torch.ones(2)}
    update = algo.client_update(1, 1, None, {"params": received}, data)
    fit = next(update)
    assert fit.params is received and fit.loss is restricted_softmax_loss
    torch.testing.assert_close(fit.context["scales"], torch.tensor([0.2, 1.0, 0.2 + 0.8 / 3]))
    with pytest.raises(StopIteration) as stop:
        update.send({"w": torch.zeros(2)})
    assert stop.value.value[1]["weight"] == 8


def test_alpha_one_gives_fedavg_metrics_exactly_and_the_default_learns(tmp_path):
    fedavg, fedrs = switched_off_is_fedavg(CONFIG, "fedrs", {"alpha": 1.0}, tmp_path)
    assert not fedrs.metrics["accuracy"].equals(fedavg.metrics["accuracy"])
