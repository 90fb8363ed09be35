"""Shared test fixtures: small fast configs and the path of the shared datasets."""
from __future__ import annotations

from pathlib import Path

import pandas as pd
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


def interrupt_and_resume(config: dict, tmp_path, monkeypatch, after_round: int = 2):
    """Run `config` uninterrupted, then again with a crash after `after_round` rounds, then resume
    the crashed run. Returns (uninterrupted result, crashed run directory, rounds done before the
    crash, resumed result)."""
    import pfedkit
    from pfedkit.engine.simulate import Simulation

    reference = pfedkit.run({**config, "out_dir": str(tmp_path / "ref")})
    original = Simulation.run_round

    def crash(self, state):
        if state.round == after_round:
            raise KeyboardInterrupt
        return original(self, state)

    monkeypatch.setattr(Simulation, "run_round", crash)
    with pytest.raises(KeyboardInterrupt):
        pfedkit.run({**config, "out_dir": str(tmp_path / "killed")})
    monkeypatch.setattr(Simulation, "run_round", original)
    (run_dir,) = (tmp_path / "killed").iterdir()
    completed_rounds = pd.read_csv(run_dir / "metrics.csv")["round"].max()
    return reference, run_dir, completed_rounds, pfedkit.run(resume=run_dir)
