"""Per-client mixtures of peers' models: u_i = sum_j W[i, j] w_j, each row of W non-negative and
summing to 1. FedAMP (attention-inducing weights), FedFomo (loss-improvement weights), DA-PFL
(affinity x distance weights) and FedReMa (relevant peers' heads) differ only in how W is made;
the mixing, its checks and the recorded matrix are here, once.

Diagnostics: each method records its [N, N] matrix (`mixing_matrix`: rows = receiving client,
NaN rows for clients that received nothing that round) under a key of its own;
the report draws the first, middle and last recorded rounds side by side (`mixing` in
report/methods/shared.py); algorithms draw nothing.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from pfedkit.core.params import Params, weighted_mean

ROW_TOLERANCE = 1e-6


def check_row(row: Sequence[float] | np.ndarray, what: str = "mixing weights") -> np.ndarray:
    """The row as float64 after checking it is a distribution (>= 0, sums to 1); ValueError otherwise."""
    row = np.asarray(row, dtype=np.float64)
    if row.ndim != 1 or row.size == 0:
        raise ValueError(f"{what}: expected a non-empty 1-D row, got shape {row.shape}")
    if (row < 0).any() or not np.isfinite(row).all():
        raise ValueError(f"{what}: weights must be finite and non-negative, got {row}")
    if abs(row.sum() - 1.0) > ROW_TOLERANCE:
        raise ValueError(f"{what}: weights must sum to 1, got {row.sum():.8f}")
    return row


def mix(models: Sequence[Params], row: Sequence[float] | np.ndarray, what: str = "mixing weights") -> Params:
    """sum_j row[j] models[j] over the peers with a positive weight (row checked by `check_row`)."""
    row = check_row(row, what)
    if len(models) != row.size:
        raise ValueError(f"{what}: {row.size} weights for {len(models)} models")
    used = np.flatnonzero(row > 0)
    return weighted_mean([models[j] for j in used], row[used])


def mixing_matrix(num_clients: int, rows: Mapping[int, Mapping[int, float]]) -> np.ndarray:
    """[N, N] float32 matrix from {receiver: {peer: weight}}; NaN rows for absent receivers, 0 for
    peers a present receiver did not use."""
    matrix = np.full((num_clients, num_clients), np.nan, dtype=np.float32)
    for receiver, row in rows.items():
        matrix[receiver] = 0.0
        for peer, weight in row.items():
            matrix[receiver, peer] = weight
    return matrix
