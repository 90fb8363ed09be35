"""`dataset=hf:...` (pfedkit/data/hf.py) and `pfedkit data export` (pfedkit/data/export.py) on tiny
`save_to_disk` folders: exact round trips, one conversion, one-line errors."""
from __future__ import annotations

import json
import shutil
import sys

import numpy as np
import pytest

datasets = pytest.importorskip("datasets")

from pfedkit import cli  # noqa: E402
from pfedkit.config import load_config  # noqa: E402
from pfedkit.data import hf  # noqa: E402
from pfedkit.data.datasets import DataError, load_dataset  # noqa: E402
from pfedkit.data.export import MANIFEST  # noqa: E402
from pfedkit.data.federated import split_indices  # noqa: E402
from pfedkit.federation import split_plan  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread", "hf_cache")
CLASSES = ["ant", "bee", "cat", "dog"]


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PFEDKIT_CACHE", str(tmp_path / "cache"))
    hf._LOADED.clear()
    datasets.disable_progress_bars()


def images(shape, count=40, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (count, *shape), dtype=np.uint8)


def save_folder(path, x, y, test_rows=10, label_feature=None, image_column="image"):
    """A DatasetDict (train = the first rows, test = the last `test_rows`) saved with save_to_disk."""
    features = datasets.Features({image_column: datasets.Image(),
                                  "label": label_feature or datasets.ClassLabel(names=CLASSES)})
    cut = len(x) - test_rows
    parts = {"train": (x[:cut], y[:cut]), "test": (x[cut:], y[cut:])}
    datasets.DatasetDict({split: datasets.Dataset.from_dict({image_column: list(xs), "label": list(ys)},
                                                            features=features)
                          for split, (xs, ys) in parts.items()}).save_to_disk(str(path))
    return path


@pytest.fixture
def gray_folder(tmp_path):
    x, y = images((8, 8)), np.arange(40) % 4
    return save_folder(tmp_path / "gray", x, y), x, y


def test_folder_round_trips_pixels_labels_names_and_test_split(gray_folder):
    folder, x, y = gray_folder
    data = load_dataset(f"hf:{folder}")
    assert data.stored.dtype == np.uint8 and np.array_equal(data.stored, x)
    assert np.array_equal(data.y, y) and data.y.dtype == np.int64
    assert np.array_equal(data.official_test, np.arange(40) >= 30)
    assert data.num_classes == 4 and data.class_names == tuple(CLASSES)
    assert data.input_shape == (1, 8, 8)
    assert np.array_equal(data.rows([3]), (x[3:4, None].astype(np.float32) / 255 - 0.5) / 0.5)


def test_rgb_images_and_test_split_first_in_the_dict(tmp_path):
    x, y = images((6, 5, 3)), np.arange(40) % 4
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=CLASSES)})
    # `test` first in the dict: pfedkit still puts the other splits (validation = training data) first
    datasets.DatasetDict({
        "test": datasets.Dataset.from_dict({"image": list(x[30:]), "label": y[30:]}, features=features),
        "train": datasets.Dataset.from_dict({"image": list(x[:20]), "label": y[:20]}, features=features),
        "validation": datasets.Dataset.from_dict({"image": list(x[20:30]), "label": y[20:30]}, features=features),
    }).save_to_disk(str(tmp_path / "rgb"))
    data = load_dataset(f"hf:{tmp_path / 'rgb'}")
    assert np.array_equal(data.stored, x) and np.array_equal(data.y, y)
    assert np.array_equal(data.official_test, np.arange(40) >= 30)
    assert data.input_shape == (3, 6, 5)


def test_second_load_reads_the_cache_and_a_rewritten_folder_converts_again(gray_folder, monkeypatch):
    folder, x, y = gray_folder
    calls = []
    real_convert = hf.convert
    monkeypatch.setattr(hf, "convert", lambda *a: calls.append(1) or real_convert(*a))
    load_dataset(f"hf:{folder}")
    hf._LOADED.clear()  # a new process
    again = load_dataset(f"hf:{folder}")
    assert len(calls) == 1 and np.array_equal(again.stored, x)
    # the folder rewritten (one pixel changed): a new fingerprint, so converted again
    hf._LOADED.clear()
    changed = x.copy()
    changed[0, 0, 0] ^= 1
    save_folder(folder.parent / "tmp_rewrite", changed, y)
    shutil.rmtree(folder)
    shutil.move(folder.parent / "tmp_rewrite", folder)
    rewritten = load_dataset(f"hf:{folder}")
    assert len(calls) == 2 and np.array_equal(rewritten.stored, changed)


def test_wrong_column_is_one_line_listing_the_columns(gray_folder):
    folder, _, _ = gray_folder
    config = load_config(None, [f"dataset=hf:{folder}", "data.image_column=img"])
    with pytest.raises(DataError) as err:
        load_dataset(config.dataset, options=config.data)
    message = str(err.value)
    assert "\n" not in message and "data.image_column" in message and "columns: image, label" in message


def test_images_of_different_shapes_are_refused_in_one_line(tmp_path):
    x = list(images((8, 8), 20)) + list(images((9, 8), 20, seed=1))
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=CLASSES)})
    datasets.Dataset.from_dict({"image": x, "label": [i % 4 for i in range(40)]},
                               features=features).save_to_disk(str(tmp_path / "ragged"))
    with pytest.raises(DataError) as err:
        load_dataset(f"hf:{tmp_path / 'ragged'}")
    assert "\n" not in str(err.value) and "8x8 grayscale" in str(err.value) and "9x8 grayscale" in str(err.value)


def test_grayscale_mixed_with_rgb_is_refused(tmp_path):
    x = list(images((8, 8), 20)) + list(images((8, 8, 3), 20, seed=1))
    features = datasets.Features({"image": datasets.Image(), "label": datasets.Value("int64")})
    datasets.Dataset.from_dict({"image": x, "label": [i % 4 for i in range(40)]},
                               features=features).save_to_disk(str(tmp_path / "mixed"))
    with pytest.raises(DataError, match="different shapes"):
        load_dataset(f"hf:{tmp_path / 'mixed'}")


def test_string_labels_become_sorted_ids_with_their_names(tmp_path):
    x = images((4, 4), 12)
    words = ["zebra", "ant", "moth"] * 4
    datasets.Dataset.from_dict({"pixels": list(x), "kind": words},
                               features=datasets.Features({"pixels": datasets.Image(), "kind": datasets.Value("string")})
                               ).save_to_disk(str(tmp_path / "words"))
    config = load_config(None, [f"dataset=hf:{tmp_path / 'words'}", "data.image_column=pixels",
                                "data.label_column=kind"])
    data = load_dataset(config.dataset, options=config.data)
    assert data.class_names == ("ant", "moth", "zebra")
    assert [data.class_names[i] for i in data.y] == words
    assert not data.official_test.any()  # a lone Dataset is all training data


def test_missing_library_names_the_extra(gray_folder, monkeypatch):
    folder, _, _ = gray_folder
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` now raises ImportError
    with pytest.raises(DataError) as err:
        load_dataset(f"hf:{folder}")
    assert "pip install 'pfedkit[hf]'" in str(err.value) and "\n" not in str(err.value)


def test_cli_run_two_rounds_on_a_folder_then_export_round_trips(gray_folder, tmp_path, capsys):
    folder, x, y = gray_folder
    code = cli.main(["run", f"dataset=hf:{folder}", "model=mlp", "rounds=2", "num_clients=4", "threads=1",
                     f"out_dir={tmp_path / 'runs'}", "-q"])
    assert code == 0
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert run_dir.name.startswith("fedavg-hf-gray-")
    metrics = (run_dir / "metrics.csv").read_text().splitlines()
    assert {line.split(",")[0] for line in metrics[1:]} >= {"1", "2"}

    out = tmp_path / "export"
    assert cli.main(["data", "export", str(run_dir), "--out", str(out)]) == 0
    exported = datasets.load_from_disk(str(out))
    with np.load(run_dir / "partition.npz") as saved:
        partition = dict(saved)
    assert list(exported) == [f"client_{c}" for c in range(4)]
    covered = []
    for cid in range(4):
        split = exported[f"client_{cid}"]
        test = np.array(split["test"])
        index = np.array(split["index"])
        assert np.array_equal(index[~test], partition[f"train_{cid}"])
        assert np.array_equal(index[test], partition[f"test_{cid}"])
        pixels = np.stack([np.asarray(image) for image in split["image"]])
        assert np.array_equal(pixels, x[index]) and np.array_equal(split["label"], y[index])
        assert set(split["client"]) == {cid}
        covered.append(index)
    assert np.array_equal(np.sort(np.concatenate(covered)), np.arange(40))  # disjoint and covering
    assert exported["client_0"].features["label"].names == CLASSES
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["dataset"] == f"hf:{folder}" and manifest["num_clients"] == 4

    assert cli.main(["data", "export", str(run_dir), "--out", str(out)]) == 2  # not an empty folder
    assert "not an empty folder" in capsys.readouterr().err


def test_export_of_a_config_matches_split_indices_and_loads_in_flwr_datasets(tmp_path):
    overrides = ["num_clients=5", "partition.scheme=pathological", "partition.classes_per_client=2", "seed=4"]
    out = tmp_path / "digits-export"
    assert cli.main(["data", "export", *overrides, "--out", str(out)]) == 0
    config = load_config(None, overrides)
    data = load_dataset("digits")
    train_index, test_index = split_indices(split_plan(config), data)
    exported = datasets.load_from_disk(str(out))
    for cid in range(5):
        split = exported[f"client_{cid}"]
        assert split.column_names == ["features", "label", "test", "index", "client"]
        test, index = np.array(split["test"]), np.array(split["index"])
        assert np.array_equal(index[~test], train_index[cid]) and np.array_equal(index[test], test_index[cid])
        assert np.array_equal(np.array(split["features"], dtype=np.float32), data.stored[index])


@pytest.mark.slow  # importing flwr_datasets takes 5-10 s here
def test_export_loads_as_flwr_datasets_natural_id_partitions(tmp_path):
    out = tmp_path / "digits-export"
    assert cli.main(["data", "export", "num_clients=5", "--out", str(out)]) == 0
    exported = datasets.load_from_disk(str(out))
    flwr_partitioner = pytest.importorskip("flwr_datasets.partitioner")
    partitioner = flwr_partitioner.NaturalIdPartitioner(partition_by="client")
    partitioner.dataset = datasets.concatenate_datasets([exported[f"client_{c}"] for c in range(5)])
    for cid in range(5):
        assert sorted(partitioner.load_partition(cid)["index"]) == sorted(exported[f"client_{cid}"]["index"])


def test_hub_dataset_is_loaded_once_per_name_and_revision(monkeypatch):
    x, y = images((5, 5, 3), 20), np.arange(20) % 4
    features = datasets.Features({"img": datasets.Image(), "label": datasets.ClassLabel(names=CLASSES)})
    hub = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"img": list(x), "label": y}, features=features)})
    calls = []

    def fake_load_dataset(name, revision=None):  # the network: replaced
        calls.append((name, revision))
        return hub

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    config = load_config(None, ["dataset=hf:someone/tiny-rgb", "data.image_column=img", "data.revision=v1"])
    first = load_dataset(config.dataset, options=config.data)
    assert calls == [("someone/tiny-rgb", "v1")] and np.array_equal(first.stored, x)
    hf._LOADED.clear()
    load_dataset(config.dataset, options=config.data)
    assert len(calls) == 1  # cached under (name, revision, columns)
    other = load_config(None, ["dataset=hf:someone/tiny-rgb", "data.image_column=img", "data.revision=v2"])
    hf._LOADED.clear()
    load_dataset(other.dataset, options=other.data)
    assert calls[-1] == ("someone/tiny-rgb", "v2")
    assert hf.file_label("hf:someone/tiny-rgb") == "hf-tiny-rgb"
