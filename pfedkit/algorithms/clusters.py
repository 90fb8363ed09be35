"""K server models and each client's place among them: the clustered family's shared piece.

IFCA, CFL, FeSEM, FedPFA (hard assignment: client -> one cluster) and FedSoft (soft weights:
client x cluster) keep K models on the server and rebuild each one from the uploads of the clients
it serves. One function does that rebuild for all of them (`cluster_means`, a weighted mean per
cluster whose weights are a [K, m] matrix; hard assignments are the one-hot case), one draws K
differently initialised models, one picks a cluster from losses or distances, and one records
the assignments, so no method carries its own aggregation loop.

Diagnostics written here (per round): "cluster_assignment" [N] int, -1 for clients not seen that
round; "cluster_weights" [N, K] float (soft methods). The report draws both (`clusters` in
report/methods/shared.py); algorithms draw nothing.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from pfedkit.core.params import Params, clone, weighted_mean
from pfedkit.core.seeds import SERVER, derive_seed

UNASSIGNED = -1


def seeded_models(build, base: Params, count: int, seed: int, purpose: str) -> list[Params]:
    """`count` differently initialised models: the run's initial `base` first (so one cluster is
    FedAvg), then models whose layers are re-initialised (`reset_parameters`: PyTorch's default
    initialisation) under seeds from (seed, 0, SERVER, f"{purpose}-{k}").

    Re-initialising after `build()` rather than seeding around it: the run's builder seeds itself
    (every instance starts from the same weights), so seeding around it would give K copies."""
    models = [clone(base)]
    for k in range(1, count):
        module = build()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(derive_seed(seed, 0, SERVER, f"{purpose}-{k}"))
            for layer in module.modules():
                if hasattr(layer, "reset_parameters"):
                    layer.reset_parameters()
        models.append(clone({name: p for name, p in module.named_parameters() if name in base}))
    return models


def one_hot_weights(assignment: Sequence[int], sizes: Sequence[float], k: int) -> np.ndarray:
    """[k, m] weights of a hard assignment: W[c, i] = n_i if client i is in cluster c, else 0."""
    weights = np.zeros((k, len(assignment)))
    for i, (cluster, size) in enumerate(zip(assignment, sizes)):
        if not 0 <= cluster < k:
            raise ValueError(f"cluster index {cluster} outside 0..{k - 1}")
        weights[cluster, i] = float(size)
    return weights


def cluster_means(models: Sequence[Params], uploads: Sequence[Params], weights: np.ndarray) -> list[Params]:
    """New cluster models: model c = sum_i W[c, i] upload_i / sum_i W[c, i] (W: [K, m], >= 0);
    a cluster whose row sums to 0 (nobody uploaded to it) keeps its model."""
    weights = np.asarray(weights, dtype=np.float64)
    if weights.shape != (len(models), len(uploads)):
        raise ValueError(f"cluster_means: weights must be [{len(models)}, {len(uploads)}], got {weights.shape}")
    if (weights < 0).any():
        raise ValueError("cluster_means: weights must be non-negative")
    out = []
    for model, row in zip(models, weights):
        used = np.flatnonzero(row > 0)
        out.append(weighted_mean([uploads[i] for i in used], row[used]) if used.size else model)
    return out


def nearest(scores: Sequence[float]) -> int:
    """The cluster with the smallest score (loss or distance); ties go to the lowest index."""
    return int(np.argmin(np.asarray(scores, dtype=np.float64)))


def assignment_vector(num_clients: int, assignment: dict[int, int]) -> np.ndarray:
    """[N] cluster per client, UNASSIGNED (-1) for clients not in `assignment`."""
    vector = np.full(num_clients, UNASSIGNED, dtype=np.int64)
    for cid, cluster in assignment.items():
        vector[cid] = cluster
    return vector
