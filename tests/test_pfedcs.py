"""PFedCS (spec seed-algorithms.md §4): the checkable properties of §4.11, the public functions,
the client's training requests, and short end-to-end runs on digits."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F

import pfedkit
from pfedkit.core.contract import Algorithm, ClientData, Fit, Forward, HyperParams, Setup, cross_entropy
from pfedkit.core.model_ops import ModelOps
from pfedkit.core.params import clone, merge, select, weighted_mean
from pfedkit.algorithms.pfedcs import (PFedCS, candidate_mask, classifier_distances, classifier_loss,
                                       dca_terms, dca_weights, distance_threshold, kl_guided_loss,
                                       normalise_logits, plan_collaboration, row_normalise, teacher_logits)
from pfedkit.config import load_config
from pfedkit.models import build_model
from pfedkit.run_files import read_diagnostics
from pfedkit.runs import prepare

from conftest import num_parameters

NUM_FEATURES, NUM_CLASSES = 6, 3


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------

def tiny_algorithm(num_clients: int = 6, **hyper) -> PFedCS:
    def build():
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            return build_model("mlp", (NUM_FEATURES,), NUM_CLASSES, head="last")
    setup = Setup(num_clients, NUM_CLASSES, np.ones((num_clients, NUM_CLASSES)), seed=5, local_epochs=1,
                  ops=ModelOps(build))
    return PFedCS(PFedCS.Hyper(**hyper), setup)


def tiny_data(cid: int = 0, n: int = 12) -> ClientData:
    generator = torch.Generator().manual_seed(cid)
    x = torch.randn(n, NUM_FEATURES, generator=generator)
    y = torch.arange(n) % NUM_CLASSES
    return ClientData(cid, x, y, x[:4], y[:4], np.bincount(y.numpy(), minlength=NUM_CLASSES))


def shifted(head: dict, amount: float) -> dict:
    return {name: value + amount for name, value in head.items()}


def run_config(tmp_path, **overrides) -> dict:
    config = {"algorithm": "pfedcs", "dataset": "digits", "num_clients": 6, "rounds": 3,
              "batch_size": 50, "lr": 0.1, "seed": 1, "threads": 1, "out_dir": str(tmp_path / "runs"),
              "partition": {"scheme": "pathological", "classes_per_client": 2},
              "pfedcs": {"beta": 2}}
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(config.get(key), dict):
            config[key] = {**config[key], **value}
        else:
            config[key] = value
    return config


def model_sizes(result) -> tuple[int, int]:
    """(body bytes, head bytes) of the run's model, float32."""
    params = prepare(load_config(result.run_dir / "config.yaml")).simulation.algorithm.setup.ops.initial_params()
    return 4 * num_parameters(select(params, "body")), 4 * num_parameters(select(params, "head"))


def diagnostics_of(result) -> dict:
    return read_diagnostics(result.run_dir / "diagnostics.pt")


# ---------------------------------------------------------------------------------------------
# §4.11 property 1: the dynamic threshold (eq. 4)
# ---------------------------------------------------------------------------------------------

def test_threshold_is_mean_at_start_min_at_beta_affine_and_non_increasing():
    distances = np.random.default_rng(0).random(7)
    beta = 8
    taus = np.array([distance_threshold(distances, t, beta) for t in range(beta + 1)])
    assert taus[0] == distances.mean()
    assert taus[-1] == distances.min()
    steps = np.diff(taus)
    np.testing.assert_allclose(steps, steps[0], rtol=1e-9)  # affine in t
    assert (steps <= 0).all()


def test_threshold_rejects_empty_distances_and_non_positive_beta():
    with pytest.raises(ValueError, match="at least one distance"):
        distance_threshold(np.array([]), 1, 5)
    with pytest.raises(ValueError, match="beta"):
        distance_threshold(np.array([0.2, 0.4]), 1, 0)


# ---------------------------------------------------------------------------------------------
# §4.11 property 2: distances (eq. 3)
# ---------------------------------------------------------------------------------------------

def test_raw_distances_are_symmetric_with_zero_diagonal_and_normalised_rows_peak_at_one():
    classifiers = torch.randn(6, 30, generator=torch.Generator().manual_seed(2))
    raw = classifier_distances(classifiers)
    assert np.array_equal(raw, raw.T)
    assert (np.diag(raw) == 0).all()
    np.testing.assert_allclose(raw[1, 4], float(((classifiers[1] - classifiers[4]) ** 2).sum()), rtol=1e-6)
    normalised = row_normalise(raw)
    assert ((normalised >= 0) & (normalised <= 1)).all()
    assert (normalised.max(axis=1) == 1.0).all()
    assert not np.array_equal(normalised, normalised.T)  # generally not symmetric


def test_each_row_is_divided_by_its_own_maximum():
    raw = np.array([[0.0, 2.0, 4.0], [2.0, 0.0, 1.0], [4.0, 1.0, 0.0]])
    expected = np.array([[0.0, 0.5, 1.0], [1.0, 0.0, 0.5], [1.0, 0.25, 0.0]])  # by columns: row 1 = .5, 0, .25
    np.testing.assert_array_equal(row_normalise(raw), expected)


def test_zero_distance_row_stays_zero_after_normalisation():
    identical = torch.ones(3, 4)
    normalised = row_normalise(classifier_distances(identical))
    assert np.array_equal(normalised, np.zeros((3, 3)))


# ---------------------------------------------------------------------------------------------
# §4.11 property 3: DCA weights (eq. 7-8)
# ---------------------------------------------------------------------------------------------

def test_dca_terms_each_sum_to_one_over_collaborators():
    distances, counts = np.array([0.1, 0.4, 0.25, 0.9]), np.array([10, 40, 5, 7])
    similarity, data = dca_terms(distances, counts, own_count=30)
    assert similarity.shape == data.shape == (5,)  # collaborators + k
    assert similarity[:-1].sum() == pytest.approx(1.0)
    assert data[:-1].sum() == pytest.approx(1.0)
    assert data[-1] == pytest.approx(30 / counts.sum())


def test_dca_weights_are_non_negative_and_sum_to_one_after_adding_k():
    rng = np.random.default_rng(3)
    for lam in (0.0, 0.3, 0.5, 1.0):
        weights = dca_weights(rng.random(5), rng.integers(1, 100, 5), own_count=50, lam=lam)
        assert (weights >= 0).all()
        assert weights.sum() == pytest.approx(1.0)


def test_dca_weights_with_lambda_zero_are_proportional_to_sample_counts():
    counts = np.array([10.0, 40.0, 5.0])
    weights = dca_weights(np.array([0.1, 0.5, 0.3]), counts, own_count=25, lam=0.0)
    np.testing.assert_allclose(weights, np.append(counts, 25) / 80)


def test_dca_farthest_collaborator_gets_zero_similarity_weight():
    distances = np.array([0.2, 0.7, 0.35])
    similarity, _ = dca_terms(distances, np.ones(3), own_count=1)
    assert similarity[1] == 0.0
    assert similarity[-1] == similarity.max()  # k itself (D_kk = 0) is the most similar
    assert dca_weights(distances, np.ones(3), 1, lam=1.0)[1] == 0.0


def test_dca_without_renormalising_keeps_eq6_literal_weights():
    distances, counts = np.array([0.1, 0.3]), np.array([4.0, 6.0])
    raw = dca_weights(distances, counts, own_count=5, lam=0.5, renormalise=False)
    similarity, data = dca_terms(distances, counts, own_count=5)
    np.testing.assert_allclose(raw, 0.5 * similarity + 0.5 * data)
    assert raw.sum() > 1
    np.testing.assert_allclose(dca_weights(distances, counts, 5, lam=0.5), raw / raw.sum())


def test_dca_with_equal_distances_gives_equal_similarity_shares():
    similarity, _ = dca_terms(np.array([0.4, 0.4]), np.array([1, 3]), own_count=2)
    np.testing.assert_allclose(similarity, [0.5, 0.5, 0.5])
    weights = dca_weights(np.array([0.4]), np.array([3]), own_count=1, lam=0.5)
    np.testing.assert_allclose(weights, np.array([0.5 + 0.5, 0.5 + 0.5 / 3]) / (1.5 + 0.5 / 3))


# ---------------------------------------------------------------------------------------------
# §4.11 property 4: candidates and collaborators
# ---------------------------------------------------------------------------------------------

def test_collaborators_within_candidates_within_other_participants():
    rng = np.random.default_rng(4)
    normalised = row_normalise(classifier_distances(torch.as_tensor(rng.normal(size=(8, 20)))))
    counts = list(rng.integers(5, 50, 8))
    for t in (1, 3, 6):
        for k in range(8):
            plan = plan_collaboration(normalised, counts, k, t, 6, lam=0.5, seed=k)
            assert set(plan.collaborators) <= set(plan.candidates) <= set(range(8)) - {k}
            assert len(plan.weights) == len(plan.collaborators) + 1


@pytest.mark.parametrize("grouping", ["gmm", "kmeans", "agglomerative", "fixed"])
def test_two_groups_of_identical_classifiers_give_own_group_as_candidates(grouping):
    base = torch.randn(1, 20, generator=torch.Generator().manual_seed(5))
    groups = [0, 0, 0, 1, 1, 0, 1, 1, 1]  # sizes 4 and 5, interleaved
    classifiers = torch.cat([base + 10.0 * g for g in groups])
    normalised = row_normalise(classifier_distances(classifiers))
    for k, group in enumerate(groups):
        plan = plan_collaboration(normalised, [1] * len(groups), k, 1, 10, lam=0.5, grouping=grouping, seed=k)
        assert plan.candidates == [j for j, g in enumerate(groups) if g == group and j != k]


def test_degenerate_distances_make_every_other_participant_a_candidate():
    assert candidate_mask(np.array([0.3, 0.3, 0.3])).all()
    assert candidate_mask(np.array([0.7])).all()


def test_grouping_is_seeded_and_leaves_global_random_state_alone():
    distances = np.random.default_rng(6).random(12)
    numpy_state, torch_state = np.random.get_state()[1].copy(), torch.random.get_rng_state().clone()
    first = candidate_mask(distances, seed=11)
    assert np.array_equal(np.random.get_state()[1], numpy_state)
    assert torch.equal(torch.random.get_rng_state(), torch_state)
    np.random.seed(123)  # a different global state must not change the result
    assert np.array_equal(candidate_mask(distances, seed=11), first)


# ---------------------------------------------------------------------------------------------
# Customised classifiers built by the server (eq. 6)
# ---------------------------------------------------------------------------------------------

def two_group_server(algo: PFedCS, counts: list[int]) -> tuple[dict, list[dict]]:
    """Clients 0-2 near each other (0 nearest to 1), clients 3-5 far away."""
    params = algo.setup.ops.initial_params()
    head = select(params, "head")
    heads = [head, shifted(head, 0.01), shifted(head, 0.05)] + [shifted(head, 10.0 + 0.01 * i) for i in range(3)]
    server = {"body": select(params, "body"), "heads": dict(enumerate(heads)),
              "counts": dict(enumerate(counts)), "initial_head": head}
    return server, heads


def test_customised_classifier_at_beta_mixes_nearest_neighbour_by_data_size():
    algo = tiny_algorithm(beta=4, dca_lambda=0.0)
    server, heads = two_group_server(algo, counts=[10, 30, 20, 5, 5, 5])
    messages = algo.broadcast(4, server, list(range(6)))  # t = beta: threshold = min distance
    expected = {n: 0.75 * heads[1][n] + 0.25 * heads[0][n] for n in heads[0]}  # n_1 / n_1, n_0 / n_1
    for name, value in expected.items():
        torch.testing.assert_close(messages[0]["head"][name], value)
    assert set(messages[0]) == {"body", "head"}
    assert algo.diagnostics["collaborators"][4][0].tolist() == [0, 1, 0, 0, 0, 0]


def test_customised_classifier_early_uses_similarity_weights_over_the_near_group():
    algo = tiny_algorithm(beta=1000, dca_lambda=1.0)
    server, heads = two_group_server(algo, counts=[10, 30, 20, 5, 5, 5])
    messages = algo.broadcast(1, server, list(range(6)))  # threshold ~ mean: all near clients
    assert algo.diagnostics["collaborators"][1][0].tolist() == [0, 1, 1, 0, 0, 0]
    # d_01 : d_02 = 1 : 25, so similarity weights are [1, 0] for (1, 2) and 25/24 for k = 0
    expected = {n: (24 * heads[1][n] + 25 * heads[0][n]) / 49 for n in heads[0]}
    for name, value in expected.items():
        torch.testing.assert_close(messages[0]["head"][name], value)


def test_identical_initial_heads_give_the_initial_head_to_everyone():
    algo = tiny_algorithm(beta=3)
    server = algo.init_server(algo.setup.ops.initial_params())
    messages = algo.broadcast(1, server, [0, 2, 5])
    for cid in (0, 2, 5):
        for name, value in server["initial_head"].items():
            torch.testing.assert_close(messages[cid]["head"][name], value)
    assert algo.diagnostics["collaborators"][1].sum() == 3 * 2  # everyone, as in the paper's round 1


# ---------------------------------------------------------------------------------------------
# §4.11 property 5: the KL-guided loss (eq. 12)
# ---------------------------------------------------------------------------------------------

def linear_forward(features, weight, bias) -> Forward:
    return Forward(features, F.linear(features, weight, bias))


def test_kl_term_vanishes_when_teacher_equals_local_head():
    generator = torch.Generator().manual_seed(7)
    features = torch.randn(9, 5, generator=generator)
    weight, bias = torch.randn(4, 5, generator=generator), torch.randn(4, generator=generator)
    y = torch.arange(9) % 4
    out = linear_forward(features, weight, bias)
    for kind in ("none", "l2"):
        loss = kl_guided_loss(out, y, {}, {"teacher_weight": weight, "teacher_bias": bias}, normalisation=kind)
        assert loss == classifier_loss(out, y, {}, {}, normalisation=kind)
        other_weight = weight + torch.randn(4, 5, generator=generator)  # (a constant shift would not change softmax)
        other = kl_guided_loss(out, y, {}, {"teacher_weight": other_weight, "teacher_bias": bias},
                               normalisation=kind)
        assert other > loss
    assert classifier_loss(out, y, {}, {}, normalisation="none") == cross_entropy(out, y, {}, {})


def test_teacher_receives_no_gradient_during_local_training():
    generator = torch.Generator().manual_seed(8)
    features = torch.randn(9, 5, generator=generator, requires_grad=True)
    weight = torch.randn(4, 5, generator=generator, requires_grad=True)
    bias = torch.randn(4, generator=generator, requires_grad=True)
    teacher_weight = torch.randn(4, 5, generator=generator, requires_grad=True)
    teacher_bias = torch.randn(4, generator=generator, requires_grad=True)
    y = torch.arange(9) % 4
    logits = F.linear(features, weight, bias)
    kl_guided_loss(Forward(features, logits), y, {},
                   {"teacher_weight": teacher_weight, "teacher_bias": teacher_bias}, normalisation="none").backward()
    assert teacher_weight.grad is None and teacher_bias.grad is None
    # d/dz [CE + KL(p^v || p^w)] = (p^w - onehot + p^w - p^v) / B, with p^v constant; the features
    # get gradient only through the student's logits
    with torch.no_grad():
        p_w = logits.softmax(1)
        p_v = F.linear(features, teacher_weight, teacher_bias).softmax(1)
        grad_logits = (2 * p_w - F.one_hot(y, 4) - p_v) / 9
    torch.testing.assert_close(weight.grad, grad_logits.T @ features.detach())
    torch.testing.assert_close(features.grad, grad_logits @ weight.detach())


def test_l2_normalisation_divides_each_logit_vector_by_its_norm_and_keeps_the_prediction():
    logits = torch.tensor([[3.0, 4.0, 0.0], [0.0, -1.0, 0.0]])
    expected = torch.tensor([[0.6, 0.8, 0.0], [0.0, -1.0, 0.0]])
    torch.testing.assert_close(normalise_logits(logits, "l2"), expected)
    assert torch.equal(normalise_logits(logits, "none"), logits)
    y = torch.tensor([1, 2])
    hand = -(expected.log_softmax(1)[torch.arange(2), y]).mean()
    torch.testing.assert_close(classifier_loss(Forward(logits, logits), y, {}, {}, normalisation="l2"), hand)
    random = torch.randn(50, 7, generator=torch.Generator().manual_seed(3))
    assert torch.equal(normalise_logits(random, "l2").argmax(1), random.argmax(1))
    with pytest.raises(ValueError, match="l2"):
        normalise_logits(logits, "softmax")


def test_frozen_teacher_logits_are_the_rows_of_the_batch():
    table = torch.arange(24, dtype=torch.float32).reshape(8, 3)
    index = torch.tensor([5, 2, 7])
    out = Forward(torch.zeros(3, 4), torch.zeros(3, 3), index=index)
    assert torch.equal(teacher_logits(out, {"teacher_logits": table}), table[index])
    with pytest.raises(ValueError, match="index"):
        teacher_logits(Forward(torch.zeros(3, 4), torch.zeros(3, 3)), {"teacher_logits": table})


# ---------------------------------------------------------------------------------------------
# The client's training requests
# ---------------------------------------------------------------------------------------------

def drive(update, answer):
    """Step a client_update generator; `answer(fit)` plays the trainer. Returns (fits, result)."""
    fits = []
    try:
        fit = next(update)
        while True:
            fits.append(fit)
            fit = update.send(answer(fit))
    except StopIteration as stop:
        return fits, stop.value


def loss_of(fit: Fit):
    """(function, normalisation) of a Fit's loss (a functools.partial of a module function)."""
    return fit.loss.func, fit.loss.keywords["normalisation"]


def test_stage_one_fine_tunes_the_customised_head_then_trains_with_the_frozen_teacher():
    algo = tiny_algorithm(beta=3, rho=2, finetune_lr=0.02)
    params = algo.setup.ops.initial_params()
    own_head, customised = shifted(select(params, "head"), 1.0), shifted(select(params, "head"), 2.0)
    body = shifted(select(params, "body"), 0.5)
    tuned_head = shifted(customised, 0.25)
    answers = iter([merge(body, tuned_head), merge(shifted(body, 3.0), shifted(own_head, 0.1))])
    data = tiny_data()
    fits, (state, reply) = drive(algo.client_update(2, 0, {"head": own_head}, {"body": body, "head": customised},
                                                    data), lambda fit: next(answers))
    finetune, local = fits
    assert (finetune.trainable, finetune.epochs, finetune.lr) == ("head", 2, 0.02)
    assert loss_of(finetune) == (classifier_loss, "l2")
    assert all(torch.equal(finetune.params[n], v) for n, v in merge(body, customised).items())
    assert local.trainable == "all" and local.epochs is None and loss_of(local) == (kl_guided_loss, "l2")
    assert all(torch.equal(local.params[n], v) for n, v in merge(body, own_head).items())
    # eq. 10: the teacher is the fine-tuned head on the DOWNLOADED body, one row per training sample
    expected = algo.setup.ops.logits(merge(body, tuned_head), data.x_train, None)
    torch.testing.assert_close(local.context["teacher_logits"][:data.n_train], expected)
    assert set(reply) == {"body", "head", "weight"} and reply["weight"] == 12
    assert torch.equal(state["head"]["head.fc.weight"], own_head["head.fc.weight"] + 0.1)
    assert all(torch.equal(reply["body"][n], v) for n, v in shifted(body, 3.0).items())


def test_current_features_teacher_option_sends_the_tuned_classifier():
    algo = tiny_algorithm(beta=3, rho=2, teacher="current_features", logit_normalisation="none")
    params = algo.setup.ops.initial_params()
    body, customised = select(params, "body"), shifted(select(params, "head"), 2.0)
    tuned_head = shifted(customised, 0.25)
    answers = iter([merge(body, tuned_head), params])
    fits, _ = drive(algo.client_update(1, 0, {"head": select(params, "head")}, {"body": body, "head": customised},
                                       tiny_data()), lambda fit: next(answers))
    local = fits[1]
    assert loss_of(local) == (kl_guided_loss, "none") and "teacher_logits" not in local.context
    assert torch.equal(local.context["teacher_weight"], tuned_head["head.fc.weight"])
    assert torch.equal(local.context["teacher_bias"], tuned_head["head.fc.bias"])


def test_frozen_teacher_pads_every_client_to_the_largest_training_set():
    algo = tiny_algorithm(beta=3, rho=0)
    algo.setup.train_counts[1] = [10, 10, 10]  # the largest client holds 30 training samples
    params = algo.setup.ops.initial_params()
    data = tiny_data(n=12)
    fits, _ = drive(algo.client_update(1, 0, {"head": select(params, "head")},
                                       {"body": select(params, "body"), "head": select(params, "head")}, data),
                    lambda fit: fit.params)
    table = fits[0].context["teacher_logits"]
    assert table.shape == (30, NUM_CLASSES)
    assert torch.equal(table[12:], torch.zeros(18, NUM_CLASSES))


def test_rho_zero_uses_the_customised_head_as_teacher_without_fine_tuning():
    algo = tiny_algorithm(beta=3, rho=0)
    params = algo.setup.ops.initial_params()
    customised = shifted(select(params, "head"), 2.0)
    data = tiny_data()
    fits, _ = drive(algo.client_update(1, 0, {"head": select(params, "head")},
                                       {"body": select(params, "body"), "head": customised}, data),
                    lambda fit: fit.params)
    assert len(fits) == 1 and loss_of(fits[0]) == (kl_guided_loss, "l2")
    expected = algo.setup.ops.logits(merge(select(params, "body"), customised), data.x_train, None)
    torch.testing.assert_close(fits[0].context["teacher_logits"][:data.n_train], expected)


# ---------------------------------------------------------------------------------------------
# §4.11 property 6: after beta, FedPer
# ---------------------------------------------------------------------------------------------

def test_after_beta_uploads_have_no_head_and_training_is_plain_fedper():
    algo = tiny_algorithm(beta=2)
    params = algo.setup.ops.initial_params()
    head, body = shifted(select(params, "head"), 1.0), select(params, "body")
    assert set(algo.broadcast(3, {"body": body}, [0, 1])[0]) == {"body"}
    for rnd in (2, 3):  # round beta's upload already serves stage 2 (the paper's round beta + 1)
        fits, (state, reply) = drive(algo.client_update(rnd, 0, {"head": head}, {"body": body, "head": head},
                                                        tiny_data()), lambda fit: fit.params)
        assert set(reply) == {"body", "weight"}
    assert len(fits) == 1
    assert loss_of(fits[0]) == (classifier_loss, "l2") and fits[0].trainable == "all" and fits[0].epochs is None
    assert all(torch.equal(fits[0].params[n], v) for n, v in merge(body, head).items())
    server = algo.aggregate(3, {"body": body}, {0: reply})
    assert set(server) == {"body"}
    exclusive = tiny_algorithm(beta=2, stage_one_includes_beta=False)  # the paper's "FedPer when t >= beta"
    assert set(exclusive.broadcast(2, {"body": body}, [0])[0]) == {"body"}


class ReferenceFedPer(Algorithm):
    """FedPer as baselines.md states it, written independently (never registered)."""
    name = "reference-fedper"
    head = "last"

    def init_server(self, params):
        return {"body": clone(select(params, "body"))}

    def init_client(self, cid, params):
        return clone(select(params, "head"))

    def broadcast(self, rnd, server, cids):
        return {cid: {"body": server["body"]} for cid in cids}

    def client_update(self, rnd, cid, client, message, data):
        trained = yield Fit({**message["body"], **client})
        return select(trained, "head"), {"body": select(trained, "body"), "weight": data.n_train}

    def aggregate(self, rnd, server, replies):
        cids = sorted(replies)
        return {"body": weighted_mean([replies[c]["body"] for c in cids], [replies[c]["weight"] for c in cids])}

    def client_model(self, cid, server, client):
        return {**server["body"], **client}


def test_rounds_after_beta_are_identical_to_fedper(tmp_path):
    config = run_config(tmp_path, num_clients=4, pfedcs={"beta": 0, "logit_normalisation": "none"})
    pfedcs = pfedkit.run(config)
    prepared = prepare(load_config(config))
    simulation = prepared.simulation
    simulation.algorithm = ReferenceFedPer(HyperParams(), simulation.algorithm.setup)
    ops = simulation.algorithm.setup.ops
    state = simulation.initial_state(ops.initial_params(), ops.initial_buffers())
    try:
        for _ in range(config["rounds"]):
            simulation.run_round(state)
    finally:
        prepared.runtime.close()
    columns = ["round", "client", "correct", "loss", "train_loss", "bytes_up", "bytes_down"]
    pd.testing.assert_frame_equal(pfedcs.metrics[columns], pd.DataFrame(state.rows)[columns])


# ---------------------------------------------------------------------------------------------
# End to end on digits
# ---------------------------------------------------------------------------------------------

def test_digits_run_learns_counts_bytes_and_records_collaborators(tmp_path):
    beta = 2
    result = pfedkit.run(run_config(tmp_path, rounds=3, pfedcs={"beta": beta}))
    metrics = result.metrics
    last = metrics[metrics["round"] == 3]
    assert last["correct"].sum() / last["n_test"].sum() > 0.7  # 2 classes per client: chance ~ 0.5

    body, head = model_sizes(result)
    by_round = metrics.groupby("round")
    assert (by_round.get_group(1)["bytes_down"] == body + head).all()
    assert (by_round.get_group(1)["bytes_up"] == body + head + 8).all()
    assert (by_round.get_group(beta)["bytes_up"] == body + 8).all()  # no head: round beta + 1 is FedPer
    assert (by_round.get_group(3)["bytes_down"] == body).all()
    assert (by_round.get_group(3)["bytes_up"] == body + 8).all()

    diagnostics = diagnostics_of(result)
    assert sorted(diagnostics["distance"]) == [1, 2]  # stage-1 rounds only
    distance, chosen = diagnostics["distance"][beta], diagnostics["collaborators"][beta]
    candidates = diagnostics["candidates"][beta]
    assert ((chosen <= candidates) & (np.diag(candidates) == 0)).all()
    for k in range(6):  # at t = beta the threshold is the minimum distance (eq. 4)
        others = np.delete(distance[k], k)
        assert (distance[k][chosen[k] == 1] == others.min()).all()

    written = pfedkit_report(result.run_dir)
    assert {p.name for p in written} >= {"pfedcs_distance.png", "pfedcs_collaborators.png",
                                        "pfedcs_collaborator_count.png"}
    assert all(p.stat().st_size > 0 for p in written)


def pfedkit_report(run_dir):
    from pfedkit.report.run_report import report_run
    return report_run(run_dir)


def test_partial_participation_compares_only_the_rounds_participants(tmp_path):
    config = run_config(tmp_path, join_ratio=0.5, rounds=3, pfedcs={"beta": 3})
    first = pfedkit.run(config)
    np.random.seed(99)
    torch.manual_seed(99)  # global random state must not matter
    second = pfedkit.run(config)
    pd.testing.assert_frame_equal(first.metrics, second.metrics)
    metrics = first.metrics
    for rnd, distance in diagnostics_of(first)["distance"].items():
        joined = sorted(metrics[(metrics["round"] == rnd) & (metrics["participated"] == 1)]["client"])
        assert sorted(np.flatnonzero(~np.isnan(distance).all(axis=1))) == joined
        assert np.isnan(distance[np.ix_(joined, joined)]).sum() == 0
    written = pfedkit_report(first.run_dir)
    assert any(p.name.startswith("pfedcs_distance_round") for p in written)


def test_processes_backend_gives_the_same_run(tmp_path):
    """The KL loss and its teacher context cross process boundaries (picklable, no closures)."""
    config = run_config(tmp_path, num_clients=4, rounds=2, pfedcs={"beta": 1})
    sequential = pfedkit.run({**config, "out_dir": str(tmp_path / "s")})
    processes = pfedkit.run({**config, "backend": "processes", "workers": 2, "out_dir": str(tmp_path / "p")})
    assert (sequential.run_dir / "metrics.csv").read_bytes() == (processes.run_dir / "metrics.csv").read_bytes()
