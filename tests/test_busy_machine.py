"""On a machine whose cores other jobs hold, pfedkit's OpenMP threads wait passively; on an idle
one they spin briefly (pfedkit.openmp_waiting).

Spinning OpenMP threads (libgomp's default between parallel regions) made a 3-round FedAvg
take 116-186 s on a loaded server instead of 8.8 s; how threads wait must change no number.
"""
from __future__ import annotations

import os
import subprocess
import sys

from pfedkit import openmp_waiting


def _python(code: str, **env: str) -> str:
    environment = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    environment.update(env)
    return subprocess.run([sys.executable, "-c", code], env=environment, capture_output=True, text=True,
                          check=True).stdout.strip()


SHOW = "import os; print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'))"


def test_a_loaded_machine_waits_passively_an_idle_one_spins_briefly():
    assert openmp_waiting(load=8.3, cores=2) == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert openmp_waiting(load=2.0, cores=2) == {"OMP_WAIT_POLICY": "PASSIVE"}  # every core held by others
    assert openmp_waiting(load=0.4, cores=2) == {"GOMP_SPINCOUNT": "10000"}
    assert openmp_waiting(load=3.0, cores=16) == {"GOMP_SPINCOUNT": "10000"}


def test_importing_pfedkit_first_chooses_how_openmp_threads_wait():
    chosen = _python(f"import pfedkit, torch; {SHOW}")
    assert chosen in ("PASSIVE None", "None 10000")


def test_a_users_own_setting_is_kept():
    assert _python(f"import pfedkit; {SHOW}", OMP_WAIT_POLICY="ACTIVE") == "ACTIVE None"
    assert _python(f"import pfedkit; {SHOW}", GOMP_SPINCOUNT="5") == "None 5"


def test_a_process_that_loaded_torch_first_is_left_as_it_is():
    """libgomp has read the environment already: setting it now would only mislead."""
    assert _python(f"import torch, pfedkit; {SHOW}") == "None None"


def test_passive_and_spinning_threads_give_identical_metrics(tmp_path):
    """threads=2: OpenMP parallel regions do run (a 1-thread run never waits for a pool), in the
    main process (algorithm code) and in the worker."""
    args = ["run", "-q", "backend=processes", "threads=2", "workers=1", "rounds=2", "num_clients=3",
            "algorithm=fedprox"]
    metrics = []
    for policy in ("ACTIVE", "PASSIVE"):
        out = tmp_path / policy
        environment = {**{k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}, "OMP_WAIT_POLICY": policy}
        subprocess.run([sys.executable, "-m", "pfedkit.cli", *args, f"out_dir={out}"], env=environment,
                       check=True, capture_output=True)
        (run_dir,) = out.iterdir()
        metrics.append((run_dir / "metrics.csv").read_text())
    assert metrics[0] == metrics[1]
