"""cwFedAvg with WDR (spec seed-algorithms.md §3): the §3.12 properties, the public functions and
short digits runs."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn

import pfedkit
import pfedkit.build
import pfedkit.runs
from pfedkit.core.contract import ClientData, Forward, Setup, message_bytes
from pfedkit.algorithms.cwfedavg import (CwFedAvg, class_wise_models, class_wise_weights,
                                         estimate_class_distribution, personalised_model,
                                         unheld_classes, weight_distribution_regularizer, wdr_loss)
from pfedkit.core.errors import ConfigError
from pfedkit.core.params import weighted_mean
from pfedkit.models import build_model
from pfedkit.report.run_report import report_run
from pfedkit.run_files import read_diagnostics

C = 4  # classes in the synthetic tests


def synthetic_params(seed: int, classes: int = C) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"body.fc1.weight": torch.randn(5, 3, generator=g), "body.fc1.bias": torch.randn(5, generator=g),
            "head.fc.weight": torch.randn(classes, 5, generator=g), "head.fc.bias": torch.randn(classes, generator=g)}


def make_algorithm(num_clients: int = 3, train_counts: np.ndarray | None = None, **hyper) -> CwFedAvg:
    counts = train_counts if train_counts is not None else np.ones((num_clients, C), dtype=int)
    setup = Setup(num_clients, C, counts, seed=0, local_epochs=1, ops=None)
    return CwFedAvg(CwFedAvg.Hyper(**hyper), setup)


def assert_params_close(a, b, atol=1e-6):
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=atol, rtol=0, msg=name)


# ------------------------------------------------------------------ public functions, eq. 4-7

def test_estimate_class_distribution_is_normalised_row_norms():
    weight = torch.tensor([[3.0, 4.0], [0.0, 0.0], [0.0, 5.0], [6.0, 8.0]])  # norms 5, 0, 5, 10
    torch.testing.assert_close(estimate_class_distribution(weight), torch.tensor([0.25, 0.0, 0.25, 0.5]))


def test_estimate_of_zero_matrix_is_uniform():
    estimate = estimate_class_distribution(torch.zeros(5, 3))
    torch.testing.assert_close(estimate, torch.full((5,), 0.2))


def test_class_wise_models_hand_computed():
    models = [{"w": torch.tensor([1.0])}, {"w": torch.tensor([3.0])}]
    class_dist = np.array([[0.5, 0.5], [0.0, 1.0]])
    sizes = np.array([10, 30])
    # p = (0.25, 0.75); class 0: only client 0 -> 1.0; class 1: (0.125, 0.75) -> 1/7, 6/7
    out = class_wise_models(models, class_dist, sizes)
    assert len(out) == 2
    torch.testing.assert_close(out[0]["w"], torch.tensor([1.0]))
    torch.testing.assert_close(out[1]["w"], torch.tensor([1.0 / 7 + 3.0 * 6 / 7]))


def test_class_without_mass_keeps_previous_or_raises():
    models = [{"w": torch.tensor([1.0])}]
    previous = [{"w": torch.tensor([7.0])}, {"w": torch.tensor([9.0])}]
    out = class_wise_models(models, np.array([[1.0, 0.0]]), np.array([5]), previous=previous)
    assert float(out[1]["w"]) == 9.0 and float(out[0]["w"]) == 1.0
    with pytest.raises(ValueError, match="class 1 has zero aggregation mass"):
        class_wise_models(models, np.array([[1.0, 0.0]]), np.array([5]))


def test_personalised_model_mixes_by_distribution():
    class_models = [{"w": torch.tensor([1.0, 0.0])}, {"w": torch.tensor([0.0, 2.0])}]
    mixed = personalised_model(class_models, np.array([0.25, 0.75]))
    torch.testing.assert_close(mixed["w"], torch.tensor([0.25, 1.5]))


# ------------------------------------------------------------------ §3.12 property 1

def test_identical_distributions_give_fedavg_models():
    uploads = [synthetic_params(s) for s in range(3)]
    sizes = np.array([10, 25, 40])
    same = np.tile([0.1, 0.2, 0.3, 0.4], (3, 1))
    fedavg = weighted_mean(uploads, sizes)
    for model in class_wise_models(uploads, same, sizes):
        assert_params_close(model, fedavg)
    assert_params_close(personalised_model(class_wise_models(uploads, same, sizes), same[0]), fedavg)


def test_identical_estimates_in_aggregate_give_fedavg_for_every_client():
    """Clients whose output weights are multiples of one matrix have identical p~ (eq. 4)."""
    algo = make_algorithm(num_clients=3, class_wise_layers="all")
    base = synthetic_params(0)
    server = algo.init_server(base)
    uploads = {}
    for cid, scale in enumerate([0.5, 1.0, 3.0]):
        params = synthetic_params(10 + cid)
        params["head.fc.weight"] = scale * base["head.fc.weight"]
        uploads[cid] = {"params": params, "weight": 10 * (cid + 1)}
    server = algo.aggregate(1, server, uploads)
    fedavg = weighted_mean([uploads[c]["params"] for c in range(3)], [10, 20, 30])
    for model in server["class_wise"]:
        assert_params_close(model, fedavg)
    for cid in range(3):
        assert_params_close(algo.client_model(cid, server, None), fedavg)


def test_identical_empirical_distributions_give_fedavg_models():
    algo = make_algorithm(num_clients=2, distribution="empirical")
    server = algo.init_server(synthetic_params(0))
    same = torch.tensor([0.4, 0.3, 0.2, 0.1])
    replies = {c: {"params": synthetic_params(5 + c), "weight": 7 + c, "class_distribution": same} for c in range(2)}
    server = algo.aggregate(1, server, replies)
    fedavg = weighted_mean([replies[c]["params"] for c in range(2)], [7, 8])
    for cid in range(2):
        assert_params_close(algo.client_model(cid, server, None), fedavg)


# ------------------------------------------------------------------ §3.12 property 2

def test_one_class_per_client_class_model_is_fedavg_of_its_clients():
    classes_of = [0, 2, 0, 1]  # client -> its only class; class 3 held by nobody
    sizes = [10, 20, 30, 40]
    algo = make_algorithm(num_clients=4, distribution="empirical")
    initial = synthetic_params(0)
    server = algo.init_server(initial)
    replies = {c: {"params": synthetic_params(20 + c), "weight": sizes[c],
                   "class_distribution": torch.nn.functional.one_hot(torch.tensor(k), C).float()}
               for c, k in enumerate(classes_of)}
    server = algo.aggregate(1, server, replies)
    head = lambda p: {n: v for n, v in p.items() if n.startswith("head.")}  # noqa: E731
    expected_class0 = weighted_mean([head(replies[0]["params"]), head(replies[2]["params"])], [10, 30])
    assert_params_close(server["class_wise"][0], expected_class0)
    assert_params_close(server["class_wise"][2], head(replies[1]["params"]))
    assert_params_close(server["class_wise"][1], head(replies[3]["params"]))
    assert_params_close(server["class_wise"][3], head(initial))  # no mass: keeps its last model
    for cid, k in enumerate(classes_of):
        personal = algo.client_model(cid, server, None)
        assert_params_close(head(personal), server["class_wise"][k])


# ------------------------------------------------------------------ §3.12 property 3

def test_class_weights_sum_to_one_per_class():
    rng = np.random.default_rng(0)
    class_dist = rng.dirichlet(np.ones(C), size=6)
    q, has_mass = class_wise_weights(class_dist, rng.integers(1, 100, size=6))
    assert has_mass.all()
    np.testing.assert_allclose(q.sum(axis=0), np.ones(C))


def test_estimate_sums_to_one():
    for seed in range(3):
        estimate = estimate_class_distribution(synthetic_params(seed)["head.fc.weight"])
        assert float(estimate.sum()) == pytest.approx(1.0, abs=1e-6)
        assert (estimate >= 0).all()


def test_estimate_scale_invariant_and_bias_free():
    """p~ ignores a positive rescaling of W, and the server's p~ does not read the bias."""
    weight = synthetic_params(1)["head.fc.weight"]
    for c in (1e-3, 0.7, 42.0):
        torch.testing.assert_close(estimate_class_distribution(c * weight), estimate_class_distribution(weight))
    algo = make_algorithm(num_clients=1)
    server = algo.init_server(synthetic_params(0))
    params = synthetic_params(2)
    other_bias = dict(params, **{"head.fc.bias": 100 * torch.ones(C)})
    a = algo.aggregate(1, server, {0: {"params": params, "weight": 5}})["class_dist"]
    b = algo.aggregate(1, server, {0: {"params": other_bias, "weight": 5}})["class_dist"]
    torch.testing.assert_close(a, b)


# ------------------------------------------------------------------ §3.12 property 4

def test_wdr_zero_iff_estimate_matches():
    weight = synthetic_params(3)["head.fc.weight"]
    estimate = estimate_class_distribution(weight).detach()
    assert float(weight_distribution_regularizer(weight, estimate)) == pytest.approx(0.0, abs=1e-7)
    other = torch.tensor([0.7, 0.1, 0.1, 0.1])
    expected = float(torch.linalg.vector_norm(other - estimate))  # the norm, not its square
    assert float(weight_distribution_regularizer(weight, other)) == pytest.approx(expected, rel=1e-6)
    assert expected > 0


def test_wdr_gradient_only_on_output_weight_rows():
    params = {n: v.clone().requires_grad_(True) for n, v in synthetic_params(4).items()}
    target = torch.tensor([0.5, 0.5, 0.0, 0.0])
    penalty = weight_distribution_regularizer(params["head.fc.weight"], target)
    grads = dict(zip(params, torch.autograd.grad(penalty, list(params.values()), allow_unused=True)))
    for name in ("body.fc1.weight", "body.fc1.bias", "head.fc.bias"):
        assert grads[name] is None or torch.count_nonzero(grads[name]) == 0
    assert (grads["head.fc.weight"].abs().sum(dim=1) > 0).all()


def test_wdr_loss_is_ce_plus_coefficient_times_regulariser():
    params = synthetic_params(5)
    logits = torch.randn(6, C, generator=torch.Generator().manual_seed(0))
    y = torch.tensor([0, 1, 2, 3, 0, 1])
    out = Forward(torch.zeros(6, 5), logits)
    target = torch.tensor([0.25, 0.25, 0.5, 0.0])
    loss = wdr_loss(out, y, params, {"class_distribution": target}, coefficient=3.0, output_weight="head.fc.weight")
    expected = (torch.nn.functional.cross_entropy(logits, y)
                + 3.0 * weight_distribution_regularizer(params["head.fc.weight"], target))
    torch.testing.assert_close(loss, expected)


def fit_request(algo: CwFedAvg, params, counts):
    """Start client_update on a tiny fake client and return its Fit request."""
    y = torch.repeat_interleave(torch.arange(C), torch.as_tensor(counts))
    data = ClientData(0, torch.zeros(len(y), 3), y, torch.zeros(2, 3), torch.tensor([0, 3]), np.asarray(counts))
    message = algo.broadcast(1, algo.init_server(params), [0])[0]
    gen = algo.client_update(1, 0, algo.init_client(0, params), message, data)
    return next(gen)


def test_wdr_coefficient_paper_vs_code_half_factor():
    params = synthetic_params(6)
    out = Forward(torch.zeros(4, 5), torch.zeros(4, C))
    y = torch.tensor([0, 1, 2, 3])
    losses = {}
    for half in (False, True):
        request = fit_request(make_algorithm(1, wdr_lambda=8.0, wdr_half_factor=half), params, [3, 1, 0, 0])
        torch.testing.assert_close(request.context["class_distribution"], torch.tensor([0.75, 0.25, 0.0, 0.0]))
        losses[half] = float(request.loss(out, y, params, request.context))
    ce = float(np.log(C))
    penalty = float(weight_distribution_regularizer(params["head.fc.weight"], torch.tensor([0.75, 0.25, 0.0, 0.0])))
    assert penalty > 0
    assert losses[False] - ce == pytest.approx(8.0 * penalty, rel=1e-5)  # + lambda R, not - lambda R
    assert losses[True] - ce == pytest.approx(4.0 * penalty, rel=1e-5)   # the code's 0.5 lambda
    off = fit_request(make_algorithm(1, wdr=False), params, [3, 1, 0, 0])
    assert float(off.loss(out, y, params, off.context)) == pytest.approx(ce, rel=1e-6)


# ------------------------------------------------------------------ §3.12 property 5

def test_equal_class_models_give_that_model_for_any_distribution():
    initial = synthetic_params(7)
    algo = make_algorithm(num_clients=2, class_wise_layers="all")
    server = algo.init_server(initial)
    for dist in (np.array([1.0, 0, 0, 0]), np.array([0.1, 0.2, 0.3, 0.4])):
        assert_params_close(personalised_model(server["class_wise"], dist), initial)
    server["class_dist"][1] = torch.tensor([0.0, 0.0, 0.9, 0.1], dtype=torch.float64)
    for cid in range(2):
        assert_params_close(algo.broadcast(1, server, [cid])[cid]["params"], initial)


# ------------------------------------------------------------------ §3.12 property 6

def test_output_variant_shares_fedavg_body():
    algo = make_algorithm(num_clients=3)  # default: class_wise_layers="output"
    server = algo.init_server(synthetic_params(0))
    replies = {c: {"params": synthetic_params(30 + c), "weight": 5 + 5 * c} for c in range(3)}
    server = algo.aggregate(1, server, replies)
    assert set(server["class_wise"][0]) == {"head.fc.weight", "head.fc.bias"}
    body = lambda p: {n: v for n, v in p.items() if n.startswith("body.")}  # noqa: E731
    fedavg_body = weighted_mean([body(replies[c]["params"]) for c in range(3)], [5, 10, 15])
    personal = [algo.client_model(c, server, None) for c in range(3)]
    for model in personal:
        assert_params_close(body(model), fedavg_body)
    assert not torch.allclose(personal[0]["head.fc.weight"], personal[1]["head.fc.weight"])


def test_class_wise_layers_choose_last_layers():
    params = synthetic_params(0)
    assert set(make_algorithm(class_wise_layers=2).init_server(params)["class_wise"][0]) == set(params)
    assert make_algorithm(class_wise_layers="all").init_server(params)["shared"] == {}
    with pytest.raises(ValueError, match="only 2 layers"):
        make_algorithm(class_wise_layers=3).init_server(params)


def test_partial_participation_updates_only_participants_and_skips_empty_clients():
    algo = make_algorithm(num_clients=4)
    server = algo.init_server(synthetic_params(0))
    replies = {1: {"params": synthetic_params(41), "weight": 10},
               3: {"params": synthetic_params(43), "weight": 0}}  # n_i = 0: excluded
    server = algo.aggregate(1, server, replies)
    table = server["class_dist"]
    expected = estimate_class_distribution(replies[1]["params"]["head.fc.weight"]).double()
    torch.testing.assert_close(table[1], expected)
    for cid in (0, 2, 3):
        torch.testing.assert_close(table[cid], torch.full((C,), 0.25, dtype=torch.float64))
    assert_params_close(server["shared"], {n: v for n, v in replies[1]["params"].items() if n.startswith("body.")})
    recorded = algo.diagnostics["estimated_class_distribution"][1]
    assert np.isnan(recorded[[0, 2, 3]]).all() and np.allclose(recorded[1], expected.numpy())


# ------------------------------------------------------------------ partial participation [ours]

def output_rows(seed: int, row_norms: list[float]) -> dict[str, torch.Tensor]:
    """Synthetic params whose output-weight rows have the given L2 norms (so p~ = norms / sum)."""
    params = synthetic_params(seed)
    directions = torch.nn.functional.normalize(params["head.fc.weight"], dim=1)
    params["head.fc.weight"] = torch.tensor(row_norms)[:, None] * directions
    return params


# p~ of the two uploads: class 0 and 1 held by client 0, class 2 by client 1, class 3 by neither
# (both below the uniform share 1/C = 0.25).
UPLOAD_NORMS = ([5.0, 4.0, 0.9, 0.1], [1.0, 2.0, 6.8, 0.2])
UPLOAD_SIZES = (10, 30)
# eq. 6 by hand: p = (0.25, 0.75); q_i3 = (0.25 * 0.01, 0.75 * 0.02) / 0.0175; q_i0 = (0.125, 0.075) / 0.2
Q_CLASS3, Q_CLASS0 = (1 / 7, 6 / 7), (0.625, 0.375)


def head(params):
    return {n: v for n, v in params.items() if n.startswith("head.")}


def two_uploads(algo: CwFedAvg, initial):
    """Aggregate the two uploads of UPLOAD_NORMS as clients 0 and 1; returns (server, replies)."""
    server = algo.init_server(initial)
    replies = {c: {"params": output_rows(50 + c, UPLOAD_NORMS[c]), "weight": UPLOAD_SIZES[c]} for c in range(2)}
    return algo.aggregate(1, server, replies), replies


def hand_mix(replies, q):
    return {n: q[0] * replies[0]["params"][n] + q[1] * replies[1]["params"][n] for n in head(replies[0]["params"])}


def test_class_no_participant_holds_keeps_its_previous_model():
    """Partial participation (2 of 4 clients): class 3 is held by neither participant, so its
    class-wise model stays the previous one instead of an average of clients without class 3."""
    initial = synthetic_params(0)
    algo = make_algorithm(num_clients=4)
    server, replies = two_uploads(algo, initial)
    for name, value in head(initial).items():
        assert torch.equal(server["class_wise"][3][name], value), name
    assert_params_close(server["class_wise"][0], hand_mix(replies, Q_CLASS0))  # held classes: eq. 6
    assert list(algo.diagnostics["kept_class_models"][1]) == [3]


def test_full_participation_is_eq6_bit_for_bit():
    """All clients took part: every class, held or not, is the eq. 6 average (hand-computed q)."""
    initial = synthetic_params(0)
    algo = make_algorithm(num_clients=2)
    server, replies = two_uploads(algo, initial)
    assert_params_close(server["class_wise"][3], hand_mix(replies, Q_CLASS3))
    assert_params_close(server["class_wise"][0], hand_mix(replies, Q_CLASS0))
    estimated = np.stack([estimate_class_distribution(replies[c]["params"]["head.fc.weight"]).double().numpy()
                          for c in range(2)])
    plain = class_wise_models([head(replies[c]["params"]) for c in range(2)], estimated, np.array(UPLOAD_SIZES))
    for ours, eq6 in zip(server["class_wise"], plain):
        assert all(torch.equal(ours[n], eq6[n]) for n in eq6)
    assert len(algo.diagnostics["kept_class_models"][1]) == 0


@pytest.mark.parametrize("held_share, kept", [(0.0, False), (0.05, False), (0.5, True), (1.0, True)])
def test_held_share_sets_what_counts_as_holding(held_share, kept):
    """Class 3 has p~ 0.01 and 0.02: held once the threshold held_share / C drops to 0.0125."""
    initial = synthetic_params(0)
    algo = make_algorithm(num_clients=4, held_share=held_share)
    server, replies = two_uploads(algo, initial)
    expected = head(initial) if kept else hand_mix(replies, Q_CLASS3)
    assert_params_close(server["class_wise"][3], expected)


def test_unheld_classes_threshold_is_share_of_uniform():
    dist = np.array([[0.5, 0.3, 0.2, 0.0],
                     [0.6, 0.2, 0.2, 0.0]])
    np.testing.assert_array_equal(unheld_classes(dist, 1.0), [False, False, True, True])
    np.testing.assert_array_equal(unheld_classes(dist, 0.8), [False, False, False, True])  # 0.2 >= 0.2
    np.testing.assert_array_equal(unheld_classes(dist, 0.0), [False, False, False, False])
    balanced = np.full((3, C), 1.0 / C)  # exactly the uniform share counts as held
    assert not unheld_classes(balanced, 1.0).any()


def test_empirical_minor_class_of_the_round_keeps_previous_model():
    """distribution=empirical, partial participation: class 1 is 5 % of the only participant that
    has it (below 1/C): kept; with held_share=0 it is that participant's model (eq. 6)."""
    initial = synthetic_params(0)
    upload = synthetic_params(60)
    reply = {"params": upload, "weight": 20, "class_distribution": torch.tensor([0.95, 0.05, 0.0, 0.0])}
    for held_share, expected in ((1.0, head(initial)), (0.0, head(upload))):
        algo = make_algorithm(num_clients=3, distribution="empirical", held_share=held_share)
        server = algo.aggregate(1, algo.init_server(initial), {0: reply})
        assert_params_close(server["class_wise"][1], expected)
        assert_params_close(server["class_wise"][2], head(initial))  # zero mass: kept either way


def test_client_mixing_downloads_every_class_wise_layer():
    params = synthetic_params(0)
    server = make_algorithm(mix_on="client").init_server(params)
    message = make_algorithm(mix_on="client").broadcast(1, server, [0])[0]
    head_bytes = (params["head.fc.weight"].numel() + params["head.fc.bias"].numel()) * 4
    body_bytes = (params["body.fc1.weight"].numel() + params["body.fc1.bias"].numel()) * 4
    assert message_bytes(message) == body_bytes + C * head_bytes
    server_message = make_algorithm().broadcast(1, server, [0])[0]
    assert message_bytes(server_message) == body_bytes + head_bytes


# ------------------------------------------------------------------ options that do not fit the model

def digits_run_config(tmp_path, **extra):
    return {"algorithm": "cwfedavg", "dataset": "digits", "num_clients": 4, "rounds": 1, "threads": 1,
            "out_dir": str(tmp_path / "runs"), **extra}


def assert_refused(tmp_path, config, *fragments):
    """run() ends in one ConfigError line containing `fragments` and leaves no run directory."""
    with pytest.raises(ConfigError) as caught:
        pfedkit.runs.run(config)
    message = str(caught.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message
    out = tmp_path / "runs"
    assert not out.exists() or not any(out.iterdir())


def test_class_wise_layers_beyond_the_model_is_refused(tmp_path):
    config = digits_run_config(tmp_path, cwfedavg={"class_wise_layers": 4})  # mlp: fc1, fc2, fc
    assert_refused(tmp_path, config, "cwfedavg.class_wise_layers: 4", "only 3 layers", "body.fc1, body.fc2, head.fc",
                   "class_wise_layers=3")


def test_held_share_above_one_is_refused(tmp_path):
    assert_refused(tmp_path, digits_run_config(tmp_path, cwfedavg={"held_share": 1.5}), "cwfedavg.held_share")


class NoOutputLayer(nn.Module):
    """A model whose head has no parameters (nothing to read eq. 4 off)."""
    def __init__(self, input_shape, num_classes, head="last"):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(int(np.prod(input_shape)), num_classes))
        self.head = nn.Sequential(nn.Identity())

    def forward(self, x):
        return self.head(self.body(x))


class HeadRegisteredFirst(NoOutputLayer):
    """The output layer is not the last layer in parameter order."""
    def __init__(self, input_shape, num_classes, head="last"):
        nn.Module.__init__(self)
        self.head = nn.Sequential(nn.Linear(16, num_classes))
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(int(np.prod(input_shape)), 16))


@pytest.mark.parametrize("builder, options, fragments", [
    (lambda shape, classes: build_model("mlp", shape, classes - 1), {},
     ["model: the output layer head.fc.weight", "9 rows", "10 classes"]),
    (lambda shape, classes: NoOutputLayer(shape, classes), {}, ["model: NoOutputLayer has no output Linear layer"]),
    (lambda shape, classes: HeadRegisteredFirst(shape, classes), {"class_wise_layers": "output"},
     ["cwfedavg.class_wise_layers: the last 1 layers", "(body.1)", "output layer head.0", "'all'"]),
], ids=["rows_not_classes", "no_output_layer", "output_not_last"])
def test_model_without_a_usable_output_layer_is_refused(tmp_path, monkeypatch, builder, options, fragments):
    monkeypatch.setattr(pfedkit.build, "build_model", lambda name, shape, classes, **_: builder(shape, classes))
    assert_refused(tmp_path, digits_run_config(tmp_path, cwfedavg=options), *fragments)


def check_with(template, num_classes=10, **hyper):
    setup = Setup(2, num_classes, np.ones((2, num_classes), dtype=int), seed=0, local_epochs=1,
                  ops=SimpleNamespace(template=template))
    CwFedAvg(CwFedAvg.Hyper(**hyper), setup).check()


def test_check_accepts_up_to_every_layer_of_the_paper_cnn():
    """Paper Table 3: the 4-layer CNN (conv1, conv2, fc1, output) takes L = 1..4, not 5. (digits is
    flat, so `model: cnn` cannot run on it; the check is called directly.)"""
    cnn = build_model("cnn", (1, 28, 28), 10)
    for layers in ("output", "all", 1, 4):
        check_with(cnn, class_wise_layers=layers)
    with pytest.raises(ConfigError, match=r"cwfedavg.class_wise_layers: 5 but FedAvgCNN has only 4 layers"):
        check_with(cnn, class_wise_layers=5)
    check_with(HeadRegisteredFirst((64,), 10), class_wise_layers="all")  # 'all' includes the output layer


# ------------------------------------------------------------------ end-to-end on digits

def digits_config(tmp_path, name, algorithm="cwfedavg", **extra):
    return {"algorithm": algorithm, "dataset": "digits", "num_clients": 4, "rounds": 2, "batch_size": 20,
            "lr": 0.05, "seed": 1, "threads": 1, "out_dir": str(tmp_path), "name": name,
            "partition": {"scheme": "pathological", "classes_per_client": 2}, **extra}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cwfedavg")
    return {
        "wdr": pfedkit.run(digits_config(tmp, "wdr")),
        "no_wdr": pfedkit.run(digits_config(tmp, "no_wdr", cwfedavg={"wdr": False})),
        "client_mix": pfedkit.run(digits_config(tmp, "client_mix", cwfedavg={"mix_on": "client"})),
        "fedavg": pfedkit.run(digits_config(tmp, "fedavg", algorithm="fedavg")),
        "held_share_0": pfedkit.run(digits_config(tmp, "held_share_0", cwfedavg={"held_share": 0.0})),
    }


@pytest.fixture(scope="module")
def partial_runs(tmp_path_factory):
    """10 clients, 3 take part per round: most classes have no holder among the participants."""
    tmp = tmp_path_factory.mktemp("cwfedavg_partial")
    return {share: pfedkit.run(digits_config(tmp, f"share_{share}", num_clients=10, rounds=15, join_ratio=0.3,
                                             cwfedavg={"held_share": share}))
            for share in (0.0, 1.0)}


def test_digits_pathological_learns_personalised_models(runs):
    metrics = runs["wdr"].metrics
    last = metrics[metrics["round"] == metrics["round"].max()]
    # each client sees 2 of 10 classes: chance on its own test split is 0.5
    assert last["accuracy"].mean() > 0.8
    assert last["accuracy"].mean() > runs["fedavg"].metrics.query("round == 2")["accuracy"].mean()


def test_full_participation_results_do_not_depend_on_held_share(runs):
    """The partial-participation rule must leave full participation exactly as eq. 6."""
    columns = ["round", "client", "accuracy", "loss"]
    pd.testing.assert_frame_equal(runs["wdr"].metrics[columns], runs["held_share_0"].metrics[columns])


def test_keeping_unheld_classes_helps_under_partial_participation(partial_runs):
    kept = read_diagnostics(partial_runs[1.0].run_dir / "diagnostics.pt")["kept_class_models"]
    assert np.mean([len(classes) for classes in kept.values()]) >= 3  # 3 participants x 2 classes < 10
    assert partial_runs[1.0].summary["last5_acc"] > partial_runs[0.0].summary["last5_acc"] + 0.2


def test_bytes_equal_fedavg(runs):
    ours, fedavg = runs["wdr"].metrics, runs["fedavg"].metrics
    pd.testing.assert_series_equal(ours["bytes_down"], fedavg["bytes_down"])
    pd.testing.assert_series_equal(ours["bytes_up"], fedavg["bytes_up"])
    assert (ours["bytes_down"] > 0).all()


def test_client_mixing_matches_server_mixing_under_full_participation(runs):
    server_mix, client_mix = runs["wdr"].metrics, runs["client_mix"].metrics
    np.testing.assert_allclose(client_mix["accuracy"], server_mix["accuracy"])
    np.testing.assert_allclose(client_mix["loss"], server_mix["loss"], rtol=1e-5)
    assert (client_mix["bytes_down"] > server_mix["bytes_down"]).all()  # C heads instead of one


def test_wdr_brings_estimate_closer_to_true_distribution(runs):
    def gap(result):
        diagnostics = read_diagnostics(result.run_dir / "diagnostics.pt")
        true = next(iter(diagnostics["true_class_distribution"].values()))
        estimate = diagnostics["estimated_class_distribution"][2]
        return float(np.linalg.norm(estimate - true, axis=1).mean())
    assert gap(runs["wdr"]) < 0.5 * gap(runs["no_wdr"])


def test_diagnostics_recorded_and_report_drawn(runs):
    result = runs["wdr"]
    diagnostics = read_diagnostics(result.run_dir / "diagnostics.pt")
    assert sorted(diagnostics["estimated_class_distribution"]) == [1, 2]
    assert len(diagnostics["true_class_distribution"]) == 1
    estimate = diagnostics["estimated_class_distribution"][2]
    assert estimate.shape == (4, 10) and np.allclose(estimate.sum(axis=1), 1.0, atol=1e-5)
    written = report_run(result.run_dir)
    names = {path.name for path in written}
    assert {"cwfedavg_class_distribution.png", "cwfedavg_distribution_gap.png"} <= names
    assert all(path.stat().st_size > 0 for path in written)
