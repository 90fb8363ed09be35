"""The image sets' file format: `<name>/<name>.npz.xz` with arrays x (uint8 images, (N, H, W) or
(N, H, W, C)), y (integer labels), test (bool: the official test split) and, for datasets with
writers (FEMNIST), writer (each row's writer, an index) and writer_names (the writers' ids).

`read_checked` is what the loader and `pfedkit data fetch` (reading back what it is about to
write) both apply, so a file fetch installs is a file the loader accepts.
"""
from __future__ import annotations

import zipfile
from pathlib import Path
from typing import BinaryIO

import numpy as np

from pfedkit.data.store import (DataError, Dataset, DatasetInfo, NamedArrays, normalise_images,
                                read_dataset_file)

WRITER_ARRAYS = ("writer", "writer_names")  # optional: each row's writer index, the writers' ids


def load_images(info: DatasetInfo, root: Path, cache_dir: str | None = None) -> Dataset:
    """The dataset in `root/<info.name>/<info.name>.npz.xz`, checked, decoded once into the cache."""
    arrays = read_dataset_file(root, info.name, cache_dir, lambda file, source: read_checked(file, info, source))
    writer = arrays.get("writer")
    return Dataset(info.name, arrays["x"], arrays["y"].astype(np.int64), arrays["test"].astype(bool),
                   info.num_classes, None if writer is None else writer.astype(np.int32),
                   arrays.get("writer_names"))


def read_checked(file: Path | BinaryIO, info: DatasetInfo, source: Path) -> NamedArrays:
    """The arrays of a decoded .npz (a path or bytes), checked against `info` (`check_arrays`,
    `check_writers`); DataError naming `source` for anything else."""
    arrays = load_npz(file, source)
    check_arrays(arrays, info, source)
    check_writers(arrays, info, source)
    return arrays


def load_npz(file: Path | BinaryIO, source: Path) -> NamedArrays:
    """x, y, test (and writer, writer_names when stored) from an .npz (a path or bytes); DataError
    naming `source` for anything else. allow_pickle=False: writer ids are a fixed-width str array."""
    try:
        loaded = np.load(file, allow_pickle=False)
        if not isinstance(loaded, np.lib.npyio.NpzFile):  # a lone .npy array
            raise ValueError("not an .npz archive")
        with loaded as arrays:
            missing = {"x", "y", "test"} - set(arrays.files)
            if missing:
                raise DataError(f"dataset file {source} lacks arrays {sorted(missing)}; expected x, y, test")
            return {key: arrays[key] for key in ("x", "y", "test", *WRITER_ARRAYS) if key in arrays.files}
    except DataError:
        raise
    except (ValueError, OSError, EOFError, zipfile.BadZipFile):
        raise DataError(f"dataset file {source} does not hold an .npz archive (arrays x, y, test) inside its xz "
                        "wrapping; copy the file again (format: ../shared/datasets/README.md)") from None


def check_arrays(arrays: NamedArrays, info: DatasetInfo, source: Path) -> None:
    """The arrays must describe one sample per row: as many labels and test flags as images,
    integer labels in [0, classes), images of the dataset's shape. Anything else would train on
    misaligned labels (a file whose x and y lengths differed reported 100% accuracy)."""
    x, y, test = arrays["x"], arrays["y"], arrays["test"]
    if not (len(x) == len(y) == len(test)):
        raise DataError(f"dataset file {source}: x has {len(x)} rows, y {len(y)} and test {len(test)}; "
                        "expected one label and one test flag per image")
    if y.ndim != 1 or not np.issubdtype(y.dtype, np.integer):
        raise DataError(f"dataset file {source}: y must be a 1-D integer array of labels "
                        f"(got shape {y.shape}, dtype {y.dtype})")
    if len(y) and (y.min() < 0 or y.max() >= info.num_classes):
        raise DataError(f"dataset file {source}: labels run from {y.min()} to {y.max()}; {info.name} has "
                        f"{info.num_classes} classes, labelled 0..{info.num_classes - 1}")
    shape = tuple(normalise_images(x[:1]).shape[1:]) if x.ndim in (3, 4) else tuple(x.shape[1:])
    if x.dtype != np.uint8 or shape != info.input_shape:
        raise DataError(f"dataset file {source}: images of shape {tuple(x.shape[1:])} and dtype {x.dtype}; "
                        f"expected uint8 images giving inputs of shape {info.input_shape}")


def check_writers(arrays: NamedArrays, info: DatasetInfo, source: Path) -> None:
    """The writer arrays: present exactly when the dataset has writers, one writer per row,
    indices into writer_names."""
    present = [key for key in WRITER_ARRAYS if key in arrays]
    if info.writers and len(present) < len(WRITER_ARRAYS):
        raise DataError(f"dataset file {source}: {info.name} needs arrays writer and writer_names (one writer per "
                        f"image); get the file again with `pfedkit data fetch {info.name}`")
    if present and len(present) < len(WRITER_ARRAYS):
        raise DataError(f"dataset file {source}: has {present[0]} without "
                        f"{[k for k in WRITER_ARRAYS if k not in present][0]}; expected both or neither")
    if present:
        writer, names = arrays["writer"], arrays["writer_names"]
        if writer.shape != arrays["y"].shape or not np.issubdtype(writer.dtype, np.integer) \
                or names.ndim != 1 or names.dtype.kind != "U":
            raise DataError(f"dataset file {source}: writer must be one integer per image and writer_names a "
                            f"1-D str array (got writer {writer.shape} {writer.dtype}, writer_names {names.shape} "
                            f"{names.dtype})")
        if len(writer) and (writer.min() < 0 or writer.max() >= len(names)):
            raise DataError(f"dataset file {source}: writer indices run from {writer.min()} to {writer.max()} "
                            f"but {len(names)} writer names are stored")

