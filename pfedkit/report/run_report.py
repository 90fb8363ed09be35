"""`pfedkit report RUN`: accuracy curves of a run plus its algorithm's own diagnostics plots."""
from __future__ import annotations

from pathlib import Path

import pandas as pd
import torch
import yaml

from pfedkit.evaluation import round_table
from pfedkit.report.plots import lines


def report_run(run_dir: str | Path) -> list[Path]:
    from pfedkit.algorithms import get_algorithm

    run_dir = Path(run_dir)
    if not (run_dir / "metrics.csv").is_file():
        raise FileNotFoundError(f"{run_dir} has no metrics.csv; expected a run directory")
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    out_dir = run_dir / "report"
    table = round_table(pd.read_csv(run_dir / "metrics.csv"))
    written = [lines(table.index, {"sample-weighted": table["acc_weighted"], "unweighted": table["acc_mean"],
                                   "worst client": table["acc_worst"]},
                     out_dir / "accuracy.png", f"{config['algorithm']} on {config['dataset']}",
                     "round", "test accuracy")]
    diagnostics_file = run_dir / "diagnostics.pt"
    if diagnostics_file.is_file():
        diagnostics = torch.load(diagnostics_file, weights_only=False)
        written += get_algorithm(config["algorithm"]).report(diagnostics, out_dir)
    return written
