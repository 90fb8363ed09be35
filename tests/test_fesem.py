"""FeSEM (baselines.md "FeSEM"): K = 1 is FedAvg under full participation, the E-step picks the
nearest centre, the M-step is the n_i-weighted mean, empty centres stay, the centres start from K
clients' trained models, and a short run on digits."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import learned_run, num_parameters, tiny_params

import pfedkit
from pfedkit.algorithms.fesem import FeSEM, draw_initial_centres, e_step, m_step, squared_distances
from pfedkit.core.contract import Setup
from pfedkit.core.errors import ConfigError
from pfedkit.report.methods import draw_diagnostics
from pfedkit.run_files import read_diagnostics

COLUMNS = ["round", "client", "participated", "accuracy", "loss", "train_loss", "train_steps", "bytes_up", "bytes_down"]


def shifted(params: dict, value: float) -> dict:
    return {name: tensor + value for name, tensor in params.items()}


def same(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(torch.equal(a[n], b[n]) for n in a)


def algorithm(k: int = 2, num_clients: int = 4, seed: int = 0) -> FeSEM:
    return FeSEM(FeSEM.Hyper(k=k), Setup(num_clients, 3, np.ones((num_clients, 3)), seed, 1, None))


def test_k1_gives_metrics_identical_to_fedavg_under_full_participation(small_config, tmp_path):
    config = {**small_config, "eval_point": "after_local_training"}  # both then evaluate the trained model
    fedavg = pfedkit.run({**config, "out_dir": str(tmp_path / "a")}).metrics
    fesem = pfedkit.run({**config, "algorithm": "fesem", "fesem": {"k": 1}, "out_dir": str(tmp_path / "b")}).metrics
    assert fedavg["accuracy"].notna().all()
    for column in COLUMNS:
        np.testing.assert_array_equal(fesem[column].to_numpy(), fedavg[column].to_numpy(), err_msg=column)


def test_squared_distances_and_e_step_pick_the_nearest_centre():
    base = tiny_params(0)
    size = num_parameters(base)
    centres = [shifted(base, 0.0), shifted(base, 1.0), shifted(base, -2.0)]
    assert squared_distances(shifted(base, 0.25), centres) == pytest.approx(
        [size * 0.25 ** 2, size * 0.75 ** 2, size * 2.25 ** 2], rel=1e-6)
    models = {3: shifted(base, 0.7), 5: shifted(base, -1.2), 8: shifted(base, 0.1), 9: shifted(base, 0.4)}
    assert e_step(models, centres) == {3: 1, 5: 2, 8: 0, 9: 0}
    twins = [centres[2], centres[1], centres[1]]
    assert e_step({0: shifted(base, 0.9)}, twins) == {0: 1}  # a tie goes to the lowest index


def test_m_step_is_the_n_i_weighted_mean_and_empty_centres_are_unchanged():
    centres = [tiny_params(0), tiny_params(1), tiny_params(2)]
    models = {cid: tiny_params(10 + cid) for cid in range(5)}
    assignment = {0: 1, 1: 1, 2: 0, 3: 1, 4: 0}
    sizes = {0: 10.0, 1: 30.0, 2: 5.0, 3: 60.0, 4: 0.0}  # client 4 never uploaded: no weight
    new = m_step(centres, models, assignment, sizes)
    for name in centres[0]:
        expected = (10 * models[0][name] + 30 * models[1][name] + 60 * models[3][name]) / 100
        torch.testing.assert_close(new[1][name], expected)
        torch.testing.assert_close(new[0][name], models[2][name])
    assert same(new[2], centres[2])  # nobody joined centre 2
    unweighted = m_step(centres, models, {2: 2, 4: 2}, {2: 0.0, 4: 0.0})
    assert same(unweighted[2], centres[2])  # members without n_i do not move it


def test_centres_start_from_k_distinct_uploaders_drawn_with_the_servers_seed():
    chosen = draw_initial_centres(5, 2, [0, 3, 4, 7], 3)
    assert len(set(chosen)) == 3 and set(chosen) <= {0, 3, 4, 7}
    assert chosen == draw_initial_centres(5, 2, [7, 4, 3, 0], 3)  # order of the uploaders does not matter
    draws = {tuple(draw_initial_centres(seed, 2, list(range(10)), 3)) for seed in range(20)}
    assert len(draws) > 10


def test_broadcast_before_and_after_the_centres_are_initialised():
    algo = algorithm(k=2, num_clients=4, seed=1)
    algo.diagnostics = {}
    initial = tiny_params(0)
    server = algo.init_server(initial)
    first = algo.broadcast(1, server, [0, 1, 2, 3])  # nobody uploaded yet: the initial model for all
    assert all(same(message["params"], initial) for message in first.values())
    assert not server["initialised"]
    # clients 0 and 1 uploaded models near +1, clients 2 and 3 near -1
    offsets = {0: 1.0, 1: 1.2, 2: -1.0, 3: -0.8}
    sizes = {0: 10, 1: 30, 2: 20, 3: 20}
    replies = {cid: {"params": shifted(initial, offsets[cid]), "weight": sizes[cid]} for cid in range(4)}
    server = algo.aggregate(1, server, replies)
    messages = algo.broadcast(2, server, [0, 1, 2, 3])
    chosen = algo.diagnostics["centre_init_clients"][2].tolist()
    assert server["initialised"] and len(set(chosen)) == 2
    assignment = algo.diagnostics["cluster_assignment"][2]
    groups = {tuple(np.flatnonzero(assignment == c)) for c in (0, 1)}
    assert chosen == [1, 3]  # seed 1 draws one client on each side: the E-step finds the two groups
    assert groups == {(0, 1), (2, 3)}
    for cid in range(4):  # and each gets its group's n_i-weighted mean (M-step)
        side = [c for c in range(4) if (offsets[c] > 0) == (offsets[cid] > 0)]
        mean = sum(sizes[c] * offsets[c] for c in side) / sum(sizes[c] for c in side)
        torch.testing.assert_close(messages[cid]["params"], shifted(initial, mean))
    # the drawn clients' own models were the centres: each is nearest to its own centre
    for position, cid in enumerate(chosen):
        assert assignment[cid] == position
    assert algo.broadcast(3, server, [1])[1]["params"] is server["centres"][assignment[1]]  # no re-draw


def test_centres_wait_until_k_clients_have_uploaded():
    algo = algorithm(k=3, num_clients=4)
    algo.diagnostics = {}
    initial = tiny_params(0)
    server = algo.aggregate(1, algo.init_server(initial), {2: {"params": shifted(initial, 1.0), "weight": 4}})
    algo.broadcast(2, server, [0, 1])
    assert not server["initialised"] and "centre_init_clients" not in algo.diagnostics


def test_k_larger_than_the_clients_is_refused(small_config):
    from pfedkit.config import load_config
    from pfedkit.runs import prepare

    with pytest.raises(ConfigError, match="fesem.k=5"):
        prepare(load_config({**small_config, "algorithm": "fesem", "fesem": {"k": 5}}))


def test_end_to_end_digits_local_models_bytes_and_report(small_config, tmp_path):
    config = {**small_config, "algorithm": "fesem", "fesem": {"k": 2}, "join_ratio": 0.75}
    result, metrics, state = learned_run(config)
    model_bytes = 4 * num_parameters(state.clients[0]["params"])
    joined = metrics[metrics["participated"] == 1]
    assert (joined["bytes_down"] == model_bytes).all() and (joined["bytes_up"] == model_bytes + 8).all()
    for cid, model in state.server["models"].items():  # the server's copy is the client's local model
        assert same(model, state.clients[cid]["params"])
    diagnostics = read_diagnostics(result.run_dir / "diagnostics.pt")
    for rnd, vector in diagnostics["cluster_assignment"].items():
        participants = joined.loc[joined["round"] == rnd, "client"].tolist()
        assert vector.shape == (4,) and all((vector[c] >= 0) == (c in participants) for c in range(4))
    written = draw_diagnostics(FeSEM, diagnostics, tmp_path / "report")
    assert [p.name for p in written] == ["fesem_clusters.png"] and written[0].stat().st_size > 0


def test_processes_backend_equals_sequential(small_config, tmp_path):
    config = {**small_config, "algorithm": "fesem", "fesem": {"k": 2}, "join_ratio": 0.75}
    sequential = pfedkit.run({**config, "backend": "sequential", "out_dir": str(tmp_path / "s")})
    processes = pfedkit.run({**config, "backend": "processes", "workers": 2, "out_dir": str(tmp_path / "p")})
    assert (sequential.run_dir / "metrics.csv").read_bytes() == (processes.run_dir / "metrics.csv").read_bytes()
