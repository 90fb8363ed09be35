"""DA-PFL's figures: the affinity matrix, the aggregation weights (`shared.mixing`) and the
distance scale σ per round."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from pfedkit.report.methods.shared import mixing
from pfedkit.report.plots import heatmap, lines


def draw(diagnostics: dict[str, dict[int, Any]], out_dir: Path) -> list[Path]:
    written: list[Path] = []
    if diagnostics.get("affinity"):
        matrix = next(iter(diagnostics["affinity"].values()))
        written.append(heatmap(matrix, out_dir / "dapfl_affinity.png", "DA-PFL affinity c (eq. 3-6)",
                               "client j", "client i", colorbar="affinity", vmin=0, vmax=1))
    written += mixing(diagnostics, "aggregation_weights", out_dir / "dapfl_aggregation_weights.png",
                      "DA-PFL aggregation weights α (eq. 8)")
    sigmas = diagnostics.get("sigma") or {}
    if len(sigmas) > 1:
        ordered = sorted(sigmas)
        written.append(lines(ordered, {"σ": [sigmas[r] for r in ordered]}, out_dir / "dapfl_sigma.png",
                             "DA-PFL distance scale σ per round", "round", "σ"))
    return written
