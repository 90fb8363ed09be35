"""CFL's figures: clusters over rounds (`shared.clusters`) and the per-cluster mean and max update
norm curves with the eps1 / eps2 lines and the split rounds."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from pfedkit.report.methods.shared import clusters
from pfedkit.report.plots import lines


def draw(diagnostics: dict[str, dict[int, Any]], out_dir: Path) -> list[Path]:
    written = clusters(diagnostics, out_dir, "cfl")
    mean_norms, max_norms = diagnostics.get("mean_norm") or {}, diagnostics.get("max_norm") or {}
    if not mean_norms:
        return written
    rounds = sorted(mean_norms)
    count = max(len(mean_norms[r]) for r in rounds)
    thresholds = diagnostics.get("thresholds") or {}
    eps = dict(zip(("eps1", "eps2"), thresholds[max(thresholds)])) if thresholds else {}
    split_rounds = {f"split (round {r})": r for r in sorted(diagnostics.get("splits") or {})}
    for key, values, threshold, what in (("mean_norm", mean_norms, "eps1", "‖weighted mean of Δ_i‖"),
                                         ("max_norm", max_norms, "eps2", "max_i ‖Δ_i‖")):
        series = {f"cluster {c}": [values[r][c] if c < len(values[r]) else np.nan for r in rounds]
                  for c in range(count)}
        if threshold in eps:
            series[threshold] = [eps[threshold]] * len(rounds)
        written.append(lines(rounds, series, Path(out_dir) / f"cfl_{key}.png",
                             f"CFL: {what} per cluster (split if mean < eps1 and max > eps2)",
                             "round", what, vlines=split_rounds))
    return written
