"""cwFedAvg's figures (paper Fig. 3 analogue): true vs estimated class distribution per client,
and the gap ||p - p~||_2 per round."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from pfedkit.report.plots import heatmaps_side_by_side, lines


def draw(diagnostics: dict[str, dict[int, Any]], out_dir: Path) -> list[Path]:
    estimates = diagnostics.get("estimated_class_distribution", {})
    truths = diagnostics.get("true_class_distribution", {})
    if not estimates or not truths:
        return []
    true = np.asarray(next(iter(truths.values())), dtype=float)
    rounds = sorted(estimates)
    latest = latest_estimates(estimates, true.shape)
    written = [heatmaps_side_by_side(
        [true, latest], ["true p (training counts)", f"estimated p~ (eq. 4), last upload by round {rounds[-1]}"],
        out_dir / "cwfedavg_class_distribution.png", "cwFedAvg: true vs estimated class distribution",
        "class", "client")]
    gaps = [np.linalg.norm(estimates[r] - true, axis=1) for r in rounds]
    written.append(lines(rounds, {"mean over participants": [float(np.nanmean(g)) for g in gaps],
                                  "worst participant": [float(np.nanmax(g)) for g in gaps]},
                         out_dir / "cwfedavg_distribution_gap.png",
                         "cwFedAvg: ||p - p~||_2 (the WDR term)", "round", "L2 distance"))
    return written


def latest_estimates(estimates: dict[int, np.ndarray], shape: tuple[int, int]) -> np.ndarray:
    """Each client's most recent p~; 1/C (the server's starting value) for never-seen clients."""
    latest = np.full(shape, 1.0 / shape[1])
    for rnd in sorted(estimates):
        table = np.asarray(estimates[rnd], dtype=float)
        seen = ~np.isnan(table).any(axis=1)
        latest[seen] = table[seen]
    return latest
