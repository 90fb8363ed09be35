"""FedPFA's figures: groups over rounds (`shared.clusters`; blank = not grouped), each client's
latest sparsity vector, and the Euclidean distances between those vectors (what the server
clusters)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from pfedkit.report.methods.shared import clusters
from pfedkit.report.plots import heatmap


def draw(diagnostics: dict[str, dict[int, Any]], out_dir: Path) -> list[Path]:
    written = clusters(diagnostics, out_dir, "fedpfa")
    received = diagnostics.get("sparsity") or {}
    if not received:
        return written
    matrix = latest_rows(received)
    written.append(heatmap(matrix, out_dir / "fedpfa_sparsity.png",
                           "FedPFA: sparsity vectors (fraction of zero activations per body-output unit)",
                           "unit", "client", colorbar="fraction zero", vmin=0, vmax=1,
                           figsize=(9, max(3, 0.3 * matrix.shape[0] + 1.5))))
    seen = ~np.isnan(matrix).all(axis=1)
    distances = np.full((len(matrix), len(matrix)), np.nan)
    if seen.any():
        block = matrix[seen]
        distances[np.ix_(seen, seen)] = np.linalg.norm(block[:, None, :] - block[None, :, :], axis=-1)
    written.append(heatmap(distances, out_dir / "fedpfa_sparsity_distances.png",
                           "FedPFA: Euclidean distance between sparsity vectors", "client", "client",
                           colorbar="distance"))
    return written


def latest_rows(received: dict[int, np.ndarray]) -> np.ndarray:
    """Each client's most recently received row (all-NaN rows: not received that round)."""
    matrix = np.full_like(next(iter(received.values())), np.nan, dtype=np.float64)
    for rnd in sorted(received):
        rows = ~np.isnan(received[rnd]).all(axis=1)
        matrix[rows] = received[rnd][rows]
    return matrix
