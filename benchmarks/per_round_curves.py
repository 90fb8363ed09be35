"""Per-round curves of runs, as committed beside a table in docs/results/ (per-round-unweighted.csv).

    python benchmarks/per_round_curves.py LABEL=RUN_DIR [LABEL=RUN_DIR ...] > per-round-unweighted.csv

For each run, from its metrics.csv (one row per client and evaluated round), one line per evaluated
round: `method` (the LABEL), `round`, `accuracy` (the unweighted mean over clients of their test
accuracy, as the papers' "average over clients") and `balanced_acc` (the unweighted mean of the
clients' balanced accuracy), as fractions. A run still going counts up to where it got.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd

from pfedkit.evaluation import round_table


def curves(runs: dict[str, Path]) -> pd.DataFrame:
    """The per-round lines of every run, in the order given."""
    frames = []
    for label, run_dir in runs.items():
        table = round_table(pd.read_csv(run_dir / "metrics.csv"))
        frames.append(pd.DataFrame({"method": label, "round": table.index.to_numpy(),
                                    "accuracy": table["acc_mean"].to_numpy(),
                                    "balanced_acc": table["balanced_acc"].to_numpy()}))
    return pd.concat(frames, ignore_index=True)


def parse(arguments: list[str]) -> dict[str, Path]:
    runs = {}
    for argument in arguments:
        label, _, path = argument.partition("=")
        if not path or not (Path(path) / "metrics.csv").is_file():
            raise SystemExit(f"{argument}: give LABEL=RUN_DIR, a run directory with metrics.csv\n\n{__doc__}")
        runs[label] = Path(path)
    return runs


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    sys.stdout.write(curves(parse(sys.argv[1:])).to_csv(index=False, float_format="%.6f"))


if __name__ == "__main__":
    main()
