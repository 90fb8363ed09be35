"""DA-PFL (spec seed-algorithms.md §5): the checkable properties of §5.10, the public functions
`affinity` and `aggregation_weights`, and a short end-to-end run on digits with join_ratio=0.5."""
from __future__ import annotations

from functools import partial

import numpy as np
import pytest
import torch

import pfedkit
from pfedkit.core.contract import Fit, Forward, cross_entropy, message_bytes
from pfedkit.algorithms.dapfl import (adjusted_cosine, affinity, aggregation_weights, local_objective,
                                      log_one_minus_exp_neg, overlapping_class_vectors,
                                      pairwise_squared_distances, raw_affinity, resolve_sigma)
from pfedkit.config import load_config
from pfedkit.core.errors import ConfigError
from pfedkit.core.params import flatten, squared_distance
from pfedkit.engine.trainer import FitJob
from pfedkit.report.methods import draw_diagnostics
from pfedkit.run_files import read_diagnostics
from pfedkit.runs import prepare

from conftest import num_parameters

CONFIG = {"algorithm": "dapfl", "dataset": "digits", "num_clients": 4, "rounds": 3, "batch_size": 20,
          "lr": 0.05, "seed": 3, "threads": 1, "partition": {"scheme": "dirichlet", "alpha": 0.5}}


@pytest.fixture
def prepared(tmp_path):
    return prepare(load_config({**CONFIG, "out_dir": str(tmp_path)}))


def random_counts(seed: int, clients: int = 8, classes: int = 10) -> np.ndarray:
    rng = np.random.default_rng(seed)
    counts = rng.integers(1, 60, size=(clients, classes))
    counts[rng.random((clients, classes)) < 0.45] = 0
    return counts


def shifted(params: dict, value: float) -> dict:
    return {name: tensor + value for name, tensor in params.items()}


# --- §5.10 property 1: the normalised affinity matrix -----------------------------------------

def test_affinity_is_symmetric_with_offdiagonal_entries_in_unit_interval():
    for seed in range(5):
        c = affinity(random_counts(seed))
        off = ~np.eye(len(c), dtype=bool)
        np.testing.assert_array_equal(c, c.T)
        assert (c[off] >= 0).all() and (c[off] <= 1).all()
        assert c[off].min() == 0 and c[off].max() == 1  # min-max normalisation spans [0, 1]
        assert (np.diag(c) == 0).all()


def test_pairs_without_a_shared_class_get_the_minimum():
    counts = np.array([[5, 9, 0, 0], [0, 0, 4, 7], [3, 3, 3, 3], [8, 1, 2, 0]])
    minmax = affinity(counts)
    assert minmax[0, 1] == minmax[1, 0] == 0.0
    scaled = affinity(counts, normalisation="max")  # keeps them positive: the minimum, not 0
    off = ~np.eye(4, dtype=bool)
    assert scaled[0, 1] == scaled[1, 0] == pytest.approx(scaled[off].min())
    assert scaled[0, 1] > 0
    raw_overlapping = [raw_affinity(counts[i], counts[j]) for i in range(4) for j in range(i + 1, 4)
                       if (i, j) != (0, 1)]
    assert scaled[0, 1] == pytest.approx(min(raw_overlapping) / max(raw_overlapping))


def test_no_overlap_row_min_option_uses_the_rows_own_minimum():
    counts = np.array([[5, 9, 0, 0], [0, 0, 4, 7], [3, 3, 3, 3], [8, 1, 2, 0]])
    raw = lambda i, j: raw_affinity(counts[i], counts[j])  # noqa: E731
    c = affinity(counts, normalisation="max", no_overlap="row_min")
    top = max(raw(i, j) for i in range(4) for j in range(4) if i != j and raw(i, j) is not None)
    assert c[0, 1] == pytest.approx(min(raw(0, 2), raw(0, 3)) / top)
    assert c[1, 0] == pytest.approx(min(raw(1, 2), raw(1, 3)) / top)


def test_affinity_is_all_ones_when_nothing_distinguishes_the_pairs():
    disjoint = np.array([[4, 0, 0], [0, 5, 0], [0, 0, 6]])
    np.testing.assert_array_equal(affinity(disjoint), 1 - np.eye(3))
    identical = np.array([[4, 2, 7]] * 3)
    np.testing.assert_array_equal(affinity(identical), 1 - np.eye(3))


def test_affinity_rejects_bad_input():
    with pytest.raises(ValueError, match="2-D"):
        affinity(np.array([1, 2, 3]))
    with pytest.raises(ValueError, match="non-negative"):
        affinity(np.array([[1, -2], [3, 4]]))


# --- §5.10 property 2: raw affinity (eq. 3-6) --------------------------------------------------

def test_overlapping_class_vectors_keep_only_shared_classes_in_class_order():
    e_ij, e_ji = overlapping_class_vectors(np.array([3, 0, 5, 2, 7]), np.array([1, 4, 0, 6, 9]))
    np.testing.assert_array_equal(e_ij, [3, 2, 7])
    np.testing.assert_array_equal(e_ji, [1, 6, 9])


def test_identical_counts_give_acs_one_and_affinity_overlap_over_k():
    counts = np.array([5, 3, 0, 1, 0])
    assert adjusted_cosine(*overlapping_class_vectors(counts, counts)) == pytest.approx(1.0)
    assert raw_affinity(counts, counts) == pytest.approx(3 / 5)  # |E| = 3 shared classes, K = 5


def test_mirror_counts_give_acs_minus_one_and_affinity_three_overlap_over_k():
    a, b = np.array([2, 6, 4, 0]), np.array([6, 2, 4, 9])  # common mean 4: (-2, 2, 0) and (2, -2, 0)
    assert adjusted_cosine(*overlapping_class_vectors(a, b)) == pytest.approx(-1.0)
    assert raw_affinity(a, b) == pytest.approx(3 * 3 / 4)


def test_more_shared_classes_with_the_same_acs_give_a_larger_affinity():
    two = raw_affinity(np.array([1, 3, 0, 0]), np.array([3, 1, 0, 0]))
    four = raw_affinity(np.array([1, 3, 1, 3]), np.array([3, 1, 3, 1]))
    assert adjusted_cosine(np.array([1, 3]), np.array([3, 1])) == pytest.approx(
        adjusted_cosine(np.array([1, 3, 1, 3]), np.array([3, 1, 3, 1])))
    assert four == pytest.approx(2 * two) and four > two


def test_adjusted_cosine_centres_by_the_common_mean():
    # Pearson (own means) would give 1; the common mean 6.5 gives -49.5 / 50.5.
    assert adjusted_cosine(np.array([1, 2]), np.array([11, 12])) == pytest.approx(-49.5 / 50.5)


def test_adjusted_cosine_edge_cases_follow_the_spec_and_the_options():
    assert adjusted_cosine(np.array([4, 4]), np.array([4, 4])) == 1.0  # both centred vectors 0
    assert adjusted_cosine(np.array([3, 3]), np.array([1, 5])) == 0.0  # only the first is 0
    assert adjusted_cosine(np.array([4, 4]), np.array([4, 4]), both_constant=-1.0) == -1.0
    assert adjusted_cosine(np.array([3, 3]), np.array([1, 5]), one_constant=0.5) == 0.5


def test_no_shared_class_has_no_raw_affinity():
    assert raw_affinity(np.array([1, 0]), np.array([0, 1])) is None


# --- §5.10 property 3: aggregation weights -----------------------------------------------------

def test_aggregation_weights_are_nonnegative_and_sum_to_one():
    rng = np.random.default_rng(0)
    for _ in range(20):
        m = int(rng.integers(1, 9))
        row = rng.random(m) * (rng.random(m) > 0.3)
        alpha = aggregation_weights(row, rng.random(m) * 10, sigma=float(rng.uniform(0.1, 5)), eps=1e-8)
        assert alpha.shape == (m,) and (alpha >= 0).all()
        assert alpha.sum() == pytest.approx(1.0)


def test_aggregation_weights_unchanged_when_affinity_row_is_scaled():
    row, distances = np.array([0.2, 0.0, 0.7, 1.0]), np.array([0.5, 3.0, 0.01, 2.0])
    alpha = aggregation_weights(row, distances, sigma=1.0, eps=1e-8)
    for factor in (1e-6, 3.0, 1e6):
        np.testing.assert_allclose(aggregation_weights(factor * row, distances, 1.0, 1e-8), alpha, rtol=1e-12)


def initial(prepared) -> dict:
    return prepared.state.clients[0]["params"]


def test_broadcast_weights_exclude_self_and_sum_to_one(prepared):
    algo, server = prepared.simulation.algorithm, prepared.state.server
    base = initial(prepared)
    server = {**server, "uploads": {cid: shifted(base, 0.01 * (cid + 1)) for cid in range(4)}}
    algo.diagnostics = {}
    algo.broadcast(1, server, [0, 2, 3])
    weights = algo.diagnostics["aggregation_weights"][1]
    for cid in (0, 2, 3):
        assert weights[cid, cid] == 0 and weights[cid, 1] == 0  # self and the absent client 1
        assert (weights[cid] >= 0).all() and weights[cid].sum() == pytest.approx(1.0, abs=1e-6)
    assert np.isnan(weights[1]).all()


# --- §5.10 property 4: identical or far-apart models -------------------------------------------

def test_identical_models_give_weights_proportional_to_affinity():
    row = np.array([0.1, 0.4, 0.0, 0.5])
    # round 1: all distances 0; 1 - exp(-1e-8) is exactly 0 in float32, not here
    for sigma in (1e-3, 1.0, 1e6):
        np.testing.assert_allclose(aggregation_weights(row, np.zeros(4), sigma, 1e-8), row / row.sum(), rtol=1e-9)


def test_far_apart_models_give_weights_proportional_to_affinity():
    row = np.array([0.3, 0.2, 0.5])
    alpha = aggregation_weights(row, np.array([1e4, 5e4, 2e5]), sigma=1.0, eps=1e-8)
    np.testing.assert_allclose(alpha, row / row.sum(), rtol=1e-12)


def test_with_equal_affinity_the_more_different_model_gets_more_weight():
    alpha = aggregation_weights(np.ones(3), np.array([0.1, 1.0, 3.0]), sigma=1.0, eps=1e-8)
    assert alpha[0] < alpha[1] < alpha[2]
    expected = -np.expm1(-np.array([0.1, 1.0, 3.0]))
    np.testing.assert_allclose(alpha, expected / expected.sum(), rtol=1e-7)


def test_zero_affinity_row_options_are_explicit():
    distances = np.array([0.5, 2.0, 8.0])
    zero = np.zeros(3)
    np.testing.assert_allclose(aggregation_weights(zero, distances, 2.0, 0.0, "uniform"), np.full(3, 1 / 3))
    theta = 1 - np.exp(-distances / 2.0)  # the distance term alone, by hand
    np.testing.assert_allclose(aggregation_weights(zero, distances, 2.0, 0.0, "distance"), theta / theta.sum())
    with pytest.raises(ValueError, match="zero_affinity"):
        aggregation_weights(zero, distances, 2.0, 0.0, "nearest")


def test_degenerate_rows_fall_back_to_uniform_weights():
    np.testing.assert_allclose(aggregation_weights(np.zeros(3), np.ones(3), 1.0, 1e-8), [1 / 3] * 3)
    np.testing.assert_allclose(aggregation_weights(np.ones(2), np.zeros(2), 1.0, 0.0), [0.5, 0.5])
    assert aggregation_weights(np.zeros(0), np.zeros(0), 1.0, 1e-8).shape == (0,)


def test_log_one_minus_exp_neg_is_accurate_at_both_ends():
    x = np.array([1e-300, 1e-8, 0.5, np.log(2), 3.0, 50.0])
    # log(1 - e^-x) = log x - x/2 + x²/24 - ... for small x
    expected = [np.log(1e-300), np.log(1e-8) - 0.5e-8 + 1e-16 / 24, np.log(1 - np.exp(-0.5)), np.log(0.5), np.log1p(-np.exp(-3.0)),
                -np.exp(-50.0)]
    np.testing.assert_allclose(log_one_minus_exp_neg(x), expected, rtol=1e-12)
    assert log_one_minus_exp_neg(np.array([0.0]))[0] == -np.inf


def test_sigma_median_is_the_median_off_diagonal_squared_distance():
    distances = np.array([[0, 1, 4], [1, 0, 9], [4, 9, 0]], dtype=float)
    assert resolve_sigma("median", distances) == 4.0
    assert resolve_sigma(2.5, distances) == 2.5
    assert resolve_sigma("median", np.zeros((3, 3))) == 1.0  # round 1: any sigma gives alpha ∝ c
    mostly_equal = np.zeros((4, 4))
    mostly_equal[0, 1] = mostly_equal[1, 0] = 2.0
    assert resolve_sigma("median", mostly_equal) == 2.0


def test_hyperparameters_validate_sigma():
    assert load_config({**CONFIG, "dapfl": {"sigma": "median"}}).hyper().sigma == "median"
    with pytest.raises(ConfigError):
        load_config({**CONFIG, "dapfl": {"sigma": 0}}).hyper()
    with pytest.raises(ConfigError):
        load_config({**CONFIG, "dapfl": {"sigma": "mean"}}).hyper()


def test_pairwise_squared_distances_over_all_parameters():
    a = {"body.w": torch.zeros(2, 2), "head.b": torch.zeros(3)}
    b = {"body.w": torch.ones(2, 2), "head.b": torch.full((3,), 2.0)}
    distances = pairwise_squared_distances([a, b, a])
    np.testing.assert_allclose(distances, [[0, 16, 0], [16, 0, 16], [0, 16, 0]])


# --- §5.10 property 5: the proximal local update -----------------------------------------------

def fit(prepared, params, loss, anchor, steps=30):
    trainer, data = prepared.runtime.trainer, prepared.data.clients[0]
    job = FitJob(1, 0, 0, Fit(params, loss=loss, steps=steps, context={"anchor": anchor}), None)
    return trainer.fit(job, data.x_train, data.y_train).params


def test_lambda_zero_is_plain_local_sgd(prepared):
    start = initial(prepared)
    anchor = shifted(start, 0.5)
    with_zero = fit(prepared, start, partial(local_objective, lam=0.0), anchor)
    plain = fit(prepared, start, cross_entropy, anchor)
    assert all(torch.equal(with_zero[name], plain[name]) for name in plain)


def test_large_lambda_pulls_the_local_model_to_the_anchor(prepared):
    start = initial(prepared)
    anchor = shifted(start, 0.05)
    initial_gap = float(squared_distance(start, anchor))
    gaps = [float(squared_distance(fit(prepared, start, partial(local_objective, lam=lam), anchor), anchor))
            for lam in (0.0, 1.0, 5.0, 19.0)]  # lr 0.05: lam·lr < 1 keeps SGD stable
    assert gaps == sorted(gaps, reverse=True)
    assert gaps[-1] < 0.01 * initial_gap < gaps[0]


def test_proximal_gradient_is_zero_at_the_anchor():
    anchor = {"body.w": torch.randn(3, 2), "head.b": torch.randn(2)}
    out = Forward(torch.randn(4, 3), torch.randn(4, 2))
    y = torch.tensor([0, 1, 1, 0])
    for at_anchor in (True, False):
        live = {n: (t if at_anchor else t + 0.1).clone().requires_grad_(True) for n, t in anchor.items()}
        proximal = local_objective(out, y, live, {"anchor": anchor}, lam=3.0) - cross_entropy(out, y, live, {})
        grads = torch.autograd.grad(proximal, list(live.values()))
        norm = float(sum((g ** 2).sum() for g in grads))
        assert (norm == 0.0) if at_anchor else norm == pytest.approx(9 * 0.01 * 8)  # (lam·0.1)² · 8 entries


# --- §5.10 property 6: only participants -------------------------------------------------------

def hand_weights(affinity_row, distances_sq, sigma, eps):
    """Eq. 7-8 written out directly: theta = c / sum(c) * (1 - exp(-(d + eps) / sigma)), normalised."""
    theta = [c / sum(affinity_row) * (1 - np.exp(-(d + eps) / sigma)) for c, d in zip(affinity_row, distances_sq)]
    return [t / sum(theta) for t in theta]


def test_each_participant_downloads_the_hand_computed_mix_of_the_others(tmp_path):
    prepared = prepare(load_config({**CONFIG, "dapfl": {"sigma": 40.0}, "out_dir": str(tmp_path)}))
    algo, server, base = prepared.simulation.algorithm, prepared.state.server, initial(prepared)
    models = {0: shifted(base, 0.01), 1: shifted(base, 1e6), 2: shifted(base, 0.02), 3: shifted(base, -0.03)}
    algo.diagnostics = {}
    messages = algo.broadcast(1, {**server, "uploads": models}, [0, 2, 3])
    size = sum(t.numel() for t in base.values())
    offsets = {0: 0.01, 2: 0.02, 3: -0.03}  # ||w_i - w_j||^2 = size * (o_i - o_j)^2
    for cid in (0, 2, 3):
        others = [j for j in (0, 2, 3) if j != cid]
        distances = [size * (offsets[cid] - offsets[j]) ** 2 for j in others]
        alpha = hand_weights([server["affinity"][cid, j] for j in others], distances, 40.0, 1e-8)
        expected = sum(a * flatten(models[j]).double() for a, j in zip(alpha, others))
        torch.testing.assert_close(flatten(messages[cid]["params"]).double(), expected, rtol=1e-6, atol=1e-5)


def test_a_lone_participant_gets_no_download_and_trains_towards_its_own_model(prepared):
    algo = prepared.simulation.algorithm
    algo.diagnostics = {}
    server = {**prepared.state.server, "uploads": {2: initial(prepared)}}
    assert algo.broadcast(1, server, [2]) == {2: {}}


def test_local_training_starts_from_the_clients_own_model_pulled_to_the_mix(prepared):
    algo, data = prepared.simulation.algorithm, prepared.data.clients[1]
    own, mix = {"params": shifted(initial(prepared), 0.3)}, {"params": shifted(initial(prepared), -0.2)}
    request = next(algo.client_update(1, 1, own, mix, data))
    assert request.params is own["params"]
    assert request.context["anchor"] is mix["params"]


def test_each_client_is_evaluated_with_its_own_personalised_model(tmp_path):
    prepared = prepare(load_config({**CONFIG, "join_ratio": 0.5, "out_dir": str(tmp_path)}))
    sim, state = prepared.simulation, prepared.state
    for _ in range(2):
        sim.run_round(state)
    evaluator = prepared.runtime.evaluator
    for cid, client in enumerate(prepared.data.clients):
        own = evaluator.evaluate(state.clients[cid]["params"], None, client.x_test, client.y_test)
        row = [r for r in state.rows if r["round"] == 2 and r["client"] == cid][0]
        assert row["correct"] == own.correct


def test_non_participants_models_are_unchanged_and_the_server_keeps_no_model(tmp_path):
    prepared = prepare(load_config({**CONFIG, "join_ratio": 0.5, "out_dir": str(tmp_path)}))
    sim, state = prepared.simulation, prepared.state
    for _ in range(2):
        before = [dict(client["params"]) for client in state.clients]
        report = sim.run_round(state)
        for cid in range(4):
            same = all(torch.equal(before[cid][n], state.clients[cid]["params"][n]) for n in before[cid])
            assert same == (cid not in report.participants)
        # between rounds the server holds the affinity [N, N] and the counts [N, K] only
        assert set(state.server) == {"affinity", "class_counts"}
        assert message_bytes(state.server) == 8 * 4 * 4 + 8 * 4 * 10


def test_the_affinity_is_built_from_the_counts_received_in_the_setup_exchange(prepared):
    algo = prepared.simulation.algorithm
    counts = random_counts(5, clients=4)
    server = algo.collect(0, algo.init_server(initial(prepared)),
                          {cid: {"class_counts": counts[cid]} for cid in range(4)})
    np.testing.assert_array_equal(server["affinity"], affinity(counts))
    with pytest.raises(ValueError, match="every client"):
        algo.collect(0, algo.init_server(initial(prepared)), {0: {"class_counts": counts[0]}})


def test_default_sigma_keeps_the_distance_term_alive(tmp_path):
    """At the default settings the weights of round >= 2 are NOT just the affinity row normalised
    (sigma = 1 made them so: the paper's ablation V2)."""
    result = pfedkit.run({**CONFIG, "rounds": 3, "out_dir": str(tmp_path)})
    diagnostics = read_diagnostics(result.run_dir / "diagnostics.pt")
    matrix = diagnostics["affinity"][0]
    gaps = []
    for rnd in (2, 3):
        weights = diagnostics["aggregation_weights"][rnd]
        for cid in range(4):
            row = np.array([matrix[cid, j] if j != cid else 0.0 for j in range(4)], dtype=np.float64)
            if row.sum() > 0:
                gaps.append(np.abs(weights[cid] - row / row.sum()).max())
    assert max(gaps) > 0.02


# --- end to end --------------------------------------------------------------------------------

def test_end_to_end_digits_half_participation(tmp_path):
    config = {**CONFIG, "join_ratio": 0.5, "out_dir": str(tmp_path),
              "partition": {"scheme": "dirichlet", "alpha": 0.5, "test_split": "official_fraction",
                            "test_fraction": 0.1}}
    result = pfedkit.run(config)
    metrics = result.metrics
    # learns: mean client accuracy well above chance (10 classes) after 3 rounds
    last = metrics[metrics["round"] == 3]
    assert last["accuracy"].mean() > 0.3
    # communication: round 0 = the K int64 class counts of every client, once; then one model up
    # (before the broadcast) and one model down per participation
    model_bytes = 4 * num_parameters(prepare(load_config(config)).state.clients[0]["params"])
    setup = metrics[metrics["round"] == 0]
    assert len(setup) == 4 and (setup["bytes_up"] == 8 * 10).all() and (setup["bytes_down"] == 0).all()
    assert result.summary["bytes_setup"] == 4 * 8 * 10
    trained = metrics[metrics["round"] > 0]
    joined = trained[trained["participated"] == 1].sort_values("round")
    assert (trained.groupby("round")["participated"].sum() == 2).all()
    assert (joined["bytes_down"] == model_bytes).all() and (joined["bytes_up"] == model_bytes).all()
    assert (trained.loc[trained["participated"] == 0, ["bytes_up", "bytes_down"]] == 0).all().all()
    # diagnostics: affinity once (setup), weights rows for each round's participants
    diagnostics = read_diagnostics(result.run_dir / "diagnostics.pt")
    assert list(diagnostics["affinity"]) == [0]
    for rnd, weights in diagnostics["aggregation_weights"].items():
        participants = joined.loc[joined["round"] == rnd, "client"].tolist()
        for cid in range(4):
            if cid in participants:
                assert weights[cid].sum() == pytest.approx(1.0, abs=1e-6) and weights[cid, cid] == 0
            else:
                assert np.isnan(weights[cid]).all()
    written = draw_diagnostics(pfedkit.algorithms.get_algorithm("dapfl"), diagnostics, tmp_path / "report")
    assert {p.name for p in written} >= {"dapfl_affinity.png", "dapfl_aggregation_weights.png"}
    assert all(p.stat().st_size > 0 for p in written)
