"""A validation split carved from each client's training split (config `validation_fraction`).

`pfedkit tune` chooses hyperparameters on this split so that the test split is never seen while
tuning: with `validation_fraction` > 0, a run trains on each client's training split minus its
validation samples and evaluates on the validation samples *in place of* the test split (the test
indices are dropped before any data are gathered, so no test row is ever read).

Per client i with n_i training samples, exactly v_i = round_half_up(f * n_i) samples go to
validation (at least 1 and at most n_i - 1 when n_i >= 2; none when n_i < 2), spread over the
client's classes in proportion to their counts (largest remainder), so the validation split has
the training split's label distribution as far as whole samples allow. A class is emptied only
when no other class can give the sample. Randomness from (seed, client, "validation").
"""
from __future__ import annotations

import math
import zlib

import numpy as np

PURPOSE = "validation"


def validation_size(num_train: int, fraction: float) -> int:
    """v = round_half_up(fraction * n), kept in [1, n - 1] for n >= 2 (0 for n < 2)."""
    if num_train < 2:
        return 0
    return min(num_train - 1, max(1, math.floor(fraction * num_train + 0.5 + 1e-9)))


def class_quotas(counts: np.ndarray, total: int) -> np.ndarray:
    """How many of each class go to validation: floor(total * m_c / n), then one more to the
    classes with the largest remainders, preferring classes that keep a training sample."""
    counts = np.asarray(counts, dtype=np.int64)
    n = int(counts.sum())
    exact = total * counts / max(1, n)
    quotas = np.floor(exact + 1e-9).astype(np.int64)
    remainder = exact - quotas
    for _ in range(total - int(quotas.sum())):
        keeps_one = (counts - quotas) >= 2
        room = (counts - quotas) >= 1
        pool = keeps_one if keeps_one.any() else room
        candidates = np.where(pool, remainder, -np.inf)
        chosen = int(np.argmax(candidates))  # ties: the smallest label
        quotas[chosen] += 1
        remainder[chosen] = -1.0
    return quotas


def carve_validation(train_index: list[np.ndarray], labels: np.ndarray, fraction: float,
                     seed: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(remaining training rows, validation rows) per client; disjoint, together the training rows.
    `labels[r]` is the label of dataset row r."""
    if not 0 < fraction < 1:
        raise ValueError(f"validation fraction must be in (0, 1), got {fraction}")
    labels = np.asarray(labels)
    remaining, validation = [], []
    for cid, rows in enumerate(train_index):
        rows = np.asarray(rows, dtype=np.int64)
        rng = np.random.default_rng(np.random.SeedSequence([int(seed), cid, zlib.crc32(PURPOSE.encode())]))
        own = labels[rows]
        classes, counts = np.unique(own, return_counts=True)
        quotas = class_quotas(counts, validation_size(len(rows), fraction))
        chosen = [rng.permutation(rows[own == label])[:quota] for label, quota in zip(classes, quotas)]
        picked = np.sort(np.concatenate(chosen)) if chosen else np.zeros(0, np.int64)
        validation.append(picked.astype(np.int64))
        remaining.append(np.setdiff1d(rows, picked, assume_unique=True).astype(np.int64))
    return remaining, validation


def with_validation(fraction: float, seed: int, labels: np.ndarray, train_index: list[np.ndarray],
                    test_index: list[np.ndarray]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The split a run uses: (train, test) unchanged for fraction 0; else (train minus validation,
    validation): the test rows are dropped here, before anything reads them."""
    if not fraction:
        return train_index, test_index
    return carve_validation(train_index, labels, fraction, seed)
