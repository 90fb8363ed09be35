"""Backends run the same algorithm definitions with identical results."""
from __future__ import annotations

import pytest

import pfedkit


@pytest.mark.parametrize("algorithm", ["fedavg", "fedprox", "local"])
def test_processes_backend_equals_sequential_with_same_threads(algorithm, small_config, tmp_path):
    config = {**small_config, "algorithm": algorithm, "join_ratio": 0.75}
    sequential = pfedkit.run({**config, "backend": "sequential", "threads": 1, "out_dir": str(tmp_path / "s")})
    processes = pfedkit.run({**config, "backend": "processes", "workers": 2, "out_dir": str(tmp_path / "p")})
    assert (sequential.run_dir / "metrics.csv").read_bytes() == (processes.run_dir / "metrics.csv").read_bytes()


def test_worker_count_does_not_change_results(small_config, tmp_path):
    one = pfedkit.run({**small_config, "backend": "processes", "workers": 1, "out_dir": str(tmp_path / "1")})
    three = pfedkit.run({**small_config, "backend": "processes", "workers": 3, "out_dir": str(tmp_path / "3")})
    assert (one.run_dir / "metrics.csv").read_bytes() == (three.run_dir / "metrics.csv").read_bytes()
