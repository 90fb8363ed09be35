"""`pfedkit data fetch tiny_imagenet` on a tiny zip in the cs231n layout, CIFAR-100's first-20-classes
subset (DA-PFL) on a tiny CIFAR-100 fixture, and the papers' models on 64x64 inputs."""
from __future__ import annotations

import io
import zipfile

import numpy as np
import pytest
import torch
from PIL import Image
from test_fetch import _batch, _serve, _tar_gz, _visible_files

from pfedkit.cli import main
from pfedkit.config import load_config
from pfedkit.data.datasets import load_dataset
from pfedkit.models import build_model

RNG = np.random.default_rng(2)
WNIDS = ["n02124075", "n01443537", "n09999999"]  # sorted: n01443537 -> 0, n02124075 -> 1, n09999999 -> 2


def _png(image: np.ndarray) -> bytes:
    # PNG bytes under a .JPEG name: PIL reads by content, and lossless pixels can be compared exactly
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="PNG")
    return buffer.getvalue()


def _tiny_zip(size: int = 64, gray_first: bool = True):
    """wnids.txt, two train images per wnid (the first grayscale), three val images; returns the zip
    bytes and the expected x, y, test in pfedkit's order (train by label then name, val by name)."""
    root = "tiny-imagenet-200/"
    members, train, val = {root + "wnids.txt": "\n".join(WNIDS).encode()}, [], []
    for wnid in WNIDS:
        label = sorted(WNIDS).index(wnid)
        for index in range(2):
            if index == 0 and gray_first:
                gray = RNG.integers(0, 256, (size, size), dtype=np.uint8)
                image, pixels = gray, np.repeat(gray[:, :, None], 3, axis=2)
            else:
                image = pixels = RNG.integers(0, 256, (size, size, 3), dtype=np.uint8)
            name = f"{root}train/{wnid}/images/{wnid}_{index}.JPEG"
            members[name] = _png(image)
            members[f"{root}train/{wnid}/{wnid}_boxes.txt"] = b""
            train.append((label, name, pixels))
    annotations = []
    for index, wnid in enumerate(["n09999999", "n01443537", "n09999999"]):
        image = RNG.integers(0, 256, (size, size, 3), dtype=np.uint8)
        members[f"{root}val/images/val_{index}.JPEG"] = _png(image)
        annotations.append(f"val_{index}.JPEG\t{wnid}\t0\t0\t63\t63")
        val.append((sorted(WNIDS).index(wnid), f"val_{index}", image))
    members[root + "val/val_annotations.txt"] = "\n".join(annotations).encode()
    members[root + "test/images/test_0.JPEG"] = _png(RNG.integers(0, 256, (size, size, 3), dtype=np.uint8))
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name, payload in members.items():
            archive.writestr(name, payload)
    train.sort(key=lambda item: (item[0], item[1]))
    val.sort(key=lambda item: (item[0], item[1]))
    rows = train + val
    return buffer.getvalue(), (np.stack([r[2] for r in rows]), np.array([r[0] for r in rows]),
                               np.array([False] * len(train) + [True] * len(val)))


def test_tiny_imagenet_converts_exactly(tmp_path, monkeypatch):
    archive, (x, y, test) = _tiny_zip()
    _serve(monkeypatch, "tiny_imagenet", {"tiny-imagenet-200.zip": archive})
    root = tmp_path / "data"
    assert main(["data", "fetch", "tiny_imagenet", "--data-dir", str(root), "-q"]) == 0
    data = load_dataset("tiny_imagenet", str(root), cache_dir=str(tmp_path / "cache"))
    assert data.stored.shape == (9, 64, 64, 3) and data.stored.dtype == np.uint8
    np.testing.assert_array_equal(data.stored, x)
    np.testing.assert_array_equal(data.y, y)
    np.testing.assert_array_equal(data.official_test, test)  # val = the official test split
    assert data.input_shape == (3, 64, 64) and data.num_classes == 200


def test_tiny_imagenet_wrong_image_size_is_refused(tmp_path, monkeypatch, capsys):
    archive, _ = _tiny_zip(size=32)
    _serve(monkeypatch, "tiny_imagenet", {"tiny-imagenet-200.zip": archive})
    assert main(["data", "fetch", "tiny_imagenet", "--data-dir", str(tmp_path), "-q"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "expected 64x64" in err
    assert _visible_files(tmp_path) == []


def test_tiny_imagenet_truncated_zip_is_refused(tmp_path, monkeypatch, capsys):
    archive, _ = _tiny_zip()
    _serve(monkeypatch, "tiny_imagenet", {"tiny-imagenet-200.zip": archive[: len(archive) // 2]})
    assert main(["data", "fetch", "tiny_imagenet", "--data-dir", str(tmp_path), "-q"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "does not convert" in err
    assert _visible_files(tmp_path) == []


@pytest.mark.parametrize("name, options", [("resnet18", {}), ("resnet18", {"stem": "imagenet"}), ("cnn", {}),
                                           ("cnn_cifar", {}), ("cnn_cifar100", {}), ("alexnet", {})])
def test_models_adapt_to_64x64_inputs(name, options):
    torch.manual_seed(0)
    model = build_model(name, (3, 64, 64), 200, **options)
    logits = model(torch.zeros(2, 3, 64, 64))
    assert logits.shape == (2, 200)
    assert model.head(model.body(torch.zeros(1, 3, 64, 64))).shape == (1, 200)


def test_cifar100_first20_keeps_classes_0_to_19(tmp_path, monkeypatch):
    x_train = RNG.integers(0, 256, (6, 32, 32, 3), dtype=np.uint8)
    y_train = np.array([0, 57, 19, 20, 12, 99], np.uint8)
    x_test = RNG.integers(0, 256, (3, 32, 32, 3), dtype=np.uint8)
    y_test = np.array([19, 3, 21], np.uint8)
    archive = _tar_gz({"cifar-100-python/train": _batch(x_train, y_train, b"fine_labels"),
                       "cifar-100-python/test": _batch(x_test, y_test, b"fine_labels")})
    _serve(monkeypatch, "cifar100", {"cifar-100-python.tar.gz": archive})
    root = tmp_path / "data"
    assert main(["data", "fetch", "cifar100_first20", "--data-dir", str(root), "-q"]) == 0  # fetches cifar100
    assert (root / "cifar100" / "cifar100.npz.xz").is_file()
    data = load_dataset("cifar100_first20", str(root), cache_dir=str(tmp_path / "cache"))
    np.testing.assert_array_equal(data.stored, np.concatenate([x_train[[0, 2, 4]], x_test[[0, 1]]]))
    np.testing.assert_array_equal(data.y, [0, 19, 12, 19, 3])
    np.testing.assert_array_equal(data.official_test, [False, False, False, True, True])
    assert data.num_classes == 20
    config = load_config({"dataset": "cifar100_first20"})
    assert config.model == "cnn_cifar100"
    assert build_model(config.model, data.input_shape, data.num_classes)(torch.zeros(1, 3, 32, 32)).shape == (1, 20)


def test_subset_with_missing_file_names_the_fetch_of_its_source(tmp_path, capsys):
    assert main(["run", "-q", "dataset=cifar100_first20", f"data_dir={tmp_path}", f"out_dir={tmp_path / 'runs'}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "`pfedkit data fetch cifar100 --data-dir" in err
