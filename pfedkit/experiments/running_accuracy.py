"""The per-client accuracy FedProto's code prints, beside the one pfedkit reports.

FedProto's authors' code (yuetan031/FedProto, `lib/update.py`, `test_inference_new_het_lt`) sets
its `correct` and `total` counters once, before the loop over clients, and never resets them, so
the accuracy it prints for client u is a running accuracy over clients 0..u:

    r_u = sum_{v <= u} correct_v / sum_{v <= u} n_v

and the table's "mean ± std" is the mean and population std (np.std) of r_0..r_{K-1}. The r_u
converge to the pooled accuracy as u grows, so their std is a fraction of the spread of the
clients' own accuracies: FedProto's ± 0.3 beside its baselines' ± 3 says how it was computed,
not that FedProto's clients are more uniform. (For FedProto itself the code also adds its second,
nearest-prototype pass to the same counters; a run records one prediction per client, so that
part is not rebuilt here.)

`python -m pfedkit.experiments.running_accuracy RUN_DIR ...` prints, for each finished run, the
final round's unweighted mean ± std over clients and the running statistic, in %.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def running_accuracies(correct: np.ndarray, total: np.ndarray) -> np.ndarray:
    """r_u = sum_{v <= u} correct_v / sum_{v <= u} total_v, in client order, in %."""
    correct, total = np.asarray(correct, dtype=float), np.asarray(total, dtype=float)
    if correct.shape != total.shape or correct.ndim != 1 or not len(total):
        raise ValueError(f"correct and total: one count per client each (got shapes {correct.shape}, {total.shape})")
    if (total <= 0).any() or (correct < 0).any() or (correct > total).any():
        raise ValueError("every client needs 0 <= correct <= total and total > 0")
    return 100.0 * np.cumsum(correct) / np.cumsum(total)


def final_counts(summary: dict) -> tuple[np.ndarray, np.ndarray]:
    """Each client's correct and test count at the final round, in client order, from a run's
    summary.json ("clients": its per-client accuracies and test counts)."""
    if "clients" not in summary:
        raise ValueError("the run's summary.json has no per-client accuracies (a run made before they were recorded)")
    clients = summary["clients"]
    order = np.argsort(clients["client"])
    total = np.asarray(clients["n_test"], dtype=float)[order]
    correct = np.rint(np.asarray(clients["final_acc"], dtype=float)[order] * total)
    return correct, total


def describe(run_dir: Path) -> str:
    path = Path(run_dir) / "summary.json"
    if not path.is_file():
        raise ValueError("no summary.json: not a finished run directory")
    correct, total = final_counts(json.loads(path.read_text()))
    own = 100.0 * correct / total
    running = running_accuracies(correct, total)
    return (f"{run_dir}: per client {own.mean():.2f} ± {own.std():.2f}; "
            f"running (FedProto's code) {running.mean():.2f} ± {running.std():.2f}")


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m pfedkit.experiments.running_accuracy",
                                     description="The final round's accuracy over clients, and FedProto's code's running one.")
    parser.add_argument("run_dirs", nargs="+", type=Path, help="finished run directories (summary.json)")
    args = parser.parse_args(argv)
    failed = 0
    for run_dir in args.run_dirs:
        try:
            print(describe(run_dir))
        except ValueError as error:
            print(f"{run_dir}: {error}")
            failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
