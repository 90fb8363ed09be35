"""Client sampling per round (pfedkit/core/seeds.py): the fixed-size draws are unchanged, and
`participants=poisson` lets each training client join independently with probability join_ratio."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

import pfedkit
from pfedkit.config import load_config
from pfedkit.core.errors import ConfigError
from pfedkit.core.seeds import round_participants, sample_clients

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_fixed_size_draws_are_the_ones_before_poisson_existed():
    # Values produced by the sampler of commit a808e21 (before `poisson`): the default draw is unchanged.
    assert sample_clients(0, 1, 10, 0.3) == [2, 3, 8]
    assert sample_clients(3, 2, 20, 0.33, "floor") == [0, 1, 2, 3, 6, 10]
    assert sample_clients(7, 5, 4, 0.5) == [1, 3]
    assert sample_clients(0, 1, 4, 1.0) == [0, 1, 2, 3]


def test_poisson_join_frequency_is_join_ratio_and_the_count_varies():
    n, q, rounds = 20, 0.3, 2000
    joined = np.zeros((rounds, n), dtype=bool)
    for rnd in range(1, rounds + 1):
        chosen = sample_clients(11, rnd, n, q, "poisson")
        assert chosen == sorted(set(chosen)) and all(0 <= c < n for c in chosen)
        joined[rnd - 1, chosen] = True
    # mean over 40000 Bernoulli(0.3) draws: std 0.0023; each client over 2000: std 0.010
    assert abs(joined.mean() - q) < 0.01
    assert np.all(np.abs(joined.mean(axis=0) - q) < 0.05)
    counts = joined.sum(axis=1)
    assert counts.min() < round(q * n) < counts.max()  # not a fixed-size draw
    assert abs(counts.var() - n * q * (1 - q)) < 0.5  # binomial(N, q) spread, not m fixed
    # joins are independent across clients: the pairwise correlation is ~0 (std ~ 1 / sqrt(2000))
    corr = np.corrcoef(joined.T.astype(float))
    assert np.abs(corr[~np.eye(n, dtype=bool)]).max() < 0.1


def test_poisson_is_seeded_and_join_ratio_one_takes_everyone():
    first = [sample_clients(4, rnd, 12, 0.4, "poisson") for rnd in range(1, 30)]
    assert first == [sample_clients(4, rnd, 12, 0.4, "poisson") for rnd in range(1, 30)]
    assert first != [sample_clients(5, rnd, 12, 0.4, "poisson") for rnd in range(1, 30)]
    assert sample_clients(4, 1, 12, 1.0, "poisson") == list(range(12))


def test_poisson_rounds_sample_only_training_clients_with_the_shared_draw(tmp_path):
    config = {"algorithm": "fedavg", "dataset": "digits", "num_clients": 6, "new_clients": 2, "rounds": 4,
              "join_ratio": 0.5, "participants": "poisson", "threads": 1, "seed": 3, "out_dir": str(tmp_path)}
    result = pfedkit.run(config)
    rows = result.metrics
    new = set(rows.loc[rows["new_client"] == 1, "client"]) if "new_client" in rows else set()
    training = [cid for cid in range(6) if cid not in new]
    assert len(training) == 4
    sizes = set()
    for rnd in range(1, 5):
        chosen = sorted(rows.loc[(rows["round"] == rnd) & (rows["participated"] == 1), "client"])
        assert set(chosen) <= set(training)
        assert chosen == round_participants(3, rnd, training, 0.5, "poisson")
        sizes.add(len(chosen))
    again = pfedkit.run({**config, "name": "again"})
    pd.testing.assert_frame_equal(again.metrics.drop(columns=["train_seconds", "eval_seconds"], errors="ignore"),
                                  rows.drop(columns=["train_seconds", "eval_seconds"], errors="ignore"))


def test_a_round_nobody_joins_leaves_fedavg_unchanged(tmp_path):
    # seed 0, 10 clients, q = 0.2: round 3's Poisson draw is empty
    assert sample_clients(0, 3, 10, 0.2, "poisson") == []
    result = pfedkit.run({"algorithm": "fedavg", "dataset": "digits", "num_clients": 10, "rounds": 3,
                          "join_ratio": 0.2, "participants": "poisson", "threads": 1, "seed": 0,
                          "out_dir": str(tmp_path)})
    rows = result.metrics
    assert rows.loc[rows["round"] == 3, "participated"].sum() == 0
    by_round = rows[rows["round"] >= 2].groupby("round")["correct"].sum()
    assert by_round[3] == by_round[2]  # the server's model did not move: every client sees the same one


def test_participants_accepts_poisson_and_refuses_others_in_one_line():
    assert load_config(None, ["participants=poisson"]).participants == "poisson"
    with pytest.raises(ConfigError) as err:
        load_config(None, ["participants=bernoulli"])
    assert "\n" not in str(err.value) and "participants" in str(err.value) and "poisson" in str(err.value)
