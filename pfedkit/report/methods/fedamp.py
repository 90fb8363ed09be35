"""FedAMP's figures: the attention weights ξ (`shared.mixing`) and how many rows needed the
rescaling guard per round."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from pfedkit.report.methods.shared import mixing
from pfedkit.report.plots import lines


def draw(diagnostics: dict[str, dict[int, Any]], out_dir: Path) -> list[Path]:
    written = mixing(diagnostics, "xi", out_dir / "fedamp_xi.png", "FedAMP attention weights ξ")
    guarded = diagnostics.get("guarded_rows") or {}
    if len(guarded) > 1:
        ordered = sorted(guarded)
        written.append(lines(ordered, {"rows rescaled": [guarded[r] for r in ordered]},
                             out_dir / "fedamp_guarded_rows.png",
                             "FedAMP rows where Σ_{j≠i} ξ_ij > 1 (rescaled, ξ_ii = 0)", "round",
                             "participants"))
    return written
