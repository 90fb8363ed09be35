"""CFL (baselines.md "CFL"): the split rule (never with identical updates, not before the warm-up,
not in small clusters), the split itself (opposite updates -> exactly the two groups), the update
of the cluster models (n_i or uniform), CFL = FedAvg without splits, and a short run on digits."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import final_state, num_parameters, tiny_params

import pfedkit
from pfedkit.algorithms.cfl import CFL, bipartition, cosine_distances, should_split, update_gram, update_norms
from pfedkit.core.contract import Setup
from pfedkit.core.params import flatten
from pfedkit.report.methods import draw_diagnostics
from pfedkit.run_files import read_diagnostics

RULE = {"eps1": 0.4, "eps2": 1.6, "warmup": 20, "min_cluster_size": 2}


def algorithm(num_clients: int = 6, **options) -> CFL:
    algo = CFL(CFL.Hyper(**options), Setup(num_clients, 3, np.ones((num_clients, 3)), 0, 1, None))
    algo.diagnostics = {}
    return algo


def moved(params: dict, direction: dict, scale: float) -> dict:
    return {name: params[name] + scale * direction[name] for name in params}


def opposite_groups(algo: CFL, base: dict, plus=(0, 2, 5), minus=(1, 3, 4), sizes=None):
    """Server state with one cluster at `base`; replies whose updates are +-d (+ a little noise)."""
    direction = {name: torch.randn(value.shape, generator=torch.Generator().manual_seed(1))
                 for name, value in base.items()}
    direction = {name: value / float(flatten(direction).norm()) for name, value in direction.items()}  # ||d|| = 1
    replies = {}
    for cid in plus + minus:
        noise = {n: 0.01 * torch.randn(v.shape, generator=torch.Generator().manual_seed(10 + cid))
                 for n, v in base.items()}
        sign = 1.0 if cid in plus else -1.0
        replies[cid] = {"params": moved(moved(base, direction, 3.0 * sign), noise, 1.0),
                        "weight": (sizes or {}).get(cid, 10)}
    server = algo.init_server(base)
    return server, replies


# --- the split rule ----------------------------------------------------------------------------

def test_identical_updates_never_split():
    base, delta = tiny_params(0), tiny_params(1)
    uploads = [moved(base, delta, 1.0)] * 5
    gram = update_gram(base, uploads)
    mean_norm, max_norm = update_norms(gram, np.array([1.0, 5.0, 2.0, 7.0, 3.0]))
    assert mean_norm == pytest.approx(max_norm, rel=1e-9)
    assert mean_norm == pytest.approx(float(flatten(delta).double().norm()), rel=1e-6)
    for norm in (0.1, 1.0, 10.0):  # mean_norm < eps1 < eps2 < max_norm is impossible
        assert not should_split(norm, norm, 5, 100, **RULE)
    algo = algorithm(5, warmup=0)
    replies = {cid: {"params": uploads[0], "weight": 10 + cid} for cid in range(5)}
    new = algo.aggregate(30, algo.init_server(base), replies)
    assert len(new["models"]) == 1 and (new["membership"] == 0).all()


def test_the_split_rule_needs_every_condition():
    assert should_split(0.3, 2.0, 3, 20, **RULE)
    assert not should_split(0.5, 2.0, 3, 20, **RULE)  # the mean update is still large
    assert not should_split(0.3, 1.5, 3, 20, **RULE)  # no client moves much
    assert not should_split(0.3, 2.0, 2, 20, **RULE)  # |P_c| must exceed min_cluster_size
    assert not should_split(0.3, 2.0, 3, 19, **RULE)  # warm-up


def test_update_norms_follow_the_weights():
    base = {"w": torch.zeros(2)}
    uploads = [{"w": torch.tensor([3.0, 0.0])}, {"w": torch.tensor([0.0, 4.0])}]
    gram = update_gram(base, uploads)
    np.testing.assert_allclose(gram, [[9, 0], [0, 16]])
    assert update_norms(gram, np.array([1.0, 1.0])) == pytest.approx((2.5, 4.0))  # ||(1.5, 2)||
    assert update_norms(gram, np.array([1.0, 3.0])) == pytest.approx((np.hypot(0.75, 3.0), 4.0))


# --- the split ---------------------------------------------------------------------------------

def test_opposite_updates_are_split_into_exactly_those_groups():
    algo = algorithm(7, warmup=20)
    base = tiny_params(0)
    server, replies = opposite_groups(algo, base)  # client 6 belongs to the cluster but does not take part
    new = algo.aggregate(20, server, replies)
    assert new["membership"].tolist() == [0, 1, 0, 1, 1, 0, 0]  # the part with client 0 (and the absent 6) keeps 0
    assert len(new["models"]) == 2
    for c, group in ((0, (0, 2, 5)), (1, (1, 3, 4))):  # each part moves by its own mean update
        expected = sum(flatten(replies[cid]["params"]) for cid in group) / 3
        torch.testing.assert_close(flatten(new["models"][c]), expected)
    assert algo.diagnostics["splits"][20].tolist() == [[0, 1]]
    assert algo.diagnostics["mean_norm"][20][0] < 0.4 < 1.6 < algo.diagnostics["max_norm"][20][0]


def test_no_split_before_the_warmup_and_the_cluster_moves_by_the_weighted_mean():
    algo = algorithm(7, warmup=20)
    base = tiny_params(0)
    sizes = {0: 1, 1: 2, 2: 3, 3: 4, 4: 5, 5: 6}
    server, replies = opposite_groups(algo, base, sizes=sizes)
    new = algo.aggregate(19, server, replies)
    assert len(new["models"]) == 1 and (new["membership"] == 0).all() and 19 not in algo.diagnostics.get("splits", {})
    expected = sum(sizes[c] * flatten(replies[c]["params"]) for c in replies) / sum(sizes.values())
    torch.testing.assert_close(flatten(new["models"][0]), expected)


def test_uniform_update_weighting_averages_the_updates_uniformly():
    algo = algorithm(7, warmup=20, update_weighting="uniform")
    base = tiny_params(0)
    sizes = {0: 1, 1: 2, 2: 3, 3: 4, 4: 5, 5: 60}
    server, replies = opposite_groups(algo, base, sizes=sizes)
    new = algo.aggregate(1, server, replies)
    expected = sum(flatten(replies[c]["params"]) for c in replies) / len(replies)
    torch.testing.assert_close(flatten(new["models"][0]), expected)


def test_a_cluster_with_too_few_participants_is_not_split():
    algo = algorithm(7, warmup=0)
    server, replies = opposite_groups(algo, tiny_params(0), plus=(0,), minus=(1,))
    assert len(algo.aggregate(5, server, replies)["models"]) == 1


def test_only_the_clusters_meeting_the_rule_split_and_each_keeps_its_members():
    algo = algorithm(7, warmup=0, eps1=2.0)  # cluster 0's mean update: (3 - 3 x 3) / 4 = -1.5 d
    base = tiny_params(0)
    server, replies = opposite_groups(algo, base, plus=(0, 4), minus=(1, 5, 6))
    server = {"models": [base, base], "membership": np.array([1, 0, 1, 1, 0, 0, 0])}  # 0 and 2, 3 in cluster 1
    new = algo.aggregate(3, server, {**replies, 3: replies[0]})
    assert new["membership"].tolist() == [1, 0, 1, 1, 2, 0, 0]  # cluster 0 = {1, 4, 5, 6} split off 4
    assert algo.diagnostics["splits"][3].tolist() == [[0, 2]]


def test_bipartition_uses_complete_linkage_on_the_cosine_distance():
    # a chain of angles 0, 45, 100, 180 degrees: single and average linkage join 100 to {0, 45}
    # (min 0.43, mean 0.80 < 0.83 = 1 - cos 80); complete linkage (max 1.17) joins 100 to 180
    angles = np.radians([0.0, 45.0, 100.0, 180.0])
    vectors = np.stack([np.cos(angles), np.sin(angles)], axis=1)
    first, second = bipartition(vectors @ vectors.T)
    assert (first, second) == ([0, 1], [2, 3])
    gram = np.array([[1.0, 0.0], [0.0, 0.0]])  # a zero update: cosine 0, distance 1
    np.testing.assert_allclose(cosine_distances(gram), [[0, 1], [1, 0]])
    with pytest.raises(ValueError):
        bipartition(np.ones((1, 1)))


# --- end to end --------------------------------------------------------------------------------

def test_without_splits_cfl_equals_fedavg(small_config, tmp_path):
    config = {**small_config, "join_ratio": 0.75}
    fedavg = pfedkit.run({**config, "out_dir": str(tmp_path / "a")})
    cfl = pfedkit.run({**config, "algorithm": "cfl", "cfl": {"warmup": 100, "eps1": 1e9, "eps2": 0.0},
                       "out_dir": str(tmp_path / "b")})
    assert (fedavg.run_dir / "metrics.csv").read_bytes() == (cfl.run_dir / "metrics.csv").read_bytes()


def test_end_to_end_digits_with_forced_splits(small_config, tmp_path):
    config = {**small_config, "algorithm": "cfl", "num_clients": 6, "rounds": 3,
              "cfl": {"warmup": 2, "eps1": 1e9, "eps2": 0.0}}  # every cluster with > 2 participants splits
    result = pfedkit.run(config)
    metrics = result.metrics
    assert metrics.loc[metrics["round"] == 3, "accuracy"].mean() > 0.3  # 10 classes
    state = final_state(result)
    model_bytes = 4 * num_parameters(state.server["models"][0])
    assert (metrics["bytes_down"] == model_bytes).all() and (metrics["bytes_up"] == model_bytes + 8).all()
    diagnostics = read_diagnostics(result.run_dir / "diagnostics.pt")
    assert sorted(diagnostics["splits"]) == [2, 3] and diagnostics["splits"][2].tolist() == [[0, 1]]
    assert len(state.server["models"]) == 1 + sum(len(s) for s in diagnostics["splits"].values())
    assert diagnostics["cluster_assignment"][1].tolist() == [0] * 6
    np.testing.assert_array_equal(diagnostics["cluster_assignment"][3], state.server["membership"])
    assert [len(diagnostics["mean_norm"][r]) for r in (1, 2, 3)] == [1, 1, 2]
    written = draw_diagnostics(CFL, diagnostics, tmp_path / "report")
    assert [p.name for p in written] == ["cfl_clusters.png", "cfl_mean_norm.png", "cfl_max_norm.png"]
    assert all(p.stat().st_size > 0 for p in written)


def test_processes_backend_equals_sequential(small_config, tmp_path):
    config = {**small_config, "algorithm": "cfl", "join_ratio": 0.75, "cfl": {"warmup": 2, "eps1": 1e9, "eps2": 0.0}}
    sequential = pfedkit.run({**config, "backend": "sequential", "out_dir": str(tmp_path / "s")})
    processes = pfedkit.run({**config, "backend": "processes", "workers": 2, "out_dir": str(tmp_path / "p")})
    assert (sequential.run_dir / "metrics.csv").read_bytes() == (processes.run_dir / "metrics.csv").read_bytes()
