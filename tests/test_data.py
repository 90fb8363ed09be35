"""Datasets (embedded digits, offline files with checksums) and per-client federated data."""
from __future__ import annotations

import hashlib
import io
import lzma

import numpy as np
import pytest

from pfedkit.cli import main
from pfedkit.config import load_config
from pfedkit.data.datasets import DataError, load_dataset
from pfedkit.data.federated import build_federated, split_indices
from pfedkit.federation import split_plan

from conftest import SHARED_DATASETS, needs_dataset


def test_digits_is_embedded_and_normalised():
    data = load_dataset("digits")
    assert data.x.shape == (1797, 64) and data.x.dtype == np.float32
    assert data.x.min() == -1.0 and data.x.max() == 1.0
    assert data.official_test.sum() == sum(len(np.flatnonzero(data.y == c)[3::4]) for c in range(10))


@needs_dataset("mnist")
def test_mnist_loads_from_data_dir_with_official_split(tmp_path):
    data = load_dataset("mnist", str(SHARED_DATASETS), cache_dir=str(tmp_path))
    assert data.x.shape == (70000, 1, 28, 28) and data.official_test.sum() == 10000
    assert np.bincount(data.y[data.official_test]).tolist()[:3] == [980, 1135, 1032]
    assert list(tmp_path.glob("mnist-*.npz")), "decompressed once into the cache"


def _write_dataset(root, name, arrays, checksum=None):
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    payload = lzma.compress(buffer.getvalue())
    (root / name).mkdir(parents=True)
    (root / name / f"{name}.npz.xz").write_bytes(payload)
    digest = checksum or hashlib.sha256(payload).hexdigest()
    (root / "SHA256SUMS").write_text(f"{digest}  {name}/{name}.npz.xz\n")


def test_valid_file_with_checksum_loads(tmp_path):
    x = np.arange(4 * 28 * 28, dtype=np.uint8).reshape(4, 28, 28)
    _write_dataset(tmp_path / "d", "mnist", {"x": x, "y": np.arange(4, dtype=np.uint8), "test": np.array([0, 0, 1, 1], bool)})
    data = load_dataset("mnist", str(tmp_path / "d"), cache_dir=str(tmp_path / "cache"))
    expected = (x[1].astype(np.float32) / np.float32(255) - np.float32(0.5)) / np.float32(0.5)
    np.testing.assert_array_equal(data.x[1, 0], expected)  # bit for bit, as the dataset README says


def test_corrupt_file_names_the_file(tmp_path):
    x = np.zeros((2, 28, 28), np.uint8)
    _write_dataset(tmp_path / "d", "mnist", {"x": x, "y": np.zeros(2, np.uint8), "test": np.zeros(2, bool)},
                   checksum="0" * 64)
    with pytest.raises(DataError, match=r"corrupt dataset file .*mnist\.npz\.xz"):
        load_dataset("mnist", str(tmp_path / "d"), cache_dir=str(tmp_path / "cache"))


def test_missing_file_says_what_to_do(tmp_path):
    with pytest.raises(DataError, match=r"missing dataset file .*cifar10\.npz\.xz.*data_dir"):
        load_dataset("cifar10", str(tmp_path))


def test_missing_data_dir_exits_2(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("PFEDKIT_DATA", raising=False)
    assert main(["run", "-q", "dataset=mnist", f"out_dir={tmp_path / 'runs'}"]) == 2
    assert "PFEDKIT_DATA" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_per_client_split_covers_pool_disjointly():
    config = load_config({"num_clients": 6, "partition": {"scheme": "iid"}})
    data = load_dataset("digits")
    train, test = split_indices(split_plan(config), data)
    every = np.concatenate(train + test)
    assert len(every) == len(np.unique(every)) == len(data.y)


def test_official_fraction_test_sets_come_from_the_official_test_split():
    config = load_config({"num_clients": 5, "partition": {"scheme": "dirichlet", "alpha": 1.0,
                                                          "test_split": "official_fraction", "least": 10}})
    data = load_dataset("digits")
    train, test = split_indices(split_plan(config), data)
    assert not data.official_test[np.concatenate(train)].any()
    assert data.official_test[np.concatenate(test)].all()


def test_federated_tensors_match_saved_indices():
    config = load_config({"num_clients": 3})
    data = load_dataset("digits")
    fed = build_federated(split_plan(config), data)
    for client, index in zip(fed.clients, fed.train_index):
        np.testing.assert_array_equal(client.y_train.numpy(), data.y[index])
        np.testing.assert_array_equal(client.class_counts, np.bincount(data.y[index], minlength=10))


def test_data_stats_prints_counts_and_writes_heatmap(tmp_path, capsys):
    png = tmp_path / "stats.png"
    assert main(["data", "stats", "num_clients=5", "--out", str(png)]) == 0
    out = capsys.readouterr().out
    assert "c9" in out and "train" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
