"""FedAvgM and the FedOpt family (FedAdam, FedYogi, FedAdagrad): FedAvgM with beta = 0 and eta = 1
is FedAvg; each server's first steps (moments and model) against hand computations on the
n_i-weighted mean; Yogi's v update differs from Adam's exactly as Reddi et al. state; the
streamed aggregation is the batch one; the clients and their traffic are FedAvg's."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import pfedkit
from pfedkit.algorithms.fedopt import (FedAdagrad, FedAdam, FedAvgM, FedYogi, adam_second_moment,
                                       yogi_second_moment)
from pfedkit.core.contract import Setup

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# Two participants: n = 1 and 3, so the n_i-weighted mean is (y_0 + 3 y_1) / 4.
X = {"w": torch.tensor([1.0, 2.0])}
REPLIES = {0: {"params": {"w": torch.tensor([3.0, 2.0])}, "weight": 1},
           3: {"params": {"w": torch.tensor([0.6, 1.6])}, "weight": 3}}
MEAN = torch.tensor([1.2, 1.7])        # uniform: [1.8, 1.8]
PSEUDO_GRADIENT = torch.tensor([-0.2, 0.3])  # x - mean (Hsu); Reddi's Delta = mean - x = [0.2, -0.3]


def built(cls, **options):
    counts = np.array([[1], [5], [5], [3]])  # client 0: 1 sample, client 3: 3 samples
    return cls(cls.Hyper(**options), Setup(4, 1, counts, seed=0, local_epochs=1, ops=None))


def first_step(cls, **options) -> dict:
    algorithm = built(cls, **options)
    return algorithm.aggregate(1, algorithm.init_server(X), REPLIES)


def close(actual: torch.Tensor, expected: list[float]) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected), rtol=1e-6, atol=1e-6)


# --- FedAvgM --------------------------------------------------------------------------------------

def test_fedavgm_first_steps_by_hand():
    """Round 1 from v = 0: v = g = x - mean, x <- x - eta v; round 2 adds beta v."""
    server = first_step(FedAvgM, beta=0.5, server_lr=2.0)
    close(server["momentum"]["w"], [-0.2, 0.3])
    close(server["params"]["w"], [1.4, 1.4])                    # [1, 2] - 2 * [-0.2, 0.3]
    algorithm = built(FedAvgM, beta=0.5, server_lr=2.0)
    second = algorithm.aggregate(2, server, {1: {"params": {"w": torch.tensor([1.0, 1.0])}, "weight": 5}})
    close(second["momentum"]["w"], [0.3, 0.55])                 # 0.5 * [-0.2, 0.3] + ([1.4, 1.4] - [1, 1])
    close(second["params"]["w"], [0.8, 0.3])                    # [1.4, 1.4] - 2 * [0.3, 0.55]


def test_fedavgm_nesterov_steps_along_the_gradient_plus_beta_v():
    server = first_step(FedAvgM, beta=0.5, server_lr=2.0, nesterov=True)
    close(server["params"]["w"], [1.6, 1.1])                    # [1, 2] - 2 * ([-0.2, 0.3] + 0.5 * [-0.2, 0.3])


def test_fedavgm_without_momentum_and_unit_server_lr_is_fedavg(small_config):
    fedavgm = pfedkit.run({**small_config, "algorithm": "fedavgm", "fedavgm": {"beta": 0.0, "server_lr": 1.0},
                           "join_ratio": 0.75, "out_dir": small_config["out_dir"] + "/m"})
    fedavg = pfedkit.run({**small_config, "join_ratio": 0.75, "out_dir": small_config["out_dir"] + "/a"})
    # x - (x - mean) is the mean up to float rounding
    for column in ("accuracy", "loss", "bytes_up", "bytes_down"):
        np.testing.assert_allclose(fedavgm.metrics[column], fedavg.metrics[column], rtol=0, atol=1e-5)


def test_fedavgm_momentum_changes_the_run(small_config):
    """beta = 0.9 (the default) moves the server off FedAvg's path from round 2 on (round 1 is the same
    step from v = 0)."""
    fedavgm = pfedkit.run({**small_config, "algorithm": "fedavgm", "out_dir": small_config["out_dir"] + "/m"})
    fedavg = pfedkit.run({**small_config, "out_dir": small_config["out_dir"] + "/a"})
    first = fedavg.metrics["round"] == 1
    np.testing.assert_allclose(fedavgm.metrics.loc[first, "loss"], fedavg.metrics.loc[first, "loss"], atol=1e-5)
    assert not np.allclose(fedavgm.metrics.loc[~first, "loss"], fedavg.metrics.loc[~first, "loss"], atol=1e-3)


# --- FedOpt ----------------------------------------------------------------------------------------

def test_fedadam_first_step_by_hand():
    """Delta = [0.2, -0.3]; m = 0.1 Delta; v = 0.99 tau^2 + 0.01 Delta^2 with tau = 0.1;
    x <- x + 0.5 m / (sqrt(v) + tau)."""
    server = first_step(FedAdam, server_lr=0.5, tau=0.1)
    close(server["m"]["w"], [0.02, -0.03])
    close(server["v"]["w"], [0.0103, 0.0108])
    v = torch.tensor([0.0103, 0.0108])
    close(server["params"]["w"], (torch.tensor([1.0, 2.0]) + 0.5 * torch.tensor([0.02, -0.03]) / (v.sqrt() + 0.1)).tolist())


def test_fedyogi_first_step_by_hand():
    """v_{-1} = tau^2 = 0.01 lies below Delta^2 = [0.04, 0.09], so v grows by (1 - beta2) Delta^2:
    v = 0.01 + 0.01 Delta^2 = [0.0104, 0.0109] (Adam: [0.0103, 0.0108])."""
    server = first_step(FedYogi, server_lr=0.5, tau=0.1)
    close(server["m"]["w"], [0.02, -0.03])
    close(server["v"]["w"], [0.0104, 0.0109])
    v = torch.tensor([0.0104, 0.0109])
    close(server["params"]["w"], (torch.tensor([1.0, 2.0]) + 0.5 * torch.tensor([0.02, -0.03]) / (v.sqrt() + 0.1)).tolist())


def test_fedadagrad_first_step_by_hand():
    """No server momentum by default (m = Delta); v = tau^2 + Delta^2 with tau = 0.1."""
    server = first_step(FedAdagrad, server_lr=0.5, tau=0.1)
    close(server["m"]["w"], [0.2, -0.3])
    close(server["v"]["w"], [0.05, 0.1])
    v = torch.tensor([0.05, 0.1])
    close(server["params"]["w"], (torch.tensor([1.0, 2.0]) + 0.5 * torch.tensor([0.2, -0.3]) / (v.sqrt() + 0.1)).tolist())


def test_initial_v_replaces_tau_squared():
    server = first_step(FedAdagrad, server_lr=0.5, tau=0.1, initial_v=0.0)
    close(server["v"]["w"], [0.04, 0.09])


def test_second_step_decays_the_first_moment():
    algorithm = built(FedAdam, server_lr=0.5, tau=0.1, beta1=0.5)
    server = algorithm.aggregate(1, algorithm.init_server(X), REPLIES)
    close(server["m"]["w"], [0.1, -0.15])
    x = server["params"]["w"]
    second = algorithm.aggregate(2, server, {1: {"params": {"w": x + torch.tensor([0.4, 0.4])}, "weight": 5}})
    close(second["m"]["w"], [0.25, 0.125])                      # 0.5 * [0.1, -0.15] + 0.5 * [0.4, 0.4]


def test_yogi_moves_v_by_a_fraction_of_delta_squared_adam_by_a_fraction_of_the_gap():
    """Reddi et al.: v_t - v_{t-1} = -(1 - beta2) Delta^2 sign(v_{t-1} - Delta^2) for Yogi,
    -(1 - beta2) (v_{t-1} - Delta^2) for Adam; both on either side of Delta^2."""
    beta2 = 0.9
    v = torch.tensor([0.5, 0.5, 0.01, 2.0])
    delta = torch.tensor([0.1, -1.0, 0.3, 0.0])
    squared = delta ** 2                                        # [0.01, 1, 0.09, 0]
    torch.testing.assert_close(yogi_second_moment(v, delta, beta2=beta2) - v,
                               torch.tensor([-0.001, 0.1, 0.009, 0.0]))
    torch.testing.assert_close(adam_second_moment(v, delta, beta2=beta2) - v, -(1 - beta2) * (v - squared))
    torch.testing.assert_close(adam_second_moment(v, delta, beta2=beta2) - v, torch.tensor([-0.049, 0.05, 0.008, -0.2]))


@pytest.mark.parametrize("cls", [FedAvgM, FedAdam, FedYogi, FedAdagrad])
def test_streamed_aggregation_is_the_batch_one(cls):
    """Replies folded as they come (any order) give `aggregate`'s state bit for bit."""
    algorithm = built(cls)
    server = algorithm.init_server(X)
    streamed = algorithm.start_aggregation(1, server, [0, 3])
    streamed.add(3, REPLIES[3])
    streamed.add(0, REPLIES[0])
    batch = algorithm.aggregate(1, server, REPLIES)
    result = streamed.finish()
    assert result.keys() == batch.keys()
    for key in batch:
        assert torch.equal(result[key]["w"], batch[key]["w"]), key


def test_the_server_step_uses_the_sample_weighted_mean():
    """With beta = 0 and eta = 1 FedAvgM's model is the n_i-weighted mean, not the uniform one."""
    close(first_step(FedAvgM, beta=0.0, server_lr=1.0)["params"]["w"], MEAN.tolist())


@pytest.mark.parametrize("algorithm", ["fedadam", "fedyogi", "fedadagrad"])
def test_adaptive_servers_learn_with_fedavg_traffic(algorithm, small_config):
    """The clients are FedAvg's: the same bytes each round; the moments never leave the server."""
    run = pfedkit.run({**small_config, "algorithm": algorithm, "rounds": 5, "out_dir": small_config["out_dir"] + "/o"})
    fedavg = pfedkit.run({**small_config, "rounds": 5, "out_dir": small_config["out_dir"] + "/a"})
    assert run.metrics[["bytes_up", "bytes_down"]].equals(fedavg.metrics[["bytes_up", "bytes_down"]])
    last = run.metrics[run.metrics["round"] == 5]["accuracy"].mean()
    assert last > 0.3
