"""On a machine whose cores other jobs hold, pfedkit's OpenMP threads wait passively.

Spinning OpenMP threads (libgomp's default between parallel regions) made a 3-round FedAvg
take 116-186 s on a loaded server instead of 8.8 s; passive waiting must change no number.
"""
from __future__ import annotations

import os
import subprocess
import sys


def _python(code: str, **env: str) -> str:
    environment = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    environment.update(env)
    return subprocess.run([sys.executable, "-c", code], env=environment, capture_output=True, text=True,
                          check=True).stdout.strip()


def test_importing_pfedkit_first_makes_openmp_wait_passively():
    assert _python("import pfedkit, torch, os; print(os.environ['OMP_WAIT_POLICY'])") == "PASSIVE"


def test_a_users_own_wait_policy_is_kept():
    assert _python("import pfedkit, os; print(os.environ['OMP_WAIT_POLICY'])", OMP_WAIT_POLICY="ACTIVE") == "ACTIVE"


def test_a_process_that_loaded_torch_first_is_left_as_it_is():
    """libgomp has read the environment already: setting it now would only mislead."""
    assert _python("import torch, pfedkit, os; print(os.environ.get('OMP_WAIT_POLICY'))") == "None"


def test_passive_and_spinning_threads_give_identical_metrics(tmp_path):
    """threads=2: OpenMP parallel regions do run (a 1-thread run never waits for a pool), in the
    main process (algorithm code) and in the worker."""
    args = ["run", "-q", "backend=processes", "threads=2", "workers=1", "rounds=2", "num_clients=3",
            "algorithm=fedprox"]
    metrics = []
    for policy in ("ACTIVE", "PASSIVE"):
        out = tmp_path / policy
        environment = {**os.environ, "OMP_WAIT_POLICY": policy}
        subprocess.run([sys.executable, "-m", "pfedkit.cli", *args, f"out_dir={out}"], env=environment,
                       check=True, capture_output=True)
        (run_dir,) = out.iterdir()
        metrics.append((run_dir / "metrics.csv").read_text())
    assert metrics[0] == metrics[1]
