"""The published formats of the downloadable image sets, converted to pfedkit's arrays (x uint8
images, y uint8 labels, test bool; FEMNIST adds writer and writer_names): MNIST's IDX files,
CIFAR's python-pickle archives, Tiny-ImageNet's cs231n zip and FEMNIST's Hub parquet shards.

Each `convert_*` is a `Source.convert` (data/sources.py): (downloaded files, progress) -> arrays.
Official training rows come first, then the official test rows, in the published order. A
converter only receives files whose published MD5 matched (data/fetch.py converts after
`download.obtain_all`, which checks each file), so CIFAR's pickles are unpickled only once
they are the published bytes, and even then by `_ArraysOnlyUnpickler`.

FEMNIST (`flwrlabs/femnist`, LEAF's FEMNIST) is read with the Hugging Face `datasets` library (the
optional `hf` extra); it has no official test split. Tiny-ImageNet: its `val` split (labelled) is
the official test split.
"""
from __future__ import annotations

import gzip
import io
import pickle
import struct
import sys
import tarfile
import zipfile
from pathlib import Path

import numpy as np

from pfedkit.data.hf import require_datasets
from pfedkit.data.store import NamedArrays

Arrays = tuple[np.ndarray, np.ndarray, np.ndarray]  # x, y, test


def _read_idx(path: Path, dims: int) -> np.ndarray:
    """An IDX file (gzip-wrapped, big-endian header: 0, 0, type 0x08 = uint8, rank) as uint8."""
    with gzip.open(path, "rb") as handle:
        raw = handle.read()
    magic = struct.pack(">BBBB", 0, 0, 0x08, dims)
    if raw[:4] != magic:
        raise ValueError(f"not a uint8 IDX file of rank {dims}")
    shape = struct.unpack(f">{dims}I", raw[4:4 + 4 * dims])
    body = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * dims)
    if body.size != int(np.prod(shape)):
        raise ValueError(f"header says {shape} but {body.size} values follow")
    return body.reshape(shape)


def convert_idx(files: dict[str, Path], progress: bool = False) -> Arrays:
    """MNIST layout (also Fashion-MNIST): official train then official test, in published order."""
    x_train = _read_idx(files["train-images-idx3-ubyte.gz"], 3)
    y_train = _read_idx(files["train-labels-idx1-ubyte.gz"], 1)
    x_test = _read_idx(files["t10k-images-idx3-ubyte.gz"], 3)
    y_test = _read_idx(files["t10k-labels-idx1-ubyte.gz"], 1)
    return _join(x_train, y_train, x_test, y_test)


class _ArraysOnlyUnpickler(pickle.Unpickler):
    """The CIFAR archives are pickles, and unpickling can run arbitrary code: allow only what a
    pickled numpy array needs, so a tampered archive fails instead of executing. (A second line
    of defence: the archive reaching here has already matched its published MD5.)"""
    ALLOWED = {("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
               ("numpy", "ndarray"), ("numpy", "dtype"),
               ("_codecs", "encode")}  # how Python 3 writes bytes at pickle protocol 2 (a re-pickled batch)

    def find_class(self, module: str, name: str):
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"unexpected object {module}.{name} in a CIFAR batch")
        return super().find_class(module, name)


def _cifar_batches(archive: Path, members: list[str], label_key: bytes) -> tuple[np.ndarray, np.ndarray]:
    """Images (N, 32, 32, 3) and labels of the named batches of a CIFAR python-pickle tar.gz."""
    images, labels = [], []
    with tarfile.open(archive, "r:gz") as tar:
        for member in members:
            handle = tar.extractfile(member)
            if handle is None:
                raise ValueError(f"{member} is not a file in the archive")
            batch = _ArraysOnlyUnpickler(io.BytesIO(handle.read()), encoding="bytes").load()
            data = np.asarray(batch[b"data"], dtype=np.uint8)
            # rows are 3072 values, channel-major (R plane, G, B): to channels-last images
            images.append(data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1))
            labels.append(np.asarray(batch[label_key], dtype=np.uint8))
    return np.ascontiguousarray(np.concatenate(images)), np.concatenate(labels)


def convert_cifar10(files: dict[str, Path], progress: bool = False) -> Arrays:
    archive = files["cifar-10-python.tar.gz"]
    x_train, y_train = _cifar_batches(archive, [f"cifar-10-batches-py/data_batch_{i}" for i in range(1, 6)], b"labels")
    x_test, y_test = _cifar_batches(archive, ["cifar-10-batches-py/test_batch"], b"labels")
    return _join(x_train, y_train, x_test, y_test)


def convert_cifar100(files: dict[str, Path], progress: bool = False) -> Arrays:
    archive = files["cifar-100-python.tar.gz"]  # the 100 fine labels (the papers' CIFAR-100)
    x_train, y_train = _cifar_batches(archive, ["cifar-100-python/train"], b"fine_labels")
    x_test, y_test = _cifar_batches(archive, ["cifar-100-python/test"], b"fine_labels")
    return _join(x_train, y_train, x_test, y_test)


def _join(x_train: np.ndarray, y_train: np.ndarray, x_test: np.ndarray, y_test: np.ndarray) -> Arrays:
    if len(x_train) != len(y_train) or len(x_test) != len(y_test):
        raise ValueError(f"{len(x_train)} training images but {len(y_train)} labels, "
                         f"{len(x_test)} test images but {len(y_test)} labels")
    test = np.concatenate([np.zeros(len(y_train), bool), np.ones(len(y_test), bool)])
    return np.concatenate([x_train, x_test]), np.concatenate([y_train, y_test]).astype(np.uint8), test


# --- Tiny-ImageNet (cs231n zip) ----------------------------------------------------------------

TINY_ROOT = "tiny-imagenet-200/"
TINY_SIZE = (64, 64)


def convert_tiny_imagenet(files: dict[str, Path], progress: bool = False) -> Arrays:
    """train/<wnid>/images/*.JPEG (official training split) then val/images/*.JPEG labelled by
    val/val_annotations.txt (official test split); label = the wnid's position in sorted wnids.txt
    (torchvision ImageFolder's order). Grayscale JPEGs become RGB; every image must be 64x64."""
    with zipfile.ZipFile(files["tiny-imagenet-200.zip"]) as archive:
        wnids = sorted(archive.read(TINY_ROOT + "wnids.txt").decode().split())
        label_of = {wnid: index for index, wnid in enumerate(wnids)}
        train = []
        for member in archive.namelist():
            parts = member.split("/")  # tiny-imagenet-200/train/<wnid>/images/<file>.JPEG
            if len(parts) == 5 and parts[1] == "train" and parts[3] == "images" and parts[4].endswith(".JPEG"):
                train.append((label_of[parts[2]], member))
        annotations = archive.read(TINY_ROOT + "val/val_annotations.txt").decode().splitlines()
        val = [(label_of[fields[1]], TINY_ROOT + "val/images/" + fields[0])
               for fields in (line.split("\t") for line in annotations if line.strip())]
        train.sort()
        val.sort()
        if not train or not val:
            raise ValueError(f"{len(train)} training and {len(val)} validation images found; expected both")
        images = np.empty((len(train) + len(val), *TINY_SIZE, 3), dtype=np.uint8)
        for row, (_, member) in enumerate(_bar(train + val, "decoding", progress)):
            images[row] = _rgb_image(archive.read(member), member)
    labels = np.array([label for label, _ in train + val], dtype=np.uint8)
    test = np.concatenate([np.zeros(len(train), bool), np.ones(len(val), bool)])
    return images, labels, test


def _rgb_image(payload: bytes, member: str) -> np.ndarray:
    from PIL import Image

    with Image.open(io.BytesIO(payload)) as image:
        if image.size != TINY_SIZE:
            raise ValueError(f"{member} is {image.size[0]}x{image.size[1]}, expected 64x64")
        return np.asarray(image.convert("RGB"), dtype=np.uint8)


def _bar(items, label: str, progress: bool):
    from tqdm import tqdm

    return tqdm(items, desc=label, unit="img", disable=not progress, file=sys.stderr, mininterval=1.0)


# --- FEMNIST (Hugging Face Hub parquet, read with `datasets`) ------------------------------------

FEMNIST_CLASSES = [*"0123456789", *"ABCDEFGHIJKLMNOPQRSTUVWXYZ", *"abcdefghijklmnopqrstuvwxyz"]
FEMNIST_SIZE = (28, 28)
HUB_BATCH = 2048


def convert_femnist(files: list[Path], progress: bool = False) -> NamedArrays:
    """Rows in published order: image (28x28 grayscale, as published: dark ink on white),
    character (62 classes: digits, A-Z, a-z), writer_id (kept as `writer` + `writer_names`)."""
    import pyarrow.parquet as pq

    datasets = require_datasets("data fetch femnist needs")
    # Each file's footer first: a truncated or foreign file fails here, before anything is decoded.
    total = sum(pq.ParquetFile(path).metadata.num_rows for path in files)
    stream = datasets.load_dataset("parquet", data_files=[str(path) for path in files], split="train",
                                   streaming=True)
    _check_femnist_columns(stream.features)
    images = np.empty((total, *FEMNIST_SIZE), dtype=np.uint8)
    labels = np.empty(total, dtype=np.uint8)
    writer_ids: list[str] = []
    row = 0
    with _bar(None, "converting", progress) as bar:
        bar.total = total
        for batch in stream.iter(batch_size=HUB_BATCH):
            count = len(batch["character"])
            if row + count > total:
                raise ValueError(f"more rows than the files' metadata announce ({total})")
            for offset, item in enumerate(batch["image"]):
                images[row + offset] = _gray_image(item, row + offset)
            labels[row:row + count] = _femnist_labels(batch["character"])
            writer_ids += [str(writer) for writer in batch["writer_id"]]
            row += count
            bar.update(count)
    if row != total:
        raise ValueError(f"{row} rows read but the files' metadata announce {total}")
    writer_names, writer = np.unique(np.array(writer_ids, dtype=str), return_inverse=True)
    return {"x": images, "y": labels, "test": np.zeros(total, bool),  # no official test split
            "writer": writer.astype(np.int32), "writer_names": writer_names}


def _check_femnist_columns(features) -> None:
    """The columns must be there, and a ClassLabel's names in FEMNIST's order (femnist_lower10
    picks its classes by label)."""
    if features is None:
        return  # no schema stored: the rows' own keys and label range are checked as they come
    missing = {"image", "character", "writer_id"} - set(features)
    if missing:
        raise KeyError(f"columns {sorted(missing)} missing (found {sorted(features)})")
    names = getattr(features["character"], "names", None)
    if names is not None and list(names) != FEMNIST_CLASSES:
        raise ValueError(f"character classes {list(names)[:12]}... differ from FEMNIST's 0-9, A-Z, a-z")


def _femnist_labels(values) -> np.ndarray:
    labels = np.asarray(values)
    if not np.issubdtype(labels.dtype, np.integer) or labels.min() < 0 or labels.max() >= len(FEMNIST_CLASSES):
        raise ValueError(f"character must be class ids 0..{len(FEMNIST_CLASSES) - 1} (got {labels[:5]}...)")
    return labels.astype(np.uint8)


def _gray_image(item, row: int) -> np.ndarray:
    """A decoded PIL image, or the {bytes, path} struct of an undecoded one, as 28x28 uint8."""
    from PIL import Image

    image = item if isinstance(item, Image.Image) else Image.open(io.BytesIO(item["bytes"]))
    if image.size != FEMNIST_SIZE:
        raise ValueError(f"image {row} is {image.size[0]}x{image.size[1]}, expected 28x28")
    return np.asarray(image.convert("L"), dtype=np.uint8)
