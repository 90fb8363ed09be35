"""pFedFDA: the LDA head is the Bayes rule of the Gaussians, the local estimates and the
interpolation by hand, beta = 0 gives the global Gaussian classifier and beta = 1 the local one,
the cross-validation folds, beta minimising the cross-validated loss, the global statistics as the
n_i-weighted pool of the adaptive ones, the evaluated model, and the run on digits."""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from conftest import TinyNet, learned_run, num_parameters, tiny_params

from pfedkit.algorithms.pfedfda import (COVARIANCE, MEANS, PFedFDA, class_priors, cross_validation_loss, estimate_beta,
                                        gaussian_estimates, interpolated, lda_classifier, stratified_folds)
from pfedkit.core.contract import ClientData, Setup
from pfedkit.core.model_ops import ModelOps
from pfedkit.core.params import select

D, C = 4, 3  # TinyNet: 3 inputs -> 4 features -> 3 classes


def spd(dim: int, generator: torch.Generator, dtype=torch.float32) -> torch.Tensor:
    a = torch.randn(dim, dim, generator=generator, dtype=dtype)
    return a @ a.T + 0.5 * torch.eye(dim, dtype=dtype)


def test_the_lda_head_is_the_bayes_rule_of_the_shared_covariance_gaussians():
    generator = torch.Generator().manual_seed(0)
    means, covariance = torch.randn(C, D, generator=generator, dtype=torch.float64), spd(D, generator, torch.float64)
    priors, z = torch.tensor([0.5, 0.2, 0.3], dtype=torch.float64), torch.randn(6, D, generator=generator, dtype=torch.float64)
    weight, bias = lda_classifier(means, covariance, priors, eps=0.0)
    inverse = torch.linalg.inv(covariance)
    log_joint = torch.stack([torch.stack([priors[c].log() - 0.5 * (x - means[c]) @ inverse @ (x - means[c])
                                          for c in range(C)]) for x in z])  # log pi_c + log N(x; mu_c, Sigma) + const
    torch.testing.assert_close(F.log_softmax(z @ weight.T + bias, dim=1), F.log_softmax(log_joint, dim=1))
    eps = 0.3  # the shrinkage: the same rule with (1 - eps) Sigma + eps tr(Sigma)/d I
    shrunk = (1 - eps) * covariance + eps * torch.trace(covariance) / D * torch.eye(D, dtype=torch.float64)
    torch.testing.assert_close(lda_classifier(means, covariance, priors, eps), lda_classifier(means, shrunk, priors, 0.0))


def test_the_priors_are_the_class_shares_floored_by_eps():
    torch.testing.assert_close(class_priors(np.array([3, 0, 1]), 0.1), torch.tensor([0.85, 0.1, 0.35]) / 1.3)


def test_the_local_estimates_keep_own_means_only_above_k_samples_and_pool_the_scatter():
    features = torch.tensor([[1.0, 2.0], [3.0, 0.0], [2.0, 2.0], [2.0, 0.0], [5.0, 5.0], [7.0, 3.0], [0.0, 1.0]])
    labels = torch.tensor([0, 0, 0, 0, 1, 1, 2])
    fallback = torch.tensor([[9.0, 9.0], [6.0, 5.0], [1.0, 1.0]])
    means, covariance = gaussian_estimates(features, labels, fallback, min_samples=2, eps=0.01)
    expected_means = torch.tensor([[2.0, 1.0], [6.0, 5.0], [1.0, 1.0]])  # classes 1, 2: 2 and 1 samples, not > 2
    torch.testing.assert_close(means, expected_means)
    centred = features - expected_means[labels]
    scatter = sum(torch.outer(row, row) for row in centred)
    torch.testing.assert_close(covariance, scatter / 6 + 0.01 + torch.eye(2))


def test_beta_0_is_the_global_statistics_beta_1_the_local_and_between_the_mix():
    generator = torch.Generator().manual_seed(1)
    local = (torch.randn(C, D, generator=generator), spd(D, generator))
    global_ = (torch.randn(C, D, generator=generator), spd(D, generator))
    assert all(torch.equal(a, b) for a, b in zip(interpolated(torch.zeros(2), local, global_), global_))
    assert all(torch.equal(a, b) for a, b in zip(interpolated(torch.ones(2), local, global_), local))
    means, covariance = interpolated(torch.tensor([0.25, 0.75]), local, global_)
    torch.testing.assert_close(means, 0.25 * local[0] + 0.75 * global_[0])
    torch.testing.assert_close(covariance, 0.75 * local[1] + 0.25 * global_[1])


def test_the_folds_are_stratified_disjoint_seeded_and_leave_out_classes_too_small_to_split():
    labels = torch.tensor([0] * 5 + [1] * 4 + [2])
    folds = stratified_folds(labels, 2, torch.Generator().manual_seed(2))
    again = stratified_folds(labels, 2, torch.Generator().manual_seed(2))
    assert all(torch.equal(a, b) for a, b in zip(folds, again))
    assert sorted(torch.cat(folds).tolist()) == list(range(9))  # disjoint; the lone class-2 sample left out
    assert sorted([int((labels[f] == 0).sum()) for f in folds]) == [2, 3] and all(int((labels[f] == 1).sum()) == 2 for f in folds)


def separable_features(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    labels = torch.arange(60) % C
    centres = 4.0 * torch.eye(C, D)
    return centres[labels] + 0.5 * torch.randn(60, D, generator=generator), labels


def test_beta_minimises_the_cross_validated_loss_and_trusts_local_means_when_the_global_ones_are_wrong():
    features, labels = separable_features(3)
    wrong_global = (-4.0 * torch.eye(C, D).flip(0), torch.eye(D))  # the classes' means permuted
    priors = class_priors(np.bincount(labels.numpy(), minlength=C), 1e-4)
    beta = estimate_beta(features, labels, wrong_global, priors, folds=2, eps=1e-4, single=False,
                         generator=torch.Generator().manual_seed(4))
    assert beta[0] > 0.9 and ((beta >= 0) & (beta <= 1)).all()

    held_out = stratified_folds(labels, 2, torch.Generator().manual_seed(4))
    splits = []
    for positions in held_out:
        train = torch.cat([p for p in held_out if p is not positions])
        splits.append((gaussian_estimates(features[train], labels[train], wrong_global[0], 2, 1e-4),
                       features[positions], labels[positions]))
    best = cross_validation_loss(beta, splits, wrong_global, priors, 1e-4)
    for b_mean in (0.0, 0.5, 1.0):
        for b_cov in (0.0, 0.5, 1.0):
            assert best <= cross_validation_loss(torch.tensor([b_mean, b_cov]), splits, wrong_global, priors, 1e-4) + 1e-4


def test_beta_is_zero_when_no_class_can_be_split():
    features, labels = torch.randn(3, D), torch.tensor([0, 1, 2])
    beta = estimate_beta(features, labels, (torch.zeros(C, D), torch.eye(D)), torch.full((C,), 1 / C), folds=2,
                         eps=1e-4, single=True, generator=torch.Generator().manual_seed(0))
    assert torch.equal(beta, torch.zeros(2))


class TinyNetWithFeatureDim(TinyNet):
    feature_dim = D  # what the package's models declare; pFedFDA sizes its statistics by it


def algorithm(**hyper) -> PFedFDA:
    counts, ops = np.array([[3, 0, 1], [1, 1, 2]]), ModelOps(TinyNetWithFeatureDim)
    return PFedFDA(PFedFDA.Hyper(**hyper), Setup(2, C, counts, seed=0, local_epochs=1, ops=ops))


def run_update(algo: PFedFDA, shared: dict, cid: int = 0):
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(5))
    data = ClientData(cid, x, torch.tensor([0, 0, 0, 2]), torch.zeros(1, 3), torch.zeros(1), np.array([3, 0, 1]))
    update = algo.client_update(1, cid, {}, {"params": shared}, data)
    request = next(update)
    trained = {n: v + 0.5 for n, v in request.params.items()}
    try:
        update.send(trained)
    except StopIteration as stop:
        state, reply = stop.value
    body = torch.relu(x @ trained["body.0.weight"].T + trained["body.0.bias"])  # the trained body's features
    return request, trained, state, reply, body, data


def test_the_body_trains_under_the_frozen_global_gaussian_head_and_beta_0_uploads_the_global_statistics():
    algo = algorithm(fixed_beta=0.0)
    shared = algo.init_server(tiny_params(6))["shared"]
    request, trained, state, reply, _, _ = run_update(algo, shared)
    assert request.trainable == "body"
    weight, bias = lda_classifier(shared[MEANS], shared[COVARIANCE], class_priors(np.array([3, 0, 1]), 1e-4), 1e-4)
    assert torch.equal(request.params["head.weight"], weight) and torch.equal(request.params["head.bias"], bias)
    assert torch.equal(reply["params"][MEANS], shared[MEANS]) and torch.equal(reply["params"][COVARIANCE], shared[COVARIANCE])
    assert reply["weight"] == 4 and set(reply["params"]) == set(shared)
    assert torch.equal(reply["params"]["body.0.weight"], trained["body.0.weight"])
    evaluated = algo.client_model(0, {"shared": shared}, state)  # the global Gaussian classifier on the own body
    assert torch.equal(evaluated["head.weight"], weight) and torch.equal(evaluated["body.0.weight"], trained["body.0.weight"])


def test_beta_1_uploads_the_local_estimates_of_the_trained_bodys_features():
    algo = algorithm(fixed_beta=1.0)
    shared = algo.init_server(tiny_params(7))["shared"]
    _, _, state, reply, features, data = run_update(algo, shared)
    means, covariance = gaussian_estimates(features, data.y_train, shared[MEANS], 2, 1e-4)
    torch.testing.assert_close(reply["params"][MEANS], means)
    torch.testing.assert_close(reply["params"][COVARIANCE], covariance)
    assert torch.equal(state["means"], reply["params"][MEANS]) and torch.equal(state["beta"], torch.ones(2))


def test_right_after_training_the_client_predicts_with_its_adaptive_head_not_the_frozen_global_one():
    """`eval_point=after_local_training`: the trained body with the head of the statistics just
    fitted (beta 1: the local ones), as `client_model` later gives, not the Fit's frozen head."""
    algo = algorithm(fixed_beta=1.0)
    shared = algo.init_server(tiny_params(7))["shared"]
    request, trained, state, _, _, _ = run_update(algo, shared)
    right_after = algo.trained_model(0, state, trained)
    weight, bias = lda_classifier(state["means"], state["covariance"], class_priors(np.array([3, 0, 1]), 1e-4), 1e-4)
    torch.testing.assert_close(right_after["head.weight"], weight)
    torch.testing.assert_close(right_after["head.bias"], bias)
    assert torch.equal(right_after["body.0.weight"], trained["body.0.weight"])
    assert not torch.allclose(right_after["head.weight"], request.params["head.weight"])


def test_the_global_statistics_are_the_n_i_weighted_pool_of_the_uploads():
    algo = algorithm()
    shared = algo.init_server(tiny_params(8))["shared"]
    uploads = [{n: v + k for n, v in shared.items()} for k in (1.0, 5.0)]
    server = algo.aggregate(1, {"shared": shared}, {0: {"params": uploads[0], "weight": 3},
                                                     1: {"params": uploads[1], "weight": 1}})
    for name in (MEANS, COVARIANCE):
        torch.testing.assert_close(server["shared"][name], (3 * uploads[0][name] + uploads[1][name]) / 4)


def test_a_client_that_never_trained_evaluates_the_global_body_and_gaussian_classifier_with_its_priors():
    algo = algorithm()
    shared = algo.init_server(tiny_params(9))["shared"]
    model = algo.client_model(1, {"shared": shared}, algo.init_client(1, tiny_params(9)))
    weight, bias = lda_classifier(shared[MEANS], shared[COVARIANCE], class_priors(np.array([1, 1, 2]), 1e-4), 1e-4)
    assert torch.equal(model["head.bias"], bias) and torch.equal(model["body.0.weight"], shared["body.0.weight"])


def test_pfedfda_learns_on_digits(small_config):
    _, metrics, state = learned_run({**small_config, "algorithm": "pfedfda", "join_ratio": 0.75})
    shared_bytes = 4 * num_parameters(state.server["shared"])
    joined = metrics[(metrics["round"] >= 1) & (metrics["participated"] == 1)]
    assert (joined["bytes_up"] == shared_bytes + 8).all() and (joined["bytes_down"] == shared_bytes).all()
    assert all(set(client) in ({"body", "means", "covariance", "beta"}, set()) for client in state.clients)
