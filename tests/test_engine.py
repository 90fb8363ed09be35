"""Engine invariants: FedProx(mu=0) == FedAvg, one client == centralized SGD, Local sends nothing,
bytes are counted from the messages, and runs are reproducible and resumable."""
from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F

import pfedkit
from pfedkit.config import load_config
from pfedkit.core.seeds import sample_clients
from pfedkit.engine.state import read_checkpoint
from pfedkit.runs import CHECKPOINT, prepare

from conftest import interrupt_and_resume, num_parameters


def final_server_params(result) -> dict:
    return read_checkpoint(result.run_dir / CHECKPOINT).state.server["params"]


def test_fedprox_with_mu_zero_equals_fedavg(small_config):
    fedavg = pfedkit.run(small_config)
    fedprox = pfedkit.run({**small_config, "algorithm": "fedprox", "fedprox": {"mu": 0.0}})
    a, b = final_server_params(fedavg), final_server_params(fedprox)
    assert all(torch.equal(a[name], b[name]) for name in a)
    pd.testing.assert_frame_equal(fedavg.metrics, fedprox.metrics)


def test_fedprox_with_positive_mu_differs_from_fedavg(small_config):
    fedavg = pfedkit.run(small_config)
    fedprox = pfedkit.run({**small_config, "algorithm": "fedprox", "fedprox": {"mu": 1.0}})
    a, b = final_server_params(fedavg), final_server_params(fedprox)
    assert any(not torch.equal(a[name], b[name]) for name in a)


def test_one_client_full_batch_equals_centralized_gradient_descent(small_config):
    config = {**small_config, "num_clients": 1, "rounds": 4, "batch_size": 10_000, "lr": 0.1,
              "partition": {"scheme": "iid"}}
    result = pfedkit.run(config)
    prepared = prepare(load_config(config))
    client = prepared.data.clients[0]
    model = prepared.simulation.algorithm.setup.ops.build()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(4):
        optimizer.zero_grad()
        F.cross_entropy(model(client.x_train), client.y_train).backward()
        optimizer.step()
    federated = final_server_params(result)
    for name, tensor in model.named_parameters():
        torch.testing.assert_close(federated[name], tensor.detach(), rtol=1e-5, atol=1e-6)


def test_local_never_communicates(small_config):
    result = pfedkit.run({**small_config, "algorithm": "local"})
    assert result.summary["bytes_up"] == 0 and result.summary["bytes_down"] == 0
    assert (result.metrics["bytes_up"] == 0).all() and (result.metrics["bytes_down"] == 0).all()


def test_fedavg_bytes_are_the_model_size_per_participant(small_config):
    result = pfedkit.run({**small_config, "join_ratio": 0.5})
    model_bytes = 4 * num_parameters(final_server_params(result))
    joined = result.metrics[result.metrics["participated"] == 1]
    absent = result.metrics[result.metrics["participated"] == 0]
    assert (joined["bytes_down"] == model_bytes).all()
    assert (joined["bytes_up"] == model_bytes + 8).all()  # + the sample count n_i
    assert (absent["bytes_up"] == 0).all() and (absent["bytes_down"] == 0).all()
    assert len(joined) == 2 * small_config["rounds"]


def test_metrics_have_one_row_per_round_and_client(small_config):
    result = pfedkit.run({**small_config, "eval_every": 2})
    assert len(result.metrics) == 4 * 3
    assert sorted(result.metrics.groupby(["round", "client"]).size().unique()) == [1]
    evaluated = result.metrics.dropna(subset=["accuracy"])["round"].unique()
    assert list(evaluated) == [2, 3]  # every 2nd round, and always the last


def test_federated_training_learns_digits(small_config):
    result = pfedkit.run({**small_config, "rounds": 8})
    assert result.summary["final_acc"] > 0.5  # chance is 0.1


def test_same_config_and_seed_gives_identical_metrics_files(small_config, tmp_path):
    first = pfedkit.run({**small_config, "out_dir": str(tmp_path / "a")})
    second = pfedkit.run({**small_config, "out_dir": str(tmp_path / "b")})
    assert (first.run_dir / "metrics.csv").read_bytes() == (second.run_dir / "metrics.csv").read_bytes()
    third = pfedkit.run({**small_config, "seed": 4, "out_dir": str(tmp_path / "c")})
    assert (first.run_dir / "metrics.csv").read_bytes() != (third.run_dir / "metrics.csv").read_bytes()


def test_resume_after_interruption_equals_uninterrupted_run(small_config, tmp_path, monkeypatch):
    config = {**small_config, "rounds": 5, "algorithm": "local"}
    reference, run_dir, completed_rounds, resumed = interrupt_and_resume(config, tmp_path, monkeypatch)
    assert completed_rounds == 2
    assert (run_dir / "metrics.csv").read_bytes() == (reference.run_dir / "metrics.csv").read_bytes()
    assert resumed.summary["final_acc"] == reference.summary["final_acc"]


def test_resume_after_sigkill_equals_uninterrupted_run(tmp_path):
    # threads pinned: float results depend on the thread count, and the two runs are separate processes
    args = ["rounds=40", "num_clients=4", "batch_size=5", "seed=1", "algorithm=fedprox", "threads=1"]
    reference = pfedkit.run(None, args + [f"out_dir={tmp_path / 'ref'}"])
    out = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-m", "pfedkit.cli", "run", "-q", *args, f"out_dir={out}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    while time.time() < deadline and not list(out.glob("*/metrics.csv")):
        time.sleep(0.02)
    proc.kill()
    proc.wait()
    (run_dir,) = out.iterdir()
    pfedkit.run(resume=run_dir)
    assert (run_dir / "metrics.csv").read_bytes() == (reference.run_dir / "metrics.csv").read_bytes()


def test_client_sampling_is_seeded_and_sized():
    first = sample_clients(seed=7, rnd=3, num_clients=20, join_ratio=0.4)
    assert first == sample_clients(seed=7, rnd=3, num_clients=20, join_ratio=0.4)
    assert len(first) == 8 and first == sorted(set(first))
    assert first != sample_clients(seed=7, rnd=4, num_clients=20, join_ratio=0.4)


def test_run_directory_holds_the_record(small_config):
    result = pfedkit.run(small_config)
    names = {p.name for p in result.run_dir.iterdir()}
    assert {"config.yaml", "partition.npz", "metrics.csv", "summary.json", "checkpoints"} <= names
    with np.load(result.run_dir / "partition.npz") as saved:
        sizes = [len(saved[f"train_{c}"]) for c in range(4)]
    assert sizes == result.metrics.groupby("client")["n_train"].first().tolist()
    for key in ("algorithm", "dataset", "rounds", "best_round", "best_acc", "last5_acc", "final_acc",
                "bytes_up", "bytes_down", "seconds"):
        assert key in result.summary
