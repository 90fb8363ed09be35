"""FedLC: the margins tau * n_c^{-1/4} and the calibrated loss against hand computations, a missing
class out of the softmax, equal class counts (and tau = 0) giving plain cross-entropy, hence FedAvg,
the Fit built from the client's own counts, and the refusal of the printed denominator for a
one-class client."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import switched_off_is_fedavg

from pfedkit.algorithms.fedlc import FedLC, calibrated_loss, class_margins
from pfedkit.core.contract import ClientData, Forward, Setup
from pfedkit.core.errors import ConfigError

CONFIG = {"dataset": "digits", "num_clients": 4, "rounds": 3, "threads": 1, "batch_size": 20, "lr": 0.05,
          "seed": 3, "partition": {"scheme": "dirichlet", "alpha": 0.5}}


def loss_of(logits, y, margins, denominator="all"):
    return calibrated_loss(Forward(None, logits), y, {}, {"margins": margins}, denominator=denominator)


def test_margins_are_tau_times_count_to_the_minus_quarter_relative_to_the_most_frequent_class():
    # tau n^{-1/4} for n = 16, 1, 81: 2 * (1/2, 1, 1/3); minus the smallest (2/3); n = 0: +inf
    margins = class_margins(np.array([16, 1, 0, 81]), tau=2.0)
    torch.testing.assert_close(margins[[0, 1, 3]], torch.tensor([1 / 3, 4 / 3, 0.0]))
    assert margins[2] == math.inf and margins.dtype == torch.float32


def test_calibrated_loss_matches_a_hand_computation():
    counts, tau = np.array([16, 1, 81]), 1.0
    margins = [0.5 - 1 / 3, 1.0 - 1 / 3, 0.0]  # tau n^{-1/4} minus its smallest value
    logits = [[2.0, 0.5, -1.0], [0.0, 1.0, 3.0]]
    y = [1, 0]
    calibrated = [[z - m for z, m in zip(row, margins)] for row in logits]
    every = [-math.log(math.exp(row[t]) / sum(math.exp(v) for v in row)) for row, t in zip(calibrated, y)]
    not_true = [-math.log(math.exp(row[t]) / sum(math.exp(v) for c, v in enumerate(row) if c != t))
                for row, t in zip(calibrated, y)]
    z, labels = torch.tensor(logits, dtype=torch.float64), torch.tensor(y)
    m = class_margins(counts, tau).double()
    assert loss_of(z, labels, m).item() == pytest.approx(sum(every) / 2, rel=1e-6)
    assert loss_of(z, labels, m, "not_true").item() == pytest.approx(sum(not_true) / 2, rel=1e-6)
    # the rare class 1 is pushed further: its calibrated loss exceeds plain cross-entropy on it
    assert loss_of(z[:1], labels[:1], m).item() > F.cross_entropy(z[:1], labels[:1]).item()


def test_a_class_the_client_does_not_hold_leaves_the_softmax():
    margins = class_margins(np.array([5, 0, 7]), tau=1.0)
    logits = torch.tensor([[1.0, 2.0, -0.5], [0.3, -1.0, 2.0]], requires_grad=True)
    y = torch.tensor([0, 2])
    loss = loss_of(logits, y, margins)
    (grad,) = torch.autograd.grad(loss, logits)
    assert grad[:, 1].abs().max() == 0.0  # no push on the missing class's logit
    moved = logits.detach().clone()
    moved[:, 1] += 50.0
    assert loss_of(moved, y, margins).item() == loss.item()
    kept = logits.detach()[:, [0, 2]]
    two_class = class_margins(np.array([5, 7]), tau=1.0)
    assert loss.item() == pytest.approx(loss_of(kept, torch.tensor([0, 1]), two_class).item(), rel=1e-6)


def test_equal_class_counts_and_tau_zero_give_plain_cross_entropy_bit_for_bit():
    logits = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
    y = torch.tensor([0, 1, 2, 3, 1, 2])
    for margins in (class_margins(np.array([7, 7, 7, 7]), tau=3.0), class_margins(np.array([9, 1, 0, 4]), tau=0.0)):
        assert torch.equal(margins, torch.zeros(4))
        assert torch.equal(loss_of(logits, y, margins), F.cross_entropy(logits, y))
    # unequal counts change the loss
    assert loss_of(logits, y, class_margins(np.array([9, 1, 3, 4]), tau=1.0)) != F.cross_entropy(logits, y)


def first_fit(counts: str):
    """Client 1's Fit and reply under `fedlc.counts=counts` (client 0 holds [1, 1, 1])."""
    own = np.array([3, 0, 12])
    setup = Setup(2, 3, np.array([[1, 1, 1], own]), seed=0, local_epochs=1, ops=None)
    algo = FedLC(FedLC.Hyper(tau=0.5, counts=counts), setup)
    data = ClientData(1, torch.zeros(15, 2), torch.zeros(15), torch.zeros(1, 2), torch.zeros(1), own)
    received = {"w": torch.ones(2)}
    update = algo.client_update(1, 1, None, {"params": received}, data)
    fit = next(update)
    assert fit.params is received and fit.loss.keywords == {"denominator": "all"}
    with pytest.raises(StopIteration) as stop:
        update.send({"w": torch.zeros(2)})
    return fit, stop.value.value[1]


def test_the_fit_carries_the_clients_own_margins_and_the_reply_its_sample_count():
    fit, reply = first_fit("client")
    torch.testing.assert_close(fit.context["margins"], class_margins(np.array([3, 0, 12]), 0.5))
    assert reply["weight"] == 15
    fit, _ = first_fit("global")  # PFLlib's reading: the federation's counts [4, 1, 13]
    torch.testing.assert_close(fit.context["margins"], class_margins(np.array([4, 1, 13]), 0.5))


def test_the_printed_denominator_is_refused_for_a_client_holding_one_class():
    counts = np.array([[4, 5, 0], [0, 6, 0]])
    setup = Setup(2, 3, counts, seed=0, local_epochs=1, ops=None)
    with pytest.raises(ConfigError, match="client 1 holds one class"):
        FedLC(FedLC.Hyper(denominator="not_true"), setup).check()
    FedLC(FedLC.Hyper(denominator="all"), setup).check()
    FedLC(FedLC.Hyper(denominator="not_true"), Setup(1, 3, counts[:1], seed=0, local_epochs=1, ops=None)).check()


def test_tau_zero_gives_fedavg_metrics_exactly_and_the_default_learns(tmp_path):
    fedavg, fedlc = switched_off_is_fedavg(CONFIG, "fedlc", {"tau": 0.0}, tmp_path)
    assert not fedlc.metrics["accuracy"].equals(fedavg.metrics["accuracy"])
