"""The shared pieces of Baselines II: cluster models (clusters.py), peer mixtures (peers.py) and
client-side losses (scoring.py)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pfedkit.algorithms import clusters, peers, scoring
from pfedkit.core.model_ops import ModelOps
from tests.conftest import TinyNet, tiny_params


def const(value: float) -> dict:
    return {"w": torch.full((2,), float(value))}


def test_cluster_means_are_member_weighted_means_and_empty_clusters_keep_their_model():
    models = [const(0), const(100), const(-5)]
    uploads = [const(1), const(2), const(10)]
    weights = clusters.one_hot_weights([0, 1, 0], [1, 3, 3], k=3)
    new = clusters.cluster_means(models, uploads, weights)
    assert torch.allclose(new[0]["w"], torch.full((2,), (1 * 1 + 3 * 10) / 4))  # n_i-weighted, not uniform
    assert torch.equal(new[1]["w"], uploads[1]["w"])
    assert new[2] is models[2]


def test_cluster_means_refuse_bad_weights():
    with pytest.raises(ValueError, match="non-negative"):
        clusters.cluster_means([const(0)], [const(1)], np.array([[-1.0]]))
    with pytest.raises(ValueError, match=r"must be \[1, 1\]"):
        clusters.cluster_means([const(0)], [const(1)], np.ones((2, 1)))
    with pytest.raises(ValueError, match="outside"):
        clusters.one_hot_weights([2], [1], k=2)


def test_seeded_models_start_from_the_run_model_and_differ_reproducibly():
    base = tiny_params(0)
    first = clusters.seeded_models(TinyNet, base, 3, seed=7, purpose="test")
    again = clusters.seeded_models(TinyNet, base, 3, seed=7, purpose="test")
    other_seed = clusters.seeded_models(TinyNet, base, 3, seed=8, purpose="test")
    assert all(torch.equal(first[0][n], base[n]) for n in base)
    assert not torch.equal(first[1]["head.weight"], first[2]["head.weight"])
    assert all(torch.equal(a[n], b[n]) for a, b in zip(first, again) for n in base)
    assert not torch.equal(first[1]["head.weight"], other_seed[1]["head.weight"])


def test_seeded_models_differ_even_when_the_builder_seeds_itself():
    """The run's builder re-seeds inside build() (every instance equal): clusters must still differ."""
    def self_seeding_build():
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            return TinyNet()

    base = dict(self_seeding_build().named_parameters())
    models = clusters.seeded_models(self_seeding_build, base, 2, seed=7, purpose="test")
    assert not torch.equal(models[0]["body.0.weight"], models[1]["body.0.weight"])


def test_nearest_takes_the_smallest_score_and_the_lowest_index_on_ties():
    assert clusters.nearest([3.0, 1.0, 2.0]) == 1
    assert clusters.nearest([1.0, 0.5, 0.5]) == 1
    np.testing.assert_array_equal(clusters.assignment_vector(4, {2: 1, 0: 0}), [0, -1, 1, -1])


def test_mix_is_the_row_weighted_sum_and_rows_must_be_distributions():
    models = [const(1), const(2), const(4)]
    assert torch.allclose(peers.mix(models, [0.5, 0.0, 0.5])["w"], torch.full((2,), 2.5))
    with pytest.raises(ValueError, match="sum to 1"):
        peers.mix(models, [0.5, 0.5, 0.5])
    with pytest.raises(ValueError, match="non-negative"):
        peers.mix(models, [1.5, -0.5, 0.0])
    with pytest.raises(ValueError, match="3 models"):
        peers.mix(models, [1.0])


def test_mixing_matrix_marks_absent_receivers_with_nan():
    matrix = peers.mixing_matrix(3, {0: {1: 0.25, 2: 0.75}, 2: {}})
    assert np.isnan(matrix[1]).all()
    np.testing.assert_allclose(matrix[0], [0, 0.25, 0.75])
    np.testing.assert_array_equal(matrix[2], [0, 0, 0])


def test_sample_losses_are_the_models_cross_entropy_per_sample():
    ops = ModelOps(TinyNet)
    params = tiny_params(3)
    x = torch.randn(5, 3, generator=torch.Generator().manual_seed(0))
    y = torch.tensor([0, 1, 2, 1, 0])
    model = TinyNet()
    model.load_state_dict(params)
    expected = F.cross_entropy(model(x), y, reduction="none").double()
    assert torch.allclose(scoring.sample_losses(ops, params, x, y), expected)
    assert scoring.mean_loss(ops, params, x, y) == pytest.approx(float(expected.mean()))
    assert scoring.mean_loss(ops, params, x[:0], y[:0]) == 0.0
