"""Backends run the same algorithm definitions with identical results."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import pfedkit
from pfedkit.core.contract import Fit
from pfedkit.engine.trainer import FitJob, LocalTrainer, TrainSettings


BASELINES_I = ["fedper", "lg_fedavg", "fedrep", "fedbabu", "fedrod", "fedpac", "fedgh", "ditto", "apfl",
               "perfedavg", "pfedme", "l2gd"]
BASELINES_II = ["fedproto", "feddistill", "fednh", "creff", "moon", "feduv", "fedamp", "fedfomo", "fedpfa", "cfl",
                "ifca", "fesem", "fedsoft"]

# Server-side loops shortened where they dominate a 3-round digits run (the math is the same).
SHORTER = {"creff": {"creff": {"retrain_epochs": 20, "feature_steps": 20}}}


@pytest.mark.parametrize("algorithm", ["fedavg", "fedprox", "local", "fedrema", "cwfedavg", "dapfl", "pfedpm", "rpfedpm",
                                       *BASELINES_I, *BASELINES_II])
def test_processes_backend_equals_sequential_with_same_threads(algorithm, small_config, tmp_path):
    config = {**small_config, "algorithm": algorithm, "join_ratio": 0.75, **SHORTER.get(algorithm, {})}
    sequential = pfedkit.run({**config, "backend": "sequential", "threads": 1, "out_dir": str(tmp_path / "s")})
    processes = pfedkit.run({**config, "backend": "processes", "workers": 2, "out_dir": str(tmp_path / "p")})
    assert (sequential.run_dir / "metrics.csv").read_bytes() == (processes.run_dir / "metrics.csv").read_bytes()


def test_worker_count_does_not_change_results(small_config, tmp_path):
    one = pfedkit.run({**small_config, "backend": "processes", "workers": 1, "out_dir": str(tmp_path / "1")})
    three = pfedkit.run({**small_config, "backend": "processes", "workers": 3, "out_dir": str(tmp_path / "3")})
    assert (one.run_dir / "metrics.csv").read_bytes() == (three.run_dir / "metrics.csv").read_bytes()


def test_dropout_masks_do_not_depend_on_global_random_state():
    """Dropout masks are seeded per job, so results do not depend on which clients a process
    trained before (sequential vs workers)."""
    class DropoutNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5))
            self.head = nn.Linear(8, 2)

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        params = {k: v.detach().clone() for k, v in DropoutNet().named_parameters()}
    trainer = LocalTrainer(DropoutNet, TrainSettings(1, 5, 0.1, seed=1))
    x, y = torch.randn(20, 4), torch.randint(0, 2, (20,))
    job = FitJob(1, 0, 0, Fit(params), None)
    first = trainer.fit(job, x, y).params
    torch.rand(100)  # another client's training would move the global generator
    second = trainer.fit(job, x, y).params
    assert all(torch.equal(first[k], second[k]) for k in first)
    other_client = trainer.fit(FitJob(1, 1, 0, Fit(params), None), x, y).params
    assert any(not torch.equal(first[k], other_client[k]) for k in first)
