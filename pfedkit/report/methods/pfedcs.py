"""PFedCS's figures: distance heatmaps of a few stage-1 rounds (paper Fig. 1), how often each
client chose each other one, and the mean number of candidates / collaborators per round."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from pfedkit.report.methods.shared import chosen_rounds
from pfedkit.report.plots import heatmap, heatmaps_side_by_side, lines


def draw(diagnostics: dict[str, dict[int, Any]], out_dir: Path) -> list[Path]:
    distances = diagnostics.get("distance", {})
    chosen = diagnostics.get("collaborators", {})
    if not distances or not chosen:
        return []
    rounds = sorted(distances)
    written = distance_maps(distances, out_dir)
    counts = sum(np.asarray(chosen[r], dtype=float) for r in sorted(chosen))
    written.append(heatmap(counts, out_dir / "pfedcs_collaborators.png",
                           f"PFedCS: times client j was a collaborator of k ({len(chosen)} rounds)",
                           "collaborator j", "client k", "rounds chosen", vmin=0))
    series = {"collaborators |Col_k|": [mean_row_count(chosen[r], distances[r]) for r in rounds]}
    if "candidates" in diagnostics:
        series["candidates |Cand_k|"] = [mean_row_count(diagnostics["candidates"][r], distances[r])
                                         for r in rounds]
    written.append(lines(rounds, series, out_dir / "pfedcs_collaborator_count.png",
                         "PFedCS: mean number of candidates and collaborators per participant",
                         "round", "clients"))
    return written


def distance_maps(distances: dict[int, Any], out_dir: Path) -> list[Path]:
    """D^t of up to three evenly spaced rounds; round 1 is skipped when later rounds exist (its
    heads are all the initial one, so D^1 says nothing)."""
    rounds = sorted(distances)
    shown = chosen_rounds([r for r in rounds if r > 1] or rounds)
    matrices = [np.asarray(distances[r], dtype=float) for r in shown]
    if all(np.isfinite(m).all() for m in matrices):
        return [heatmaps_side_by_side(
            matrices, [f"round {r}" for r in shown], out_dir / "pfedcs_distance.png",
            "PFedCS: row-normalised classifier distances D^t (eq. 3)", "client j", "client k")]
    # partial participation: NaN outside P_t, one figure per round
    return [heatmap(m, out_dir / f"pfedcs_distance_round{r}.png",
                    f"PFedCS: classifier distances, round {r} (blank: not in P_t)",
                    "client j", "client k", "D_kj", vmin=0, vmax=1)
            for r, m in zip(shown, matrices)]


def mean_row_count(mask: np.ndarray, distance: np.ndarray) -> float:
    """Mean number of chosen clients per participant (rows of clients in P_t)."""
    mask = np.asarray(mask, dtype=float)
    participants = ~np.isnan(np.asarray(distance, dtype=float)).all(axis=1)
    return float(mask[participants].sum(axis=1).mean()) if participants.any() else 0.0
