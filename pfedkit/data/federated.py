"""FederatedData: the per-client train/test tensors of a run, built from a dataset and a partition.

Which pool is partitioned and where test data come from follows settings.md §1.0:
`per_client` merges the official splits into one pool and splits each client's share (75/25,
stratified by default); `official_fraction` (DA-PFL) and `official_shots` (FedProto/pFedPM)
partition the official training split and draw each client's test set from the official test split.
The index arrays (into the dataset's rows) are what `partition.npz` stores (`partition_arrays`;
read back, checked, by `run_files.read_partition`).

The data layer reads no Config: a run's partition settings arrive as a `SplitPlan` of plain
values, which `pfedkit.federation.split_plan(config)` builds.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pfedkit.core.contract import ClientData
from pfedkit.data.store import Dataset
from pfedkit.data.validation import with_validation
from pfedkit.data.partition import (class_counts, partition, split_train_test, stratified_subset,
                                    test_from_official)


@dataclass(frozen=True)
class FederatedData:
    dataset: str
    num_classes: int
    input_shape: tuple[int, ...]
    train_index: list[np.ndarray]  # per client, rows of the dataset
    test_index: list[np.ndarray]
    clients: list[ClientData]

    @property
    def num_clients(self) -> int:
        return len(self.clients)

    def train_counts(self) -> np.ndarray:
        return np.stack([c.class_counts for c in self.clients])

    def test_counts(self) -> np.ndarray:
        return np.stack([np.bincount(c.y_test.numpy(), minlength=self.num_classes) for c in self.clients])

    def partition_arrays(self) -> dict[str, np.ndarray]:
        arrays: dict[str, np.ndarray] = {"num_clients": np.array(self.num_clients)}
        for cid, (train, test) in enumerate(zip(self.train_index, self.test_index)):
            arrays[f"train_{cid}"] = train
            arrays[f"test_{cid}"] = test
        return arrays


@dataclass(frozen=True)
class SplitPlan:
    """How a run splits a dataset over its clients (the config's `partition` section, num_clients,
    seed and validation_fraction, as plain values)."""
    scheme: str                    # a scheme of pfedkit.data.partition.partition
    scheme_params: dict[str, Any]  # the scheme's own parameters, passed to partition()
    num_clients: int
    seed: int
    test_split: str                # per_client, official_fraction or official_shots (auto resolved)
    pool_fraction: float
    train_ratio: float             # per_client: each client's training share ...
    stratified: bool               # ... drawn per class
    test_fraction: float           # official_fraction
    test_shots: int                # official_shots
    validation_fraction: float     # > 0: evaluate on a validation split carved from training (pfedkit tune)


def split_indices(plan: SplitPlan, dataset: Dataset) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per-client (train, test) row indices of `dataset` for the plan's partition."""
    y = dataset.y
    if plan.test_split == "per_client":
        pool = np.arange(len(y))
        pool = stratified_subset(pool, y[pool], plan.pool_fraction, plan.seed)
        shares = partition(y[pool], plan.scheme, plan.num_clients, plan.seed, _writers(dataset, pool),
                           **plan.scheme_params)
        pairs = [split_train_test(pool[s], y, plan.train_ratio, plan.seed, cid, plan.stratified)
                 for cid, s in enumerate(shares)]
        return [p[0] for p in pairs], [p[1] for p in pairs]
    train_pool = np.flatnonzero(~dataset.official_test)
    train_pool = stratified_subset(train_pool, y[train_pool], plan.pool_fraction, plan.seed)
    test_pool = np.flatnonzero(dataset.official_test)
    shares = partition(y[train_pool], plan.scheme, plan.num_clients, plan.seed, _writers(dataset, train_pool),
                       **plan.scheme_params)
    extra = {"fraction": plan.test_fraction} if plan.test_split == "official_fraction" else \
        {"shots": plan.test_shots}
    tests = test_from_official(shares, y[train_pool], y[test_pool], plan.seed, **extra)
    return [train_pool[s] for s in shares], [test_pool[t] for t in tests]


def _writers(dataset: Dataset, rows: np.ndarray) -> np.ndarray | None:
    """The writer of each of `rows` (scheme natural), or None for a dataset without writers."""
    return None if dataset.writer is None else dataset.writer[rows]


def build_federated(plan: SplitPlan, dataset: Dataset, channels_last: bool = False) -> FederatedData:
    train_index, test_index = split_indices(plan, dataset)
    # validation_fraction > 0 (pfedkit tune): evaluate on a validation split carved from training;
    # the test rows are dropped before any are gathered (pfedkit.data.validation)
    train_index, test_index = with_validation(plan.validation_fraction, plan.seed, dataset.y,
                                              train_index, test_index)
    return assemble(dataset, train_index, test_index, channels_last)


def assemble(dataset: Dataset, train_index: list[np.ndarray], test_index: list[np.ndarray],
             channels_last: bool = False) -> FederatedData:
    """Gather each client's rows into its own tensors (one copy of the data in total)."""
    counts = class_counts([np.asarray(t) for t in train_index], dataset.y, dataset.num_classes)
    clients = [client_data(dataset, cid, tr, te, counts[cid], channels_last)
               for cid, (tr, te) in enumerate(zip(train_index, test_index))]
    return FederatedData(dataset.name, dataset.num_classes, dataset.input_shape,
                         list(train_index), list(test_index), clients)


def client_data(dataset: Dataset, cid: int, train: np.ndarray, test: np.ndarray, counts: np.ndarray,
                channels_last: bool = False) -> ClientData:
    """Client `cid`'s tensors: rows `train` and `test` of the dataset (a Flower node builds only its own)."""
    def rows(index: np.ndarray) -> torch.Tensor:
        out = torch.from_numpy(dataset.rows(np.asarray(index, dtype=np.int64)))
        return out.contiguous(memory_format=torch.channels_last) if channels_last and out.dim() == 4 else out

    labels = torch.from_numpy(dataset.y)
    return ClientData(cid, rows(train), labels[torch.from_numpy(np.asarray(train, dtype=np.int64))],
                      rows(test), labels[torch.from_numpy(np.asarray(test, dtype=np.int64))], counts)
