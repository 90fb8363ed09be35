"""The test suite's own hygiene: what a run of the tests leaves behind outside its temporary
directories."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np

from pfedkit.data import datasets
from pfedkit.data.datasets import load_dataset
from pfedkit.data.store import encode_xz


def _write_mnist_like(root: Path) -> None:
    folder = root / "mnist"
    folder.mkdir(parents=True)
    labels = np.arange(20, dtype=np.uint8) % 10
    arrays = {"x": np.zeros((20, 28, 28), np.uint8), "y": labels, "test": np.zeros(20, bool)}
    (folder / "mnist.npz.xz").write_bytes(encode_xz(arrays))


def test_decode_cache_is_a_temporary_directory_and_home_cache_is_untouched(tmp_path, monkeypatch):
    """A dataset file without SHA256SUMS is cached under its size and mtime: every test writing one
    would add a file to ~/.cache/pfedkit (61 MB after one suite). The suite's cache is a temporary
    directory instead."""
    cache = Path(os.environ.get("PFEDKIT_CACHE", Path.home() / ".cache" / "pfedkit")).resolve()
    assert cache.is_relative_to(Path(tempfile.gettempdir()).resolve()), cache
    home_cache = Path.home() / ".cache" / "pfedkit"
    before = sorted(home_cache.glob("*")) if home_cache.is_dir() else []
    monkeypatch.setattr(datasets, "_LOADED", {})
    _write_mnist_like(tmp_path / "data")
    load_dataset("mnist", str(tmp_path / "data"))  # no cache_dir: the default cache, as runs use
    assert list(cache.glob("mnist-*.npz")), "decoded once into the suite's cache"
    assert (sorted(home_cache.glob("*")) if home_cache.is_dir() else []) == before
