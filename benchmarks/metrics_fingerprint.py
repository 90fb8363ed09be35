"""Every algorithm's metrics.csv on a fixed small config, to check a refactor changes no number.

    python benchmarks/metrics_fingerprint.py OUT_DIR [BACKEND [ALGORITHM ...]]   # record (before the change)
    python benchmarks/metrics_fingerprint.py OUT2 && for f in OUT_DIR/*.csv; do cmp -s $f OUT2/$(basename $f) || echo DIFF $f; done

Each registered algorithm runs 3 rounds on the embedded `digits` dataset (6 clients, seed 3, one
thread) and its metrics.csv is copied to OUT_DIR/<algorithm>.csv. Byte-identical files before and
after a change mean the change kept every number (on the same machine: kernels differ by CPU).
"""
from __future__ import annotations

import shutil
import sys
import tempfile
import warnings
from pathlib import Path

from pfedkit.algorithms import algorithm_names
from pfedkit.runs import run


def main(out: Path, backend: str = "sequential", *only: str) -> None:
    warnings.simplefilter("ignore")
    out.mkdir(parents=True, exist_ok=True)
    for name in only or algorithm_names():
        with tempfile.TemporaryDirectory() as tmp:
            try:
                result = run({"algorithm": name, "dataset": "digits", "rounds": 3, "num_clients": 6, "seed": 3,
                              "backend": backend, "out_dir": tmp, "threads": 1})
            except Exception as err:  # a failing algorithm is a finding, not the end of the check
                print(f"{name} FAILED: {type(err).__name__}: {str(err)[:200]}", flush=True)
                continue
            shutil.copy(Path(result.run_dir) / "metrics.csv", out / f"{name}.csv")
            print(f"{name} ok", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), *sys.argv[2:])
