"""L2GD: seeded round coins, theta = 1 averages everyone, p = 0 is Local, bytes only when mixing."""
from __future__ import annotations

import numpy as np
import pandas as pd
import torch
from conftest import final_state, num_parameters

import pfedkit
from pfedkit.algorithms.l2gd import is_aggregation_round
from pfedkit.core.params import interpolate


def test_coin_is_seeded_and_has_rate_p():
    coins = [is_aggregation_round(7, rnd, 0.3) for rnd in range(1, 2001)]
    assert coins == [is_aggregation_round(7, rnd, 0.3) for rnd in range(1, 2001)]
    assert abs(np.mean(coins) - 0.3) < 0.04
    assert not any(is_aggregation_round(7, rnd, 0.0) for rnd in range(1, 200))


def test_mixing_step_is_convex_combination():
    out = interpolate({"w": torch.tensor([1.0, 3.0])}, {"w": torch.tensor([5.0, -1.0])}, 0.25)
    torch.testing.assert_close(out["w"], torch.tensor([2.0, 2.0]))


def test_p_zero_is_local(small_config):
    l2gd = pfedkit.run({**small_config, "algorithm": "l2gd", "l2gd": {"p": 0.0}}).metrics
    local = pfedkit.run({**small_config, "algorithm": "local"}).metrics
    pd.testing.assert_frame_equal(l2gd, local)


def test_theta_one_makes_every_model_the_mean_after_an_aggregation_round(small_config):
    seed = small_config["seed"]
    rounds = next(r for r in range(2, 50) if is_aggregation_round(seed, r, 0.5) and not is_aggregation_round(seed, r - 1, 0.5))
    result = pfedkit.run({**small_config, "algorithm": "l2gd", "rounds": rounds, "l2gd": {"p": 0.5, "theta": 1.0}})
    clients = final_state(result).clients
    for client in clients[1:]:
        assert all(torch.equal(client["params"][k], clients[0]["params"][k]) for k in client["params"])
    # before the last round the models differed (local round), so bytes were counted only now
    rows = result.metrics.groupby("round")[["bytes_up", "bytes_down"]].sum()
    model_bytes = 4 * num_parameters(clients[0]["params"]) * small_config["num_clients"]
    assert rows.loc[rounds, "bytes_up"] == model_bytes == rows.loc[rounds, "bytes_down"]
    assert rows.loc[rounds - 1, "bytes_up"] == 0 and rows.loc[rounds - 1, "bytes_down"] == 0


def test_server_mean_is_unweighted():
    from pfedkit.algorithms.l2gd import L2GD

    algo = L2GD(L2GD.Hyper(), None)
    reports = {0: {"params": {"w": torch.tensor([0.0])}}, 3: {"params": {"w": torch.tensor([3.0])}},
               5: {"params": {"w": torch.tensor([9.0])}}}
    torch.testing.assert_close(algo.collect(1, None, reports)["mean"]["w"], torch.tensor([4.0]))
