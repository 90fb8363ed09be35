"""Shared test fixtures: small fast configs and the path of the shared datasets."""
from __future__ import annotations

from pathlib import Path

import pytest

SHARED_DATASETS = Path(__file__).resolve().parents[2] / "shared" / "datasets"


@pytest.fixture
def small_config(tmp_path):
    """FedAvg on digits, 4 clients, 3 rounds: a run takes well under a second."""
    return {"algorithm": "fedavg", "dataset": "digits", "num_clients": 4, "rounds": 3,
            "batch_size": 20, "lr": 0.05, "seed": 3, "out_dir": str(tmp_path / "runs"),
            "partition": {"scheme": "dirichlet", "alpha": 0.5}}


def needs_dataset(name: str):
    return pytest.mark.skipif(not (SHARED_DATASETS / name / f"{name}.npz.xz").is_file(),
                              reason=f"../shared/datasets/{name} not present")
