"""`pfedkit data fetch femnist`, offline: a tiny parquet in flwrlabs/femnist's layout (image, writer_id,
hsf_id, character) served by a replacement of `download.download_hub`; and the class-subset datasets
built on fetched files (femnist_lower10, cifar100_first20)."""
from __future__ import annotations

import hashlib
import shutil
import sys

import numpy as np
import pytest

from pfedkit.cli import main
from pfedkit.data import download as download_module
from pfedkit.data.converters import FEMNIST_CLASSES
from pfedkit.data.datasets import load_dataset

datasets = pytest.importorskip("datasets")
from PIL import Image  # noqa: E402  (Pillow comes with datasets)

datasets.disable_progress_bars()  # the fixtures' to_parquet bar would land in the captured stderr

RNG = np.random.default_rng(1)
# rows: (writer, label); labels 36-45 are a-j (femnist_lower10), 61 is z, 0-9 digits
ROWS = [("f0000_14", 36), ("f0000_14", 0), ("f0000_14", 45), ("f0003_07", 61), ("f0003_07", 37),
        ("f0001_41", 36), ("f0001_41", 9), ("f0001_41", 40), ("f0001_41", 40)]


def _femnist_parquet(path, rows=ROWS, names=None):
    """A parquet file as `datasets` pushes it to the Hub (schema metadata included); returns the
    images and labels it holds."""
    images = RNG.integers(0, 256, (len(rows), 28, 28), dtype=np.uint8)
    features = datasets.Features({
        "image": datasets.Image(), "writer_id": datasets.Value("string"), "hsf_id": datasets.Value("int64"),
        "character": datasets.ClassLabel(names=names or FEMNIST_CLASSES)})
    table = datasets.Dataset.from_dict({
        "image": [Image.fromarray(image, mode="L") for image in images],
        "writer_id": [writer for writer, _ in rows], "hsf_id": [4] * len(rows),
        "character": [label for _, label in rows]}, features=features)
    table.to_parquet(str(path))
    return images, np.array([label for _, label in rows], np.uint8)


class FakeHub:
    """Replaces `download.download_hub`: copies the fixture shards into the download folder."""

    def __init__(self, shards):
        self.shards, self.calls = shards, []

    def __call__(self, repo_id, revision, folder):
        self.calls.append(repo_id)
        target = folder / "data"
        target.mkdir(parents=True, exist_ok=True)
        for shard in self.shards:
            shutil.copy(shard, target / shard.name)
        return sorted(target.glob("*.parquet"))


def _visible_files(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and ".downloads" not in p.parts)


@pytest.fixture
def hub(tmp_path, monkeypatch):
    shards = [tmp_path / "src" / "train-00000-of-00002.parquet", tmp_path / "src" / "train-00001-of-00002.parquet"]
    shards[0].parent.mkdir()
    first = _femnist_parquet(shards[0], ROWS[:4])
    second = _femnist_parquet(shards[1], ROWS[4:])
    server = FakeHub(shards)
    monkeypatch.setattr(download_module, "download_hub", server)
    images = np.concatenate([first[0], second[0]])
    labels = np.concatenate([first[1], second[1]])
    return server, images, labels


def test_femnist_round_trips_pixels_labels_writers_and_checksum(hub, tmp_path, capsys):
    server, images, labels = hub
    root = tmp_path / "data"
    assert main(["data", "fetch", "femnist", "--data-dir", str(root), "-q"]) == 0
    assert server.calls == ["flwrlabs/femnist"]
    target = root / "femnist" / "femnist.npz.xz"
    digest = hashlib.sha256(target.read_bytes()).hexdigest()
    assert f"{digest}  femnist/femnist.npz.xz" in (root / "SHA256SUMS").read_text().splitlines()
    assert "3 writers" in capsys.readouterr().err
    assert not (root / ".downloads" / "femnist").exists()

    data = load_dataset("femnist", str(root), cache_dir=str(tmp_path / "cache"))  # checks SHA256SUMS too
    np.testing.assert_array_equal(data.stored, images)
    assert data.stored.dtype == np.uint8 and data.num_classes == 62
    np.testing.assert_array_equal(data.y, labels)
    assert not data.official_test.any(), "FEMNIST has no official test split"
    np.testing.assert_array_equal(data.writer_names[data.writer], [writer for writer, _ in ROWS])


def test_femnist_lower10_keeps_a_to_j_relabelled_with_their_writers(hub, tmp_path):
    _, images, labels = hub
    root = tmp_path / "data"
    assert main(["data", "fetch", "femnist_lower10", "--data-dir", str(root), "-q"]) == 0  # fetches femnist
    data = load_dataset("femnist_lower10", str(root), cache_dir=str(tmp_path / "cache"))
    keep = (labels >= 36) & (labels <= 45)
    np.testing.assert_array_equal(data.stored, images[keep])
    np.testing.assert_array_equal(data.y, labels[keep] - 36)
    assert data.num_classes == 10
    np.testing.assert_array_equal(data.writer_names[data.writer],
                                  [writer for (writer, _), kept in zip(ROWS, keep) if kept])


def test_truncated_parquet_is_refused_in_one_line_and_leaves_nothing(tmp_path, monkeypatch, capsys):
    shard = tmp_path / "train-00000-of-00001.parquet"
    _femnist_parquet(shard)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    monkeypatch.setattr(download_module, "download_hub", FakeHub([shard]))
    root = tmp_path / "data"
    assert main(["data", "fetch", "femnist", "--data-dir", str(root), "-q"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "do not convert" in err
    assert _visible_files(root) == []
    assert not (root / ".downloads" / "femnist").exists(), "a corrupt source is never reused"


def test_foreign_class_order_is_refused(tmp_path, monkeypatch, capsys):
    """femnist_lower10 picks classes by label: a shuffled ClassLabel would pick the wrong letters."""
    shard = tmp_path / "train-00000-of-00001.parquet"
    _femnist_parquet(shard, names=sorted(FEMNIST_CLASSES, key=str.lower))
    monkeypatch.setattr(download_module, "download_hub", FakeHub([shard]))
    assert main(["data", "fetch", "femnist", "--data-dir", str(tmp_path / "data"), "-q"]) == 2
    assert "differ from FEMNIST's" in capsys.readouterr().err
    assert _visible_files(tmp_path / "data") == []


def test_missing_datasets_library_names_the_extra(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    assert main(["data", "fetch", "femnist", "--data-dir", str(tmp_path), "-q"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install 'pfedkit[hf]'" in err


def test_hub_failure_is_one_line(tmp_path, monkeypatch, capsys):
    def offline(repo_id, revision, folder):
        raise ConnectionError("Max retries exceeded with url:\n /api/datasets/flwrlabs/femnist")

    monkeypatch.setattr(download_module, "download_hub", offline)
    assert main(["data", "fetch", "femnist", "--data-dir", str(tmp_path), "-q"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "run the same command again to resume" in err
