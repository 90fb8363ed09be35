"""Heterogeneous models (`client_model_options`, pFedPM-mh, spec §2.9): clients with different
conv2 widths exchange only features; parameter-averaging algorithms refuse such configs."""
from __future__ import annotations

import pandas as pd
import pytest
import torch
from conftest import SHARED_DATASETS, needs_dataset

import pfedkit
from pfedkit.cli import main
from pfedkit.config import load_config, per_client_model_options
from pfedkit.core.errors import ConfigError
from pfedkit.engine.state import read_checkpoint
from pfedkit.runs import CHECKPOINT, prepare

WIDTHS = [18, 20, 20, 22]  # conv2 channels of clients 0..3


def mh_config(tmp_path, **extra) -> dict:
    """pFedPM-mh on a small MNIST 3-way 10-shot partition: 4 clients, 2 rounds."""
    config = {"algorithm": "pfedpm", "dataset": "mnist", "data_dir": str(SHARED_DATASETS), "model": "cnn_proto",
              "partition": {"scheme": "nway_kshot", "n": 3, "k": 10, "k_noise": 2},
              "num_clients": 4, "rounds": 2, "seed": 1, "threads": 1, "out_dir": str(tmp_path / "runs"),
              "client_model_options": {"0": {"c2": 18}, "1-2": {"c2": 20}, "3": {"c2": 22}}}
    config.update(extra)
    return config


def test_client_options_merge_over_model_options():
    config = load_config({"algorithm": "local", "num_clients": 5, "model": "cnn_proto", "dataset": "mnist",
                          "model_options": {"c2": 20, "kernel": 5},
                          "client_model_options": {"0-1": {"c2": 18}, 4: {"c2": 22}}})
    assert per_client_model_options(config) == [
        {"c2": 18, "kernel": 5}, {"c2": 18, "kernel": 5}, {"c2": 20, "kernel": 5}, {"c2": 20, "kernel": 5},
        {"c2": 22, "kernel": 5}]
    assert per_client_model_options(load_config({"algorithm": "local"})) is None


@pytest.mark.parametrize("config,key", [
    ({"algorithm": "fedavg", "client_model_options": {"0-3": {}}}, "client_model_options: algorithm fedavg"),
    ({"algorithm": "local", "client_model_options": {"0-5": {}, "4-9": {}}}, "client_model_options.4-9"),
    ({"algorithm": "local", "client_model_options": {"0-10": {}}}, "client_model_options.0-10"),
    ({"algorithm": "local", "client_model_options": {"1-2-3": {}}}, "client_model_options.1-2-3"),
])
def test_bad_client_model_options_raise_one_line_config_error(config, key):
    with pytest.raises(ConfigError) as err:
        load_config(config)
    assert key in str(err.value) and "\n" not in str(err.value)


def test_fedavg_with_client_model_options_exits_2_naming_the_key(tmp_path, capsys):
    out = tmp_path / "runs"
    status = main(["run", "-q", "num_clients=4", 'client_model_options={"0-1": {}}', f"out_dir={out}"])
    err = capsys.readouterr().err.strip()
    assert status == 2 and err.startswith("error: client_model_options:") and "pfedpm" in err
    assert not out.exists()


def test_overlapping_ranges_exit_2(tmp_path, capsys):
    out = tmp_path / "runs"
    status = main(["run", "-q", "algorithm=pfedpm", "num_clients=4",
                   'client_model_options={"0-2": {}, "2-3": {}}', f"out_dir={out}"])
    assert status == 2 and "client_model_options.2-3" in capsys.readouterr().err
    assert not out.exists()


@needs_dataset("mnist")
def test_pfedpm_mh_clients_have_their_own_architectures_and_learn(tmp_path):
    result = pfedkit.run(mh_config(tmp_path, name="seq"))
    state = read_checkpoint(result.run_dir / CHECKPOINT).state
    widths = [client["params"]["body.conv2.weight"].shape[0] for client in state.clients]
    assert widths == WIDTHS
    assert [client["params"]["body.fc1.weight"].shape[1] for client in state.clients] == [16 * w for w in WIDTHS]
    assert state.server["features"].shape == (10, 50)
    # Each client starts from its own architecture's seeded initial weights: same for equal widths.
    prepared = prepare(load_config(mh_config(tmp_path)))
    initial = [client["params"] for client in prepared.state.clients]
    assert initial[1]["body.conv2.weight"].shape[0] == 20
    assert all(torch.equal(initial[1][name], initial[2][name]) for name in initial[1])
    assert prepared.simulation.algorithm.setup.ops_for(3).template.feature_dim == 50
    # 10 classes: chance is 10%; clients see 3-ish classes and learn them in two rounds.
    assert result.summary["best_acc"] > 0.3
    assert result.metrics["bytes_up"].sum() > 0


@needs_dataset("mnist")
def test_pfedpm_mh_sequential_and_processes_agree(tmp_path):
    seq = pfedkit.run(mh_config(tmp_path, name="seq"))
    proc = pfedkit.run(mh_config(tmp_path, name="proc", backend="processes", workers=2))
    pd.testing.assert_frame_equal(seq.metrics, proc.metrics)


@needs_dataset("mnist")
def test_rpfedpm_mh_and_vectorized_backend_run(tmp_path):
    result = pfedkit.run(mh_config(tmp_path, name="rp", algorithm="rpfedpm"))
    assert len(result.metrics) == 2 * 4
    vec = pfedkit.run(mh_config(tmp_path, name="vec", backend="vectorized"))
    state = read_checkpoint(vec.run_dir / CHECKPOINT).state
    assert [client["params"]["body.conv2.weight"].shape[0] for client in state.clients] == WIDTHS
    assert vec.metrics["accuracy"].notna().all()
