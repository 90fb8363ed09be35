"""Accuracy parity of two runs of the same cell (e.g. precision=fp32 against precision=bf16).

    python benchmarks/precision_parity.py RUN_DIR_A RUN_DIR_B

Reads each run's metrics.csv (one row per client and evaluated round) and compares the unweighted
mean of the clients' accuracies round by round, over the rounds both runs have evaluated (a run
still going, or stopped early, counts up to where it got). Prints, in points: the largest and the
mean absolute per-round difference, and the mean of the last 10 common rounds of each run. Use it
before trusting bf16 for a table: docs/results.md quotes its output for each table run in bf16.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd


def per_round_accuracy(run_dir: Path) -> pd.Series:
    """Round -> unweighted mean of the clients' test accuracy (%), rounds where every client has a row."""
    frame = pd.read_csv(run_dir / "metrics.csv")
    rows = frame.dropna(subset=["accuracy"])
    clients = rows["client"].nunique()
    per_round = rows.groupby("round")["accuracy"].agg(["mean", "count"])
    return 100 * per_round.loc[per_round["count"] == clients, "mean"]


def parity(a: pd.Series, b: pd.Series, last: int = 10) -> dict[str, float]:
    common = a.index.intersection(b.index)
    if len(common) == 0:
        raise SystemExit("the two runs have no evaluated round in common")
    diff = (a[common] - b[common]).abs()
    tail = common[-last:]
    return {"rounds": int(common[-1]), "max_abs_diff": float(diff.max()), "mean_abs_diff": float(diff.mean()),
            "last_mean_a": float(a[tail].mean()), "last_mean_b": float(b[tail].mean())}


def main() -> None:
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    a_dir, b_dir = Path(sys.argv[1]), Path(sys.argv[2])
    result = parity(per_round_accuracy(a_dir), per_round_accuracy(b_dir))
    print(f"rounds 1-{result['rounds']} in common; per-round unweighted accuracy, |A - B|: "
          f"max {result['max_abs_diff']:.2f}, mean {result['mean_abs_diff']:.2f} points; "
          f"mean of the last 10 common rounds: A {result['last_mean_a']:.2f} %, B {result['last_mean_b']:.2f} %")


if __name__ == "__main__":
    main()
