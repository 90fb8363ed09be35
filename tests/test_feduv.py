"""FedUV: L_var and L_unif against hand computations and their limit cases, mu = lam = 0 is FedAvg,
and a short digits run."""
from __future__ import annotations

import math

import pandas as pd
import pytest
import torch
import torch.nn.functional as F

import pfedkit
from pfedkit.algorithms.feduv import feduv_loss, pairwise_squared_distances, uniformity_loss, variance_loss
from pfedkit.core.contract import Forward
from tests.conftest import final_state, num_parameters

COLUMNS = ["round", "client", "accuracy", "loss", "bytes_up", "bytes_down"]
CONFIG = {"dataset": "digits", "num_clients": 4, "rounds": 3, "threads": 1, "batch_size": 20, "lr": 0.05,
          "seed": 3, "partition": {"scheme": "dirichlet", "alpha": 0.5}}


def unbiased_std(values: list[float]) -> float:
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def test_variance_loss_matches_a_hand_computation():
    logits = [[2.0, 0.0, -1.0], [0.5, 0.5, 0.0], [-1.0, 3.0, 0.0], [0.0, 0.0, 0.0]]
    probs = [[math.exp(v) / sum(math.exp(u) for u in row) for v in row] for row in logits]
    gamma = 1 / math.sqrt(3)
    by_hand = sum(max(0.0, gamma - unbiased_std([row[c] for row in probs])) for c in range(3)) / 3
    assert variance_loss(torch.tensor(logits, dtype=torch.float64)).item() == pytest.approx(by_hand, rel=1e-12)


def test_variance_loss_is_gamma_when_every_prediction_is_the_same():
    for classes in (2, 5, 10):
        logits = torch.randn(1, classes, generator=torch.Generator().manual_seed(classes)).repeat(6, 1)
        assert variance_loss(logits).item() == pytest.approx(1 / math.sqrt(classes), rel=1e-6)


def test_variance_loss_is_zero_with_no_gradient_when_every_column_std_reaches_gamma():
    # one-hot predictions, each class once (B = C): every column's unbiased std is exactly 1/sqrt(C)
    for classes in (2, 4):
        logits = (1000.0 * torch.eye(classes, dtype=torch.float64)[torch.randperm(classes)]).requires_grad_(True)
        assert (F.softmax(logits, 1).std(0) >= 1 / math.sqrt(classes)).all()
        loss = variance_loss(logits)
        assert loss.item() == 0.0
        (grad,) = torch.autograd.grad(loss, logits)
        assert grad.abs().max() == 0.0
    # B = 2, C = 2 with confident opposite predictions: std 1/sqrt 2 (= gamma) up to rounding
    assert variance_loss(torch.tensor([[30.0, -30.0], [-30.0, 30.0]], dtype=torch.float64)).item() < 1e-12


def test_uniformity_loss_matches_a_hand_computation_and_skips_zero_distances_in_the_median():
    h = torch.tensor([[0.0, 0.0], [0.0, 0.0], [1.0, 0.0], [0.0, 2.0]])
    # pairs (0,1) 0, (0,2) 1, (0,3) 4, (1,2) 1, (1,3) 4, (2,3) 5 -> non-zero median 4; mean over all 6 pairs
    torch.testing.assert_close(pairwise_squared_distances(h), torch.tensor([0.0, 1.0, 4.0, 1.0, 4.0, 5.0]))
    by_hand = (1 + 2 * math.exp(-1 / 4) + 2 * math.exp(-1) + math.exp(-5 / 4)) / 6
    assert uniformity_loss(h).item() == pytest.approx(by_hand, rel=1e-6)


def test_uniformity_loss_takes_the_lower_middle_value_for_an_even_count():
    h = torch.tensor([[0.0], [1.0], [3.0]])  # 1, 9, 4 -> median 4
    assert uniformity_loss(h).item() == pytest.approx((math.exp(-1 / 4) + math.exp(-9 / 4) + 1 / math.e) / 3)
    h = torch.tensor([[0.0], [1.0], [3.0], [7.0]])  # 1, 9, 49, 4, 36, 16 -> 1 4 9 16 36 49: lower middle 9
    distances = [1, 9, 49, 4, 36, 16]
    assert uniformity_loss(h).item() == pytest.approx(sum(math.exp(-d / 9) for d in distances) / 6, rel=1e-6)


def test_uniformity_loss_limits():
    assert uniformity_loss(torch.ones(5, 3)).item() == 1.0  # every pair coincides: every term e^0
    far = torch.tensor([[0.0, 0.0], [100.0, 0.0], [0.0, 100.0]])  # scale-free: sigma_u follows the spread
    assert uniformity_loss(far).item() == pytest.approx(uniformity_loss(far / 100).item(), rel=1e-6)


def test_single_sample_batch_has_no_regulariser():
    out = Forward(torch.randn(1, 4), torch.randn(1, 3), torch.tensor([0]))
    y = torch.tensor([2])
    assert variance_loss(out.logits).item() == 0.0 and uniformity_loss(out.features).item() == 0.0
    assert feduv_loss(out, y, {}, {}, mu=2.5, lam=0.5).item() == pytest.approx(F.cross_entropy(out.logits, y).item())


def test_feduv_loss_weights_the_two_regularisers():
    generator = torch.Generator().manual_seed(4)
    out = Forward(torch.randn(6, 5, generator=generator), torch.randn(6, 3, generator=generator))
    y = torch.tensor([0, 1, 2, 0, 1, 2])
    ce = F.cross_entropy(out.logits, y)
    expected = ce + 2.5 * variance_loss(out.logits) + 0.5 * uniformity_loss(out.features)
    assert feduv_loss(out, y, {}, {}, mu=2.5, lam=0.5).item() == pytest.approx(expected.item(), rel=1e-6)
    assert feduv_loss(out, y, {}, {}, mu=0.0, lam=0.0).item() == ce.item()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs")
    configs = {"feduv": {"algorithm": "feduv"}, "fedavg": {"algorithm": "fedavg"},
               "zero": {"algorithm": "feduv", "feduv": {"mu": 0.0, "lam": 0.0}}}
    return {name: pfedkit.run({**CONFIG, **extra, "out_dir": str(out / name)}) for name, extra in configs.items()}


def test_mu_and_lam_zero_give_fedavg_metrics_exactly(runs):
    pd.testing.assert_frame_equal(runs["zero"].metrics[COLUMNS], runs["fedavg"].metrics[COLUMNS])


def test_digits_run_learns_and_sends_one_model_each_way(runs):
    metrics = runs["feduv"].metrics
    metrics = metrics[metrics["round"] >= 1]
    assert metrics.groupby("round")["accuracy"].mean().iloc[-1] > 0.3  # 10 classes: chance is 0.1
    model_bytes = 4 * num_parameters(final_state(runs["feduv"]).server["params"])
    assert (metrics["bytes_down"] == model_bytes).all() and (metrics["bytes_up"] == model_bytes + 8).all()
    assert not metrics["loss"].equals(runs["fedavg"].metrics.loc[runs["fedavg"].metrics["round"] >= 1, "loss"])
