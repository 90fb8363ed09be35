"""Differential privacy (pfedkit/privacy, docs/privacy.md): client-level DP-FedAvg, sample-level
DP-SGD, and the epsilon reported against Opacus' own analysis."""
from __future__ import annotations

import math
import sys

import numpy as np
import pandas as pd
import pytest
import torch
import dp_accounting
from opacus.accountants import PRVAccountant, RDPAccountant
from opacus.accountants.analysis.rdp import compute_rdp, get_privacy_spent
from conftest import quick_options, refusal
from torch import nn

import pfedkit
from pfedkit.algorithms import algorithm_names, get_algorithm
from pfedkit.algorithms.fedavg import FedAvg
from pfedkit.config import load_config
from pfedkit.core.aggregation import MeanOfUploads, SampleWeightedMean
from pfedkit.core.contract import HyperParams, Setup
from pfedkit.core.contract import Fit
from pfedkit.core.errors import ConfigError
from pfedkit.engine.trainer import FitJob, LocalTrainer, TrainSettings
from pfedkit.privacy.accounting import epsilon
from pfedkit.privacy.client_dp import ClientDP, ClientDPAggregation, ClientDPMean, clipped_model, update_norm
from pfedkit.privacy.dp_sgd import batchnorm_layers, batchnorm_to_groupnorm, privatize
from pfedkit.privacy.setup import check_sample_dp, mean_algorithms
from pfedkit.run_files import read_diagnostics

pytestmark = pytest.mark.usefixtures("one_torch_thread")

DELTA = 1e-5


@pytest.fixture
def equal_clients(tmp_path):
    """FedAvg on digits, 4 clients of exactly 60 training samples each (so FedAvg's n_i shares
    equal DP's uniform 1/m), 2 rounds."""
    return {"algorithm": "fedavg", "dataset": "digits", "num_clients": 4, "rounds": 2, "threads": 1,
            "batch_size": 20, "lr": 0.05, "seed": 3, "out_dir": str(tmp_path / "runs"),
            "partition": {"scheme": "iid", "samples_per_client": 80, "stratified": False}}


def model_params(seed: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"body.w": scale * torch.randn(50, 40, generator=gen), "head.b": scale * torch.randn(10, generator=gen)}


def dp_mean(cids, reference, clip, noise, rnd=1, seed=0, expected=None):
    return ClientDPMean("params", cids, reference, lambda mean: mean, None, ClientDP(clip, noise, seed, expected),
                        rnd, lambda *args: None)


def without_replacement_epsilon(z: float, population: int, sampled: int, rounds: int, delta: float = DELTA) -> float:
    """Independently of pfedkit: dp_accounting's RDP analysis of m of N sampled without replacement
    (replace-one). Replacing one client's clipped update moves the sum by up to 2C, so the noise
    z C is z / 2 times the sensitivity."""
    accountant = dp_accounting.rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
    accountant.compose(dp_accounting.SampledWithoutReplacementDpEvent(
        population, sampled, dp_accounting.GaussianDpEvent(z / 2)), rounds)
    return accountant.get_epsilon(delta)


def opacus_epsilon(sigma: float, q: float, steps: int, delta: float = DELTA) -> float:
    """Independently of pfedkit: Opacus' RDP analysis over RDPAccountant's default orders."""
    orders = RDPAccountant.DEFAULT_ALPHAS
    rdp = compute_rdp(q=q, noise_multiplier=sigma, steps=steps, orders=orders)
    return float(get_privacy_spent(orders=orders, rdp=rdp, delta=delta)[0])


# --- client level: clipping, uniform weights, noise ----------------------------------------------

def test_clipped_update_norm_is_at_most_clip_and_small_updates_pass_unchanged():
    reference = model_params(0)
    for scale, clip in [(0.001, 1.0), (0.5, 1.0), (3.0, 0.25), (10.0, 5.0)]:
        upload = {n: reference[n] + scale * t for n, t in model_params(7).items()}
        clipped, norm = clipped_model(upload, reference, clip)
        assert norm == pytest.approx(update_norm(upload, reference))
        assert update_norm(clipped, reference) <= clip * (1 + 1e-6)
        if norm <= clip:
            assert all(clipped[n] is upload[n] for n in upload)  # used as uploaded: bit-exact
        else:  # on the sphere, same direction
            assert update_norm(clipped, reference) == pytest.approx(clip, rel=1e-5)
            cos = sum(((clipped[n] - reference[n]) * (upload[n] - reference[n])).sum() for n in upload)
            assert float(cos) / (clip * norm) == pytest.approx(1.0, abs=1e-5)


@pytest.mark.parametrize("ratio", [1.01, 1.5, 1.99])
def test_an_update_just_beyond_the_bound_is_clipped_to_exactly_the_bound(ratio):
    """Norms between C and 2C: a bound applied at 2C (or a factor of 2C / norm) lets them through."""
    reference, clip = model_params(0), 0.8
    direction = model_params(7)
    scale = ratio * clip / update_norm({n: reference[n] + direction[n] for n in reference}, reference)
    upload = {n: reference[n] + scale * direction[n] for n in reference}
    clipped, norm = clipped_model(upload, reference, clip)
    assert norm == pytest.approx(ratio * clip, rel=1e-5)
    assert update_norm(clipped, reference) == pytest.approx(clip, rel=1e-5)
    for name in reference:  # the same direction: clipped update = (C / norm) * update
        assert torch.allclose(clipped[name] - reference[name], (upload[name] - reference[name]) / ratio,
                              atol=1e-6, rtol=1e-4)
    agg = dp_mean([0], reference, clip, noise=0.0)  # the aggregation path the runs take
    agg.add(0, {"params": upload})
    assert update_norm(agg.finish(), reference) == pytest.approx(clip, rel=1e-5)


def test_aggregate_moves_by_at_most_clip_over_m_per_client_without_noise():
    """One client with a huge update among m = 4 zero updates: the aggregate moves by exactly clip / m."""
    reference, clip, cids = model_params(0), 0.5, [0, 1, 2, 3]
    agg = dp_mean(cids, reference, clip, noise=0.0)
    agg.add(2, {"params": {n: reference[n] + 100 * t for n, t in model_params(9).items()}, "weight": 500})
    for cid in (0, 1, 3):
        agg.add(cid, {"params": reference, "weight": 1})
    assert update_norm(agg.finish(), reference) == pytest.approx(clip / len(cids), rel=1e-5)


def test_client_dp_ignores_sample_size_weights():
    """DP averages uniformly even when FedAvg's n_i shares would differ (n = 10 vs 90): the round's
    aggregation client-level DP gives FedAvg is the uniform mean of the (unclipped) uploads."""
    counts = np.array([[10], [90]])
    algo = FedAvg(HyperParams(), Setup(2, 1, counts, seed=0, local_epochs=1, ops=None))
    private = ClientDPAggregation(ClientDP(clip=math.inf, noise_multiplier=0.0, seed=0), algo)
    reference = model_params(0)
    uploads = {cid: {n: reference[n] + 0.01 * t for n, t in model_params(cid + 5).items()} for cid in (0, 1)}
    agg = private(1, {"params": reference}, [0, 1])
    for cid in (1, 0):
        agg.add(cid, {"params": uploads[cid], "weight": int(counts[cid].sum())})
    result = agg.finish()["params"]
    for name in reference:
        assert torch.allclose(result[name], (uploads[0][name] + uploads[1][name]) / 2, atol=1e-7)


def test_infinite_clip_and_zero_noise_equal_the_uniform_mean_bit_for_bit():
    reference, cids = model_params(0), [0, 2, 5]
    uploads = {cid: model_params(cid + 1) for cid in cids}
    plain = SampleWeightedMean("params", {cid: 1.0 for cid in cids}, lambda mean: mean, None)
    private = dp_mean(cids, reference, math.inf, 0.0)
    for cid in (5, 0, 2):  # any arrival order
        plain.add(cid, {"params": uploads[cid], "weight": 1.0})
        private.add(cid, {"params": uploads[cid], "weight": 123})
    expected, got = plain.finish(), private.finish()
    assert all(torch.equal(expected[n], got[n]) for n in expected)


def test_noise_std_is_noise_multiplier_times_clip_over_m():
    """Zero updates from m = 4 clients, z = 1.5, C = 2: the aggregate is w0 + N(0, (zC/m)^2)."""
    reference = {"body.w": torch.zeros(400, 500)}
    cids, clip, z = [0, 1, 2, 3], 2.0, 1.5
    agg = dp_mean(cids, reference, clip, z)
    for cid in cids:
        agg.add(cid, {"params": reference, "weight": 1})
    noise = agg.finish()["body.w"]
    assert not torch.equal(noise, reference["body.w"])
    assert float(noise.std()) == pytest.approx(z * clip / len(cids), rel=0.01)
    assert abs(float(noise.mean())) < 0.01


def test_noise_is_seeded_by_run_seed_and_round():
    reference = {"body.w": torch.zeros(1000)}

    def noisy(rnd, seed):
        agg = dp_mean([0], reference, 1.0, 1.0, rnd=rnd, seed=seed)
        agg.add(0, {"params": reference, "weight": 1})
        return agg.finish()["body.w"]

    assert torch.equal(noisy(3, 1), noisy(3, 1))
    assert not torch.equal(noisy(3, 1), noisy(4, 1))
    assert not torch.equal(noisy(3, 1), noisy(3, 2))


def test_a_client_that_never_replies_counts_as_a_zero_update():
    reference, cids = model_params(0), [0, 1]
    upload = {n: reference[n] + 0.01 * t for n, t in model_params(4).items()}
    agg = dp_mean(cids, reference, math.inf, 0.0)
    agg.add(0, {"params": upload, "weight": 1})
    result = agg.finish()
    for name in reference:  # denominator stays m = 2
        assert torch.allclose(result[name], (upload[name] + reference[name]) / 2, atol=1e-7)


# --- client level: whole runs ----------------------------------------------------------------------

def test_zero_noise_and_unreachable_clip_reproduce_the_non_private_run(equal_clients):
    plain = pfedkit.run(equal_clients)
    private = pfedkit.run({**equal_clients, "dp": {"level": "client", "clip": 1e30, "noise_multiplier": 0.0}})
    assert plain.metrics.groupby("round").n_train.nunique().eq(1).all()  # the precondition: equal n_i
    on_disk = pd.read_csv(private.run_dir / "metrics.csv")
    assert "epsilon" in on_disk and np.isinf(on_disk["epsilon"]).all()
    assert pd.read_csv(plain.run_dir / "metrics.csv").equals(on_disk.drop(columns="epsilon"))


def test_noisy_run_repeats_exactly_and_differs_from_the_plain_run(equal_clients):
    config = {**equal_clients, "dp": {"level": "client", "clip": 0.5, "noise_multiplier": 0.3}}
    first, second = pfedkit.run(config), pfedkit.run(config)
    plain = pfedkit.run(equal_clients)
    assert pd.read_csv(first.run_dir / "metrics.csv").equals(pd.read_csv(second.run_dir / "metrics.csv"))
    assert not np.array_equal(first.metrics["loss"].dropna(), plain.metrics["loss"].dropna())


def test_fixed_size_sampling_epsilon_equals_dp_accountings_without_replacement(equal_clients):
    config = {**equal_clients, "rounds": 3, "join_ratio": 0.5,
              "dp": {"level": "client", "clip": 1.0, "noise_multiplier": 0.8, "delta": DELTA}}
    result = pfedkit.run(config)
    per_round = pd.read_csv(result.run_dir / "metrics.csv").groupby("round")["epsilon"].agg(["min", "max"])
    assert (per_round["min"] == per_round["max"]).all()
    for rnd in (1, 2, 3):  # m = round(0.5 * 4) = 2 clients sampled of N = 4
        assert per_round.loc[rnd, "max"] == pytest.approx(without_replacement_epsilon(0.8, 4, 2, rnd), rel=1e-9)
    assert result.summary["epsilon"] == pytest.approx(without_replacement_epsilon(0.8, 4, 2, 3), rel=1e-9)
    assert result.summary["dp_client_sampling_rate"] == 2 / 4
    assert result.summary["dp_client_sampling"] == "fixed" and result.summary["dp_adjacency"] == "replace-one"


def test_fixed_size_epsilon_without_subsampling_is_the_gaussian_at_half_the_noise_multiplier():
    """Cross-check of the 2C sensitivity by another library: with m = N there is no subsampling, and
    the replace-one Gaussian mechanism of ratio z / 2 has the RDP curve of Opacus' analysis at q = 1,
    z / 2 (the two libraries' grids of orders differ slightly)."""
    from pfedkit.privacy.accounting import PrivacyBudget

    budget = PrivacyBudget("client", 1.5, DELTA, "rdp", None, lambda rnd: [0, 1, 2, 3], 4)
    for rounds in (1, 5, 20):
        assert budget.epsilon_after([], rounds) == pytest.approx(opacus_epsilon(0.75, 1.0, rounds), rel=0.03)
        assert budget.epsilon_after([], rounds) > 1.5 * opacus_epsilon(1.5, 1.0, rounds)


def test_poisson_sampling_epsilon_equals_opacus_and_the_denominator_is_q_n(equal_clients):
    config = {**equal_clients, "rounds": 3, "join_ratio": 0.5, "participants": "poisson",
              "dp": {"level": "client", "clip": 1.0, "noise_multiplier": 0.8, "delta": DELTA}}
    result = pfedkit.run(config)
    per_round = pd.read_csv(result.run_dir / "metrics.csv").groupby("round")["epsilon"].max()
    for rnd in (1, 2, 3):
        assert per_round[rnd] == pytest.approx(opacus_epsilon(0.8, 0.5, rnd), rel=1e-9)
    assert result.summary["dp_client_sampling"] == "poisson" and result.summary["dp_adjacency"] == "add-remove-one"
    assert result.summary["dp_client_sampling_rate"] == 0.5
    prv = pfedkit.run({**config, "name": "prv", "dp": {**config["dp"], "accountant": "prv"}})
    accountant = PRVAccountant()
    accountant.history = [(0.8, 0.5, 3)]
    assert prv.summary["epsilon"] == pytest.approx(accountant.get_epsilon(DELTA), rel=1e-9)


def test_poisson_mean_divides_by_the_expected_count_and_an_empty_round_is_noised():
    reference = model_params(0)
    uploads = {cid: {name: value + 0.01 * (cid + 1) for name, value in reference.items()} for cid in (1, 2)}
    aggregation = dp_mean([1, 2], reference, clip=1e30, noise=0.0, expected=4.0)
    for cid, upload in uploads.items():
        aggregation.add(cid, {"params": upload, "weight": 123.0})
    mean = aggregation.finish()
    for name in reference:  # w0 + (Delta_1 + Delta_2) / (q N), not / m
        expected = reference[name] + ((uploads[1][name] - reference[name]) + (uploads[2][name] - reference[name])) / 4
        torch.testing.assert_close(mean[name], expected, rtol=0, atol=1e-6)
    empty = dp_mean([], reference, clip=2.0, noise=1.5, expected=4.0).finish()
    noise = torch.cat([(empty[name] - reference[name]).flatten() for name in reference])
    assert noise.std().item() == pytest.approx(1.5 * 2.0 / 4.0, rel=0.06)  # z C / (q N), 2010 draws
    assert abs(noise.mean().item()) < 0.05
    assert dp_mean([], reference, clip=2.0, noise=1.5).finish() is None  # fixed-size: no round without clients


def test_fixed_size_client_dp_refuses_prv_and_a_missing_accountant_names_the_extra(equal_clients, monkeypatch,
                                                                                 tmp_path):
    with pytest.raises(ConfigError) as err:
        pfedkit.run({**equal_clients, "dp": {"level": "client", "accountant": "prv"}})
    assert "\n" not in str(err.value) and "dp.accountant=prv" in str(err.value) and "poisson" in str(err.value)
    monkeypatch.setitem(sys.modules, "dp_accounting", None)  # the import fails as if not installed
    with pytest.raises(ConfigError) as err:
        pfedkit.run({**equal_clients, "dp": {"level": "client"}})
    assert "\n" not in str(err.value) and "pip install 'pfedkit[dp]'" in str(err.value)
    assert not any((tmp_path / "runs").glob("*"))  # refused before any run directory stays
    # Poisson sampling is accounted by Opacus: runs without dp_accounting
    assert pfedkit.run({**equal_clients, "rounds": 1, "participants": "poisson",
                        "dp": {"level": "client"}}).summary["epsilon"] > 0


def test_run_stops_before_a_round_that_would_exceed_target_epsilon(equal_clients, capsys):
    sigma = 2.4  # m = N = 4: no subsampling; replace-one Gaussian at ratio 1.2
    target = (without_replacement_epsilon(sigma, 4, 4, 2) + without_replacement_epsilon(sigma, 4, 4, 3)) / 2
    result = pfedkit.run({**equal_clients, "rounds": 6,
                          "dp": {"level": "client", "noise_multiplier": sigma, "target_epsilon": target}})
    metrics = pd.read_csv(result.run_dir / "metrics.csv")
    assert metrics["round"].max() == 2
    assert metrics.loc[metrics["round"] == 2, "epsilon"].max() <= target
    assert result.summary["rounds_done"] == 2 and result.summary["dp_stopped_early"] is True
    assert result.summary["epsilon"] <= target and result.summary["dp_target_exceeded"] is False
    lines = [line for line in capsys.readouterr().err.splitlines() if "target_epsilon" in line]
    assert len(lines) == 1 and "round 3" in lines[0]


def test_a_round_with_more_dp_sgd_steps_than_predicted_is_reported_past_the_target():
    """Sample level predicts a participant's steps from its previous participation; a method whose
    local work grows (a second stage, say) can pass the target in that round: said, not hidden."""
    from pfedkit.privacy.accounting import PrivacyBudget

    budget = PrivacyBudget("sample", 1.0, DELTA, "rdp", None, lambda rnd: [0], 1, n_train=[100], batch_size=10)
    within, past = budget._epsilon(0.1, 10 + 10), budget._epsilon(0.1, 10 + 40)
    budget.target_epsilon = (within + past) / 2
    rows = [{"round": 1, "client": 0, "train_steps": 10}]
    assert budget.exhausted(rows, 1, [0]) is None  # round 2 predicted at 10 steps: within
    as_predicted = rows + [{"round": 2, "client": 0, "train_steps": 10}]
    assert budget.overshoot(as_predicted, 2) is None and not budget.summary(as_predicted, 2, 2)["dp_target_exceeded"]
    grown = rows + [{"round": 2, "client": 0, "train_steps": 40}]
    line = budget.overshoot(grown, 2)
    assert line is not None and "round 2" in line and f"{past:.4g}" in line
    assert budget.summary(grown, 2, 3)["dp_target_exceeded"] is True
    assert budget.exhausted(grown, 2, [0]) is not None  # and round 3 does not run


def test_sample_level_predicts_a_first_participation_from_local_steps_when_set():
    from pfedkit.privacy.accounting import PrivacyBudget

    def first(**kw) -> int:
        budget = PrivacyBudget("sample", 1.0, DELTA, "rdp", None, lambda rnd: [0], 1, n_train=[95],
                               batch_size=10, local_epochs=3, **kw)
        return budget.expected_steps([], 0)
    assert first() == 3 * 10 and first(drop_last=True) == 3 * 9
    assert first(local_steps=4) == 4 and first(local_steps=40) == 40


def test_prv_accountant_matches_opacus_prv():
    accountant = PRVAccountant()
    accountant.history = [(1.1, 0.1, 50)]
    assert epsilon(1.1, 0.1, 50, DELTA, "prv") == pytest.approx(accountant.get_epsilon(DELTA), rel=1e-9)
    assert epsilon(1.1, 0.1, 0, DELTA) == 0.0 and epsilon(0.0, 0.1, 5, DELTA) == math.inf


# --- refusals and config ---------------------------------------------------------------------------

@pytest.mark.parametrize("algorithm", algorithm_names())
def test_client_dp_attaches_or_refuses_in_one_line(equal_clients, algorithm, tmp_path):
    """Client-level DP either refuses the method before any run directory, in one line naming it and
    the methods it applies to, or runs it through DP's mean: with an unreachable clip and no noise
    that is the plain run (equal n_i: the uniform mean is the n_i-weighted one), with a tiny clip
    the server barely moves, so the numbers change, and the round's clipping diagnostics exist.
    Which of the two: the method's aggregation (`MeanOfUploads`)."""
    config = {**equal_clients, "algorithm": algorithm, **quick_options(algorithm)}
    loose = {**config, "name": "loose", "dp": {"level": "client", "clip": 1e30, "noise_multiplier": 0.0}}
    if not issubclass(get_algorithm(algorithm), MeanOfUploads):
        message = refusal(pfedkit.run, loose)
        assert f"algorithm {algorithm} " in message and message.endswith(f"allowed with: {', '.join(mean_algorithms())}")
        assert not any((tmp_path / "runs").glob("*"))  # refused before any run directory stays
        return
    plain = pd.read_csv(pfedkit.run({**config, "name": "plain"}).run_dir / "metrics.csv")
    private = pd.read_csv(pfedkit.run(loose).run_dir / "metrics.csv")
    assert np.isinf(private["epsilon"]).all() and plain.equals(private.drop(columns="epsilon"))
    tight = pfedkit.run({**loose, "name": "tight", "dp": {**loose["dp"], "clip": 1e-6}})
    assert not np.array_equal(tight.metrics["loss"].dropna(), plain["loss"].dropna())
    diagnostics = read_diagnostics(tight.run_dir / "diagnostics.pt")
    assert set(diagnostics["dp_clipped_fraction"]) == set(range(1, config["rounds"] + 1))


def test_client_dp_applies_exactly_to_the_algorithms_declaring_the_mean_of_uploads():
    """The algorithms whose server keeps the n_i-weighted mean of the uploads (`MeanOfUploads`); a
    subclass cannot aggregate otherwise (tests/test_speed_paths.py)."""
    assert {"fedavg", "fedprox", "fedper", "fedbabu"} <= set(mean_algorithms())
    assert not {"local", "fedamp", "ifca"} & set(mean_algorithms())


@pytest.mark.parametrize("override, key", [("dp.level=both", "dp.level"), ("dp.clip=0", "dp.clip"),
                                           ("dp.delta=1", "dp.delta"), ("dp.accountant=gdp", "dp.accountant"),
                                           ("dp.noise_multiplier=-1", "dp.noise_multiplier"),
                                           ("dp.clp=1", "dp.clp")])
def test_bad_dp_options_are_one_line_errors(override, key):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert "\n" not in str(err.value) and key in str(err.value)


def test_dp_off_keeps_config_yaml_as_before():
    assert "dp" not in load_config(None, []).to_dict()
    assert load_config(None, ["dp.level=client"]).to_dict()["dp"]["level"] == "client"


def test_sample_dp_refuses_batchnorm_and_vectorized():
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8))
    with pytest.raises(ConfigError, match="BatchNorm.*replace_batchnorm"):
        check_sample_dp(load_config(None, ["dp.level=sample"]), model)
    with pytest.raises(ConfigError, match="vectorized"):
        check_sample_dp(load_config(None, ["dp.level=sample", "backend=vectorized"]), nn.Linear(4, 2))


def test_run_with_a_batchnorm_model_is_refused_or_converted(equal_clients, monkeypatch):
    from pfedkit import build  # the model builders live there

    real = build.build_model

    def mlp_with_batchnorm(*args, **kwargs):
        model = real(*args, **kwargs)
        model.body.add_module("bn", nn.BatchNorm1d(200))
        return model

    monkeypatch.setattr(build, "build_model", mlp_with_batchnorm)
    config = {**equal_clients, "rounds": 1, "dp": {"level": "sample"}}
    with pytest.raises(ConfigError) as err:
        pfedkit.run(config)
    assert "\n" not in str(err.value) and "body.bn" in str(err.value)
    converted = pfedkit.run({**config, "dp": {"level": "sample", "replace_batchnorm": True}})
    assert converted.summary["epsilon"] > 0 and np.isfinite(converted.metrics["loss"]).all()


def test_replace_batchnorm_gives_groupnorm_with_the_same_names():
    from pfedkit.models import build_model

    model = build_model("resnet18", (1, 8, 8), 10, head="last")
    names = {n for n, _ in model.named_parameters()}
    converted = batchnorm_to_groupnorm(model)
    assert batchnorm_layers(converted) == [] and {n for n, _ in converted.named_parameters()} == names
    assert isinstance(converted.body.bn1, nn.GroupNorm)
    assert converted(torch.randn(3, 1, 8, 8)).shape == (3, 10)


# --- sample level: DP-SGD ----------------------------------------------------------------------------

def test_privatize_clips_each_sample_and_averages():
    grads = {"w": torch.tensor([[3.0, 4.0], [0.3, 0.4], [0.0, 0.0]])}  # norms 5, 0.5, 0
    out = privatize(grads, clip=1.0, noise_multiplier=0.0, generator=None)["w"]
    expected = (torch.tensor([0.6, 0.8]) * 5 / (5 + 1e-6) + torch.tensor([0.3, 0.4])) / 3
    assert torch.allclose(out, expected, atol=1e-6)
    noisy = privatize({"w": torch.zeros(4, 20000)}, clip=2.0, noise_multiplier=1.5,
                      generator=torch.Generator().manual_seed(0))["w"]
    assert float(noisy.std()) == pytest.approx(1.5 * 2.0 / 4, rel=0.02)  # z C / B


class TinyModel(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(6, 5), nn.ReLU())
        self.head = nn.Linear(5, 3)

    def forward(self, x):
        return self.head(self.body(x))


def fit_once(settings: TrainSettings, x, y, params):
    trainer = LocalTrainer(TinyModel, settings)
    return trainer.fit(FitJob(1, 0, 0, Fit(params), None), x, y)


def test_dp_sgd_without_clip_or_noise_is_sgd_and_with_them_is_seeded():
    x, y = torch.randn(24, 6, generator=torch.Generator().manual_seed(1)), torch.arange(24) % 3
    params = {n: p.detach().clone() for n, p in TinyModel().named_parameters()}
    base = TrainSettings(local_epochs=2, batch_size=8, lr=0.1, seed=0)
    sgd = fit_once(base, x, y, params)
    loose = fit_once(TrainSettings(2, 8, 0.1, seed=0, dp_sample_clip=1e9, dp_sample_noise=0.0), x, y, params)
    for name in params:  # mean of per-sample gradients == the batch gradient of the mean loss
        assert torch.allclose(sgd.params[name], loose.params[name], atol=1e-5)
    assert loose.mean_loss == pytest.approx(sgd.mean_loss, rel=1e-5)
    noisy = TrainSettings(2, 8, 0.1, seed=0, dp_sample_clip=0.1, dp_sample_noise=1.0)
    first, second = fit_once(noisy, x, y, params), fit_once(noisy, x, y, params)
    assert all(torch.equal(first.params[n], second.params[n]) for n in params)
    assert not torch.allclose(first.params["head.weight"], sgd.params["head.weight"], atol=1e-3)


def test_sample_level_epsilon_is_the_worst_clients_opacus_epsilon(equal_clients):
    result = pfedkit.run({**equal_clients, "partition": {"scheme": "dirichlet", "alpha": 1.0}, "rounds": 2,
                          "dp": {"level": "sample", "sample_clip": 1.0, "sample_noise_multiplier": 1.1}})
    metrics = pd.read_csv(result.run_dir / "metrics.csv")
    trained = metrics[metrics["round"] >= 1]
    steps = trained.groupby("client")["train_steps"].sum()
    n_train = trained.groupby("client")["n_train"].first()
    assert n_train.nunique() > 1  # different q_i = B / n_i
    expected = max(opacus_epsilon(1.1, min(1.0, 20 / n_train[c]), int(steps[c])) for c in steps.index)
    assert result.summary["epsilon"] == pytest.approx(expected, rel=1e-9)
    assert metrics.loc[metrics["round"] == 2, "epsilon"].iloc[0] == pytest.approx(expected, rel=1e-9)


def test_calibrated_noise_is_the_smallest_that_keeps_epsilon_within_the_target():
    from opacus.accountants.utils import get_noise_multiplier

    from pfedkit.privacy.accounting import epsilon
    from pfedkit.privacy.calibrate import noise_for_epsilon

    def epsilon_at(z):
        return epsilon(z, 0.2, 50, 1e-5)

    for target in (1.0, 4.0, 8.0):
        z = noise_for_epsilon(epsilon_at, target)
        assert epsilon_at(z) <= target < epsilon_at(z * (1 - 1e-3))
        # Opacus' own calibration (a coarser search of the same accountant) lands within 1%
        assert z == pytest.approx(get_noise_multiplier(target_epsilon=target, target_delta=1e-5, sample_rate=0.2,
                                                       steps=50, accountant="rdp"), rel=1e-2)
    with pytest.raises(ValueError, match="out of reach"):
        noise_for_epsilon(epsilon_at, 1e-9, high=10.0)
