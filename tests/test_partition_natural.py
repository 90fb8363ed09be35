"""partition.scheme=natural: one client per writer (FEMNIST's writer ids), or a seeded sample of writers."""
from __future__ import annotations

import numpy as np
import pytest

from pfedkit.config import load_config
from pfedkit.data.datasets import Dataset, load_dataset
from pfedkit.data.federated import split_indices
from pfedkit.data.partition import PartitionError, partition
from pfedkit.federation import split_plan

RNG = np.random.default_rng(0)
WRITERS = RNG.integers(0, 12, 400)  # 12 writers of unequal sizes
LABELS = RNG.integers(0, 5, 400)


def test_one_client_per_writer_disjoint_and_covering():
    parts = partition(LABELS, "natural", 12, seed=0, writers=WRITERS)
    assert len(parts) == 12
    assert sum(len(p) for p in parts) == len(LABELS)
    assert len(np.unique(np.concatenate(parts))) == len(LABELS), "index sets are disjoint and cover the pool"
    for cid, part in enumerate(parts):
        assert set(WRITERS[part]) == {cid}, "client i holds all of the i-th writer's samples and only those"
        assert len(part) == int((WRITERS == cid).sum())


def test_sampled_writers_depend_on_the_seed_only():
    first = partition(LABELS, "natural", 5, seed=3, writers=WRITERS)
    again = partition(LABELS, "natural", 5, seed=3, writers=WRITERS)
    other = partition(LABELS, "natural", 5, seed=4, writers=WRITERS)
    chosen = [int(np.unique(WRITERS[p])[0]) for p in first]
    assert all(len(np.unique(WRITERS[p])) == 1 for p in first)
    assert len(set(chosen)) == 5 and chosen == sorted(chosen)
    assert all(np.array_equal(a, b) for a, b in zip(first, again))
    assert chosen != [int(np.unique(WRITERS[p])[0]) for p in other]
    assert len(np.unique(np.concatenate(first))) == sum(len(p) for p in first)
    for part, writer in zip(first, chosen):
        assert len(part) == int((WRITERS == writer).sum()), "a sampled writer brings all its samples"


def test_refused_without_writers_or_with_too_many_clients():
    with pytest.raises(PartitionError, match="needs writer ids") as err:
        partition(LABELS, "natural", 3, seed=0)
    assert "\n" not in str(err.value)
    with pytest.raises(PartitionError, match=r"has 12 writers; allowed num_clients: 1\.\.12"):
        partition(LABELS, "natural", 13, seed=0, writers=WRITERS)


def test_other_schemes_ignore_writers():
    with_writers = partition(LABELS, "dirichlet", 4, seed=0, writers=WRITERS, alpha=0.5, least=5)
    without = partition(LABELS, "dirichlet", 4, seed=0, alpha=0.5, least=5)
    assert all(np.array_equal(a, b) for a, b in zip(with_writers, without))


def _writer_dataset() -> Dataset:
    images = RNG.integers(0, 256, (len(LABELS), 28, 28), dtype=np.uint8)
    names = np.array([f"f{w:04d}_00" for w in range(12)])
    return Dataset("femnist", images, LABELS.astype(np.int64), np.zeros(len(LABELS), bool), 62,
                   WRITERS.astype(np.int32), names)


def test_config_natural_gives_per_writer_clients_with_per_client_split():
    config = load_config({"dataset": "femnist", "num_clients": 6, "partition": {"scheme": "natural"}})
    train, test = split_indices(split_plan(config), _writer_dataset())
    assert len(train) == 6
    every = np.concatenate(train + test)
    assert len(np.unique(every)) == len(every), "train and test of all clients are disjoint"
    for tr, te in zip(train, test):
        assert len(np.unique(WRITERS[np.concatenate([tr, te])])) == 1, "a client's samples are one writer's"
        assert len(te) > 0


def test_config_natural_on_a_dataset_without_writers_is_one_line():
    config = load_config({"dataset": "digits", "partition": {"scheme": "natural"}})
    with pytest.raises(PartitionError) as err:
        split_indices(split_plan(config), load_dataset("digits"))
    assert "needs writer ids" in str(err.value) and "\n" not in str(err.value)
