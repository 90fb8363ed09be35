"""CReFF: the matching distance, the client's class gradients, the server's feature matching and
classifier re-training against hand computations; local training from phi (not phi_re);
retrain=False is FedAvg; the messages' sizes and a short digits run."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from conftest import final_state, num_parameters
from torch import nn

import pfedkit
from pfedkit.core.contract import ClientData, Setup, message_bytes
from pfedkit.algorithms.creff import (CReFF, class_gradients, fresh_linear, linear_ce_gradients, match_features,
                                      matching_distance, mean_class_gradients, retrain_classifier,
                                      row_cosine_distance)
from pfedkit.core.errors import ConfigError
from pfedkit.core.model_ops import ModelOps
from pfedkit.core.params import select
from pfedkit.core.seeds import torch_generator
from pfedkit.models.base import BodyHeadModel
from pfedkit.report.methods import draw_diagnostics
from pfedkit.run_files import read_diagnostics

# short digits runs (the defaults need ~10x more server time per round)
FAST = {"retrain_epochs": 30, "retrain_lr": 0.1, "feature_steps": 50, "feature_lr": 1.0, "grad_repeats": 2}


def tiny_model() -> BodyHeadModel:
    return BodyHeadModel([("fc1", nn.Linear(3, 5)), ("relu", nn.ReLU()), ("fc", nn.Linear(5, 4))], "fc")


def tiny_algorithm(**hyper) -> CReFF:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        ops = ModelOps(tiny_model)
    return CReFF(CReFF.Hyper(**hyper), Setup(2, 4, np.ones((2, 4)), seed=5, local_epochs=1, ops=ops))


def autograd_head_gradient(features, labels, weight, bias):
    """grad of F.cross_entropy(nn.Linear(features)) by autograd (the reference)."""
    layer = nn.Linear(weight.shape[1], weight.shape[0])
    with torch.no_grad():
        layer.weight.copy_(weight)
        layer.bias.copy_(bias)
    F.cross_entropy(layer(features), labels).backward()
    return layer.weight.grad, layer.bias.grad


# --- the matching distance ---------------------------------------------------------------------

def test_matching_distance_is_zero_for_equal_gradients_and_scale_invariant():
    g = torch.Generator().manual_seed(0)
    real = (torch.randn(4, 6, generator=g), torch.randn(4, generator=g))
    other = (torch.randn(4, 6, generator=g), torch.randn(4, generator=g))
    assert float(matching_distance(real, real)) == pytest.approx(0.0, abs=1e-6)
    base = float(matching_distance(other, real))
    assert base > 0.5
    for scale in (1e-3, 0.5, 7.0, 1e3):
        assert float(matching_distance((scale * other[0], scale * other[1]), real)) == pytest.approx(base, rel=1e-5)
        assert float(matching_distance(other, (scale * real[0], scale * real[1]))) == pytest.approx(base, rel=1e-5)
    # row-wise: each output row (and the bias) may be scaled on its own
    rows = torch.tensor([0.1, 3.0, 20.0, 0.7])[:, None]
    assert float(matching_distance((rows * other[0], 4 * other[1]), real)) == pytest.approx(base, rel=1e-5)


def test_matching_distance_is_a_sum_of_one_minus_cosine_over_rows_with_the_bias_as_one_row():
    weight_a = torch.tensor([[1.0, 0.0], [0.0, 2.0], [3.0, 3.0]])
    weight_b = torch.tensor([[0.0, 5.0], [0.0, -1.0], [1.0, 1.0]])  # cos: 0, -1, 1
    bias_a, bias_b = torch.tensor([1.0, 0.0, 0.0]), torch.tensor([1.0, 1.0, 0.0])  # cos 1/sqrt(2)
    expected = (1 - 0) + (1 + 1) + (1 - 1) + (1 - 1 / np.sqrt(2))
    assert float(matching_distance((weight_a, bias_a), (weight_b, bias_b))) == pytest.approx(expected, rel=1e-6)
    assert float(matching_distance((weight_a, bias_a), (weight_b, bias_b), match_bias=False)) == pytest.approx(3.0)
    # a flat 1-d tensor is ONE row, not one row per entry
    assert float(row_cosine_distance(bias_a, -bias_a)) == pytest.approx(2.0)


# --- the client's classifier gradients ---------------------------------------------------------

def test_linear_ce_gradients_match_autograd_also_batched():
    g = torch.Generator().manual_seed(1)
    features, labels = torch.randn(7, 5, generator=g), torch.tensor([0, 3, 3, 1, 2, 0, 3])
    weight, bias = torch.randn(4, 5, generator=g), torch.randn(4, generator=g)
    grad_w, grad_b = linear_ce_gradients(features, labels, weight, bias)
    ref_w, ref_b = autograd_head_gradient(features, labels, weight, bias)
    torch.testing.assert_close(grad_w, ref_w)
    torch.testing.assert_close(grad_b, ref_b)
    stacked = torch.randn(3, 6, 5, generator=g)
    per_class = torch.arange(3)[:, None].expand(3, 6)
    batch_w, batch_b = linear_ce_gradients(stacked, per_class, weight, bias)
    for c in range(3):
        ref_w, ref_b = autograd_head_gradient(stacked[c], per_class[c], weight, bias)
        torch.testing.assert_close(batch_w[c], ref_w)
        torch.testing.assert_close(batch_b[c], ref_b)


def test_class_gradients_average_the_seeded_draws_of_each_owned_class():
    g = torch.Generator().manual_seed(2)
    features, labels = torch.randn(20, 5, generator=g), torch.tensor([0] * 9 + [2] * 11)
    weight, bias = torch.randn(4, 5, generator=g), torch.randn(4, generator=g)
    grads = class_gradients(features, labels, weight, bias, batch_size=4, repeats=3,
                            generator=torch.Generator().manual_seed(7))
    assert sorted(grads) == [0, 2]  # only the classes the client owns
    draws = torch.Generator().manual_seed(7)  # the same draws by hand: repeat by repeat, classes ascending
    members = {0: torch.arange(9), 2: torch.arange(9, 20)}
    sums = {c: [torch.zeros(4, 5), torch.zeros(4)] for c in (0, 2)}
    for _ in range(3):
        for c in (0, 2):
            pick = members[c][torch.randperm(len(members[c]), generator=draws)[:4]]
            ref_w, ref_b = autograd_head_gradient(features[pick], labels[pick], weight, bias)
            sums[c][0] += ref_w / 3
            sums[c][1] += ref_b / 3
    for c in (0, 2):
        torch.testing.assert_close(grads[c][0], sums[c][0])
        torch.testing.assert_close(grads[c][1], sums[c][1])
    # a batch at least the class size takes the whole class every time: the full-class gradient
    whole = class_gradients(features, labels, weight, bias, batch_size=50, repeats=4, generator=draws)
    torch.testing.assert_close(whole[2][0], autograd_head_gradient(features[9:], labels[9:], weight, bias)[0])


def test_client_trains_from_phi_and_uploads_gradients_at_phi_re_on_its_body_features():
    algo = tiny_algorithm(grad_batch_size=100, grad_repeats=2)
    params = algo.setup.ops.initial_params()
    head_re = {name: value * -3.0 + 0.2 for name, value in select(params, "head").items()}
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(10, 3, generator=g), torch.tensor([0, 0, 1, 1, 1, 3, 3, 3, 3, 0])
    data = ClientData(1, x, y, x[:2], y[:2], np.bincount(y.numpy(), minlength=4))
    update = algo.client_update(2, 1, None, {"params": params, "head_re": head_re}, data)
    request = next(update)
    assert request.params is params  # the FedAvg model (theta, phi), never phi_re
    trained = {name: value + 1.0 for name, value in params.items()}
    with pytest.raises(StopIteration) as stop:
        update.send(trained)
    _, reply = stop.value.value
    assert reply["params"] is trained and reply["weight"] == 10
    assert sorted(reply["grads"]) == [0, 1, 3]
    hidden = torch.relu(x @ params["body.fc1.weight"].T + params["body.fc1.bias"])  # theta^t's body
    for c in (0, 1, 3):
        ref_w, ref_b = autograd_head_gradient(hidden[y == c], y[y == c], head_re["head.fc.weight"],
                                              head_re["head.fc.bias"])
        torch.testing.assert_close(reply["grads"][c]["head.fc.weight"], ref_w)
        torch.testing.assert_close(reply["grads"][c]["head.fc.bias"], ref_b)
    # bytes up: the model, |phi| per owned class, n_i
    head_size = 4 * num_parameters(select(params, "head"))
    assert message_bytes(reply) == 4 * num_parameters(params) + 3 * head_size + 8


def test_server_gradient_target_is_the_plain_mean_over_owners():
    replies = {5: {"grads": {1: {"w": torch.ones(2, 2), "b": torch.ones(2)}}, "weight": 100},
               2: {"grads": {1: {"w": 3 * torch.ones(2, 2), "b": torch.zeros(2)},
                             0: {"w": torch.eye(2), "b": torch.ones(2)}}, "weight": 1}}
    targets = mean_class_gradients(replies, "w", "b")
    torch.testing.assert_close(targets[1][0], 2 * torch.ones(2, 2))  # not n_i-weighted
    torch.testing.assert_close(targets[1][1], 0.5 * torch.ones(2))
    torch.testing.assert_close(targets[0][0], torch.eye(2))


# --- the server: feature matching and re-training ----------------------------------------------

def test_feature_matching_lowers_the_distance_and_leaves_unmatched_classes_alone():
    g = torch.Generator().manual_seed(4)
    weight, bias = torch.randn(4, 6, generator=g), torch.randn(4, generator=g)
    real = {c: linear_ce_gradients(torch.relu(torch.randn(32, 6, generator=g) + c), torch.full((32,), c), weight, bias)
            for c in (0, 2)}
    start = torch.randn(4, 10, 6, generator=g)
    features, losses = match_features(start, real, weight, bias, steps=30, lr=0.1)
    assert len(losses) == 31 and losses[-1] < 0.7 * losses[0]
    assert torch.equal(features[1], start[1]) and torch.equal(features[3], start[3])
    assert not torch.equal(features[0], start[0])
    # the recorded losses are the objective itself at the start and at the end
    by_hand = sum(float(matching_distance(linear_ce_gradients(f, torch.full((10,), c), weight, bias), real[c]))
                  for c, f in ((0, features[0]), (2, features[2])))
    assert losses[-1] == pytest.approx(by_hand, rel=1e-5)
    # one step is plain SGD on that objective
    one, _ = match_features(start, real, weight, bias, steps=1, lr=0.1)
    live = start[[0, 2]].clone().requires_grad_(True)
    objective = sum(matching_distance(linear_ce_gradients(live[k], torch.full((10,), c), weight, bias), real[c])
                    for k, c in enumerate((0, 2)))
    (grad,) = torch.autograd.grad(objective, [live])
    torch.testing.assert_close(one[[0, 2]], start[[0, 2]] - 0.1 * grad)


def test_retraining_is_plain_sgd_on_a_linear_layer():
    g = torch.Generator().manual_seed(5)
    features, labels = torch.randn(70, 6, generator=g), torch.arange(7).repeat_interleave(10) % 4
    weight, bias = fresh_linear(6, 4, torch.Generator().manual_seed(1))
    new_w, new_b = retrain_classifier(features, labels, weight, bias, epochs=3, lr=0.2, batch_size=32,
                                      generator=torch.Generator().manual_seed(9))
    layer = nn.Linear(6, 4)  # reference: nn.Linear + torch.optim.SGD over the same permutations
    with torch.no_grad():
        layer.weight.copy_(weight)
        layer.bias.copy_(bias)
    optimizer, order = torch.optim.SGD(layer.parameters(), lr=0.2), torch.Generator().manual_seed(9)
    for _ in range(3):
        for batch in torch.randperm(70, generator=order).split(32):  # 32, 32, 6
            optimizer.zero_grad()
            F.cross_entropy(layer(features[batch]), labels[batch]).backward()
            optimizer.step()
    torch.testing.assert_close(new_w, layer.weight.detach(), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(new_b, layer.bias.detach(), atol=1e-5, rtol=1e-4)


def test_fresh_linear_uses_pytorchs_default_bound():
    weight, bias = fresh_linear(25, 3, torch.Generator().manual_seed(0))
    assert weight.shape == (3, 25) and bias.shape == (3,)
    assert weight.abs().max() <= 0.2 and bias.abs().max() <= 0.2 and weight.abs().max() > 0.15


def test_server_round_rebuilds_phi_re_from_a_fresh_classifier_not_from_phi():
    algo = tiny_algorithm(retrain_epochs=0, feature_steps=0)
    server = algo.init_server(algo.setup.ops.initial_params())
    assert server["features"].shape == (4, 100, 5)
    replies = {0: {"params": server["params"], "weight": 3,
                   "grads": {1: {"head.fc.weight": torch.ones(4, 5), "head.fc.bias": torch.ones(4)}}}}
    new = algo.aggregate(3, server, replies)
    # zero epochs: phi_re is the freshly initialised Linear of round 3, not phi or the old phi_re
    expected_w, expected_b = fresh_linear(5, 4, torch_generator(5, 3, -1, "creff-retrain"))
    torch.testing.assert_close(new["head_re"]["head.fc.weight"], expected_w)
    torch.testing.assert_close(new["head_re"]["head.fc.bias"], expected_b)
    model = algo.client_model(0, new, None)
    assert torch.equal(model["head.fc.weight"], expected_w) and torch.equal(model["body.fc1.weight"],
                                                                             new["params"]["body.fc1.weight"])


def test_a_head_that_is_not_one_linear_layer_is_rejected():
    def two_layer_head():
        return BodyHeadModel([("fc1", nn.Linear(3, 5)), ("relu", nn.ReLU()), ("fc", nn.Linear(5, 4))], "fc1")

    algo = CReFF(CReFF.Hyper(), Setup(2, 4, np.ones((2, 4)), seed=5, local_epochs=1, ops=ModelOps(two_layer_head)))
    with pytest.raises(ConfigError, match="one Linear"):
        algo.check()
    tiny_algorithm().check()


# --- end to end ----------------------------------------------------------------------------

def test_without_retraining_creff_is_fedavg(small_config):
    creff = pfedkit.run({**small_config, "algorithm": "creff", "creff": {"retrain": False}})
    fedavg = pfedkit.run(small_config)
    pd.testing.assert_frame_equal(creff.metrics.drop(columns=["seconds"], errors="ignore"),
                                  fedavg.metrics.drop(columns=["seconds"], errors="ignore"))


def test_digits_run_messages_diagnostics_and_evaluated_model(small_config, tmp_path):
    result = pfedkit.run({**small_config, "algorithm": "creff", "join_ratio": 0.75, "creff": FAST})
    metrics = result.metrics
    state = final_state(result)
    params = state.server["params"]
    sigma, phi = 4 * num_parameters(params), 4 * num_parameters(select(params, "head"))
    joined = metrics[(metrics["round"] >= 1) & (metrics["participated"] == 1)]
    owned = {cid: int((counts > 0).sum()) for cid, counts in enumerate(np.asarray(state_counts(small_config)))}
    assert (joined["bytes_down"] == sigma + phi).all()
    assert (joined["bytes_up"] == [sigma + owned[c] * phi + 8 for c in joined["client"]]).all()
    assert metrics.loc[metrics["round"] == 3, "accuracy"].mean() > 0.3  # 10 classes: chance 0.1
    diagnostics = read_diagnostics(result.run_dir / "diagnostics.pt")
    assert sorted(diagnostics["matching_loss"]) == [1, 2, 3]
    assert all(diagnostics["matching_loss"][r] < diagnostics["matching_loss_start"][r] for r in (1, 2, 3))
    # the evaluated model is the FedAvg body with phi_re
    model = CReFF(CReFF.Hyper(**FAST), None).client_model(0, state.server, None)
    assert torch.equal(model["head.fc.weight"], state.server["head_re"]["head.fc.weight"])
    assert not torch.equal(model["head.fc.weight"], params["head.fc.weight"])
    written = draw_diagnostics(CReFF, diagnostics, tmp_path / "report")
    assert [p.name for p in written] == ["creff_losses.png"] and written[0].stat().st_size > 0


def state_counts(config):
    from pfedkit.config import load_config
    from pfedkit.runs import prepare

    return prepare(load_config({**config, "algorithm": "creff", "creff": FAST})).data.train_counts()


def test_processes_backend_gives_the_same_metrics(small_config, tmp_path):
    config = {**small_config, "algorithm": "creff", "rounds": 2, "join_ratio": 0.75, "creff": FAST}
    sequential = pfedkit.run({**config, "backend": "sequential", "out_dir": str(tmp_path / "s")})
    processes = pfedkit.run({**config, "backend": "processes", "workers": 2, "out_dir": str(tmp_path / "p")})
    columns = ["round", "client", "accuracy", "loss", "bytes_up", "bytes_down"]
    pd.testing.assert_frame_equal(sequential.metrics[columns], processes.metrics[columns])
