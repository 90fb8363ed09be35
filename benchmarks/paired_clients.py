"""Two runs compared client by client on their final round, as docs/results.md's "paired" figures.

    python benchmarks/paired_clients.py RUN_DIR_A RUN_DIR_B

Both runs must hold the same clients with the same test sets (same dataset, partition and seed:
two rows of one table and seed). From each run's clients.npz (the final round's per-class counts of
every client), each client's test accuracy; then B − A per client, in points: its mean ± standard
error over clients (ddof = 1), and on how many clients B is above, below or level with A. A
difference of means across seeds mixes partition luck into the gap; the paired one does not.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

PERCENT = 100.0


def client_accuracy(run_dir: Path) -> tuple[np.ndarray, np.ndarray]:
    """Each client's final-round test accuracy in %, and its per-class test counts."""
    path = run_dir / "clients.npz"
    if not path.is_file():
        raise SystemExit(f"{run_dir}: no clients.npz (a finished run directory, not one adopted with --reuse)")
    arrays = np.load(path)
    correct, total = arrays["class_correct"], arrays["class_total"]
    return PERCENT * correct.sum(axis=1) / total.sum(axis=1), total


def paired(run_a: Path, run_b: Path) -> dict[str, float]:
    """B − A over the clients both runs evaluated on the same test samples."""
    acc_a, total_a = client_accuracy(run_a)
    acc_b, total_b = client_accuracy(run_b)
    if not np.array_equal(total_a, total_b):  # False too when the shapes differ
        raise SystemExit(f"{run_a} and {run_b} do not test the same clients on the same class counts: "
                         "pair only runs of one dataset, partition and seed")
    diff = acc_b - acc_a
    return {"clients": len(diff), "mean_a": float(acc_a.mean()), "mean_b": float(acc_b.mean()),
            "diff": float(diff.mean()), "stderr": float(diff.std(ddof=1) / np.sqrt(len(diff))),
            "b_above": int((diff > 0).sum()), "b_below": int((diff < 0).sum()), "level": int((diff == 0).sum())}


def main() -> None:
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    run_a, run_b = Path(sys.argv[1]), Path(sys.argv[2])
    result = paired(run_a, run_b)
    print(f"clients: {result['clients']}; A {result['mean_a']:.2f} %, B {result['mean_b']:.2f} % (unweighted, final round)")
    print(f"B - A: {result['diff']:+.2f} ± {result['stderr']:.2f} point (mean ± standard error over clients); "
          f"B above on {result['b_above']}, below on {result['b_below']}, level on {result['level']}")


if __name__ == "__main__":
    main()
