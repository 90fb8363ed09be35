"""FedFomo's figures: the mixing weights w_ij (`shared.mixing`) and the last affinity matrix P."""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pfedkit.report.methods.shared import mixing
from pfedkit.report.plots import heatmap


def draw(diagnostics: dict[str, dict[int, Any]], out_dir: Path) -> list[Path]:
    written = mixing(diagnostics, "weights", out_dir / "fedfomo_weights.png",
                     "FedFomo mixing weights w_ij (diagonal: kept own model)")
    affinities: Mapping[int, Any] = diagnostics.get("P") or {}
    if affinities:
        last = max(affinities)
        written.append(heatmap(affinities[last], out_dir / "fedfomo_affinity.png",
                               f"FedFomo affinity P (round {last})", "peer j", "client i", colorbar="P"))
    return written
