"""Drawings shared by several methods' figure modules.

`clusters`: the clustered family (IFCA, CFL, FeSEM, FedSoft, FedPFA) records "cluster_assignment"
([N] int per round, -1 = not seen) and, for soft methods, "cluster_weights" ([N, K]); see
pfedkit/algorithms/clusters.py. `mixing`: the peer-mixing family (FedAMP, FedFomo, DA-PFL)
records an [N, N] matrix per round (NaN rows = not mixed); see pfedkit/algorithms/peers.py.
`feature_distance`: pFedPM, R-pFedPM and FedProto record "local_global_distance" ([N] per
round, NaN = no upload).
"""
from __future__ import annotations

import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from pfedkit.report.plots import heatmap, heatmaps_side_by_side, lines


def chosen_rounds(rounds: Sequence[int], count: int = 3) -> list[int]:
    """First, middle and last recorded rounds (fewer if fewer were recorded)."""
    if len(rounds) <= count:
        return list(rounds)
    picks = np.linspace(0, len(rounds) - 1, count).round().astype(int)
    return [rounds[p] for p in sorted(set(picks.tolist()))]


def clusters(diagnostics: dict[str, dict[int, Any]], out_dir: Path, name: str) -> list[Path]:
    """Client x round map of "cluster_assignment" and the last "cluster_weights" matrix (if any)."""
    written = []
    assignments = diagnostics.get("cluster_assignment") or {}
    if assignments:
        rounds = sorted(assignments)
        grid = np.stack([np.asarray(assignments[r], dtype=float) for r in rounds], axis=1)
        grid[grid < 0] = np.nan  # not seen that round
        written.append(heatmap(grid, Path(out_dir) / f"{name}_clusters.png",
                               f"{name}: cluster of each client per round (blank: not seen)",
                               f"recorded round (column 0 = round {rounds[0]})", "client", colorbar="cluster"))
    soft = diagnostics.get("cluster_weights") or {}
    if soft:
        last = max(soft)
        written.append(heatmap(soft[last], Path(out_dir) / f"{name}_cluster_weights.png",
                               f"{name}: client-to-cluster weights (round {last})", "cluster", "client",
                               colorbar="weight", vmin=0, vmax=1))
    return written


def mixing(diagnostics: dict[str, dict[int, Any]], key: str, path: Path, title: str) -> list[Path]:
    """Side-by-side heatmaps of the recorded matrix `key` (first, middle, last round); [] if none."""
    matrices = diagnostics.get(key) or {}
    if not matrices:
        return []
    rounds = chosen_rounds(sorted(matrices))
    return [heatmaps_side_by_side([np.nan_to_num(np.asarray(matrices[r], dtype=float), nan=0.0) for r in rounds],
                                  [f"round {r}" for r in rounds], path,
                                  f"{title}; empty rows: not mixed that round", "peer j", "client i")]


def feature_distance(diagnostics: dict[str, dict[int, Any]], out_dir: Path, stem: str, what: str) -> list[Path]:
    """Client x round heatmap and mean/max/min curves of the recorded "local_global_distance"
    (||local - global `what`||, mean over a client's classes; NaN: the client did not upload)."""
    per_round = diagnostics.get("local_global_distance", {})
    if not per_round:
        return []
    rounds = sorted(per_round)
    matrix = np.stack([np.asarray(per_round[r], dtype=float) for r in rounds])  # [T, N]
    written = [heatmap(matrix.T, Path(out_dir) / f"{stem}_clients.png",
                       f"||local - global {what}||, mean over a client's classes",
                       "round index (0 = first round)", "client", colorbar="L2 distance")]
    with warnings.catch_warnings():  # rounds in which nobody uploaded are all-nan
        warnings.simplefilter("ignore", category=RuntimeWarning)
        series = {"mean over participants": np.nanmean(matrix, axis=1),
                  "max": np.nanmax(matrix, axis=1), "min": np.nanmin(matrix, axis=1)}
    written.append(lines(rounds, series, Path(out_dir) / f"{stem}.png",
                         f"distance between local and global {what}s", "round", "L2 distance"))
    return written
