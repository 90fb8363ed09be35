"""Dataset loaders: the embedded `digits` set and the offline image sets of `../shared/datasets/`.

Every loader returns a `Dataset`: the images as stored (uint8), which its `rows` turns into
float32 normalised as the papers do (PFLlib: ToTensor then Normalize(0.5, 0.5) -> values in
[-1, 1]), integer labels, and a boolean mask of the official test split. Image files are `<name>/<name>.npz.xz` (an xz-wrapped `.npz`
with arrays x, y, test), checked against `SHA256SUMS` when the data directory has one, and
decompressed once into a local cache so later runs skip the slow xz decoding.
"""
from __future__ import annotations

import hashlib
import io
import lzma
import os
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pfedkit.atomic import atomic_write_bytes


class DataError(RuntimeError):
    """A dataset file is missing, corrupt or unreadable; the message says what to do."""


@dataclass(frozen=True)
class DatasetInfo:
    name: str
    num_classes: int
    input_shape: tuple[int, ...]
    num_samples: int
    embedded: bool
    description: str


DATASETS: dict[str, DatasetInfo] = {
    "digits": DatasetInfo("digits", 10, (64,), 1797, True,
                          "scikit-learn's bundled 8x8 handwritten digits (embedded default)"),
    "mnist": DatasetInfo("mnist", 10, (1, 28, 28), 70000, False, "MNIST 28x28 grayscale digits"),
    "fashion_mnist": DatasetInfo("fashion_mnist", 10, (1, 28, 28), 70000, False,
                                 "Fashion-MNIST 28x28 grayscale clothing"),
    "cifar10": DatasetInfo("cifar10", 10, (3, 32, 32), 59897, False,
                           "CIFAR-10 32x32 colour (shared copy: 59,897 of 60,000 images; fetched: all)"),
    "cifar100": DatasetInfo("cifar100", 100, (3, 32, 32), 60000, False,
                            "CIFAR-100 32x32 colour, 100 fine classes (pfedkit data fetch cifar100)"),
}


@dataclass(frozen=True)
class Dataset:
    """A dataset as stored: images stay uint8 ((N, H, W) or (N, H, W, C), 4x smaller than
    float32) and are normalised when a client's rows are gathered (`rows`), so the process holds
    the float32 data once, in the clients' tensors. Features (digits) are stored as float32."""
    name: str
    stored: np.ndarray     # uint8 images as in the file, or float32 features (N, D) in [-1, 1]
    y: np.ndarray          # int64 (N,)
    official_test: np.ndarray  # bool (N,): True for the official test split
    num_classes: int

    def rows(self, index) -> np.ndarray:
        """float32 rows `index`, (n, C, H, W) or (n, D), normalised to [-1, 1] (the same values,
        bit for bit, as normalising the whole set and then indexing)."""
        picked = self.stored[index]
        return _normalise_images(picked) if self.stored.ndim >= 3 else picked  # images, or features

    @property
    def x(self) -> np.ndarray:
        """Every row, normalised (a new float32 array: for inspection, not for training loops)."""
        return self.rows(slice(None))

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.rows(slice(0, 1)).shape[1:])


def dataset_info(name: str) -> DatasetInfo:
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; allowed: {', '.join(DATASETS)}")
    return DATASETS[name]


def resolve_data_dir(data_dir: str | None) -> Path | None:
    """Config `data_dir` first, then the PFEDKIT_DATA environment variable."""
    chosen = data_dir or os.environ.get("PFEDKIT_DATA")
    return Path(chosen).expanduser() if chosen else None


def load_dataset(name: str, data_dir: str | None = None, cache_dir: str | None = None) -> Dataset:
    info = dataset_info(name)
    if info.embedded:
        return _load_digits()
    root = resolve_data_dir(data_dir)
    if root is None:
        raise DataError(f"dataset {name!r} needs a data directory: set data_dir=PATH or the "
                        f"PFEDKIT_DATA environment variable to a folder holding {name}/{name}.npz.xz "
                        f"(get it with `pfedkit data fetch {name} --data-dir DIR`)")
    key = (name, str(root.resolve()), str(_cache_root(cache_dir)))
    if key not in _LOADED:  # runs of a comparison in one process decode and normalise once
        x, y, test = _read_npz(root, name, _cache_root(cache_dir))
        _LOADED.clear()  # one dataset held at a time
        _LOADED[key] = Dataset(name, x, y.astype(np.int64), test.astype(bool), info.num_classes)
    return _LOADED[key]


_LOADED: dict[tuple[str, str, str], Dataset] = {}  # callers must not modify a Dataset's arrays


def _load_digits() -> Dataset:
    from sklearn.datasets import load_digits

    bunch = load_digits()
    # 16 grey levels -> [-1, 1], the same convention as the image sets.
    x = (bunch.data.astype(np.float32) / 16.0 - 0.5) / 0.5
    y = bunch.target.astype(np.int64)
    # No official split exists: hold out a fixed, label-stratified quarter (every 4th sample of
    # each class) so that "official test" partitions work on digits too.
    test = np.zeros(len(y), dtype=bool)
    for c in np.unique(y):
        test[np.flatnonzero(y == c)[3::4]] = True
    return Dataset("digits", x, y, test, 10)


def _normalise_images(x: np.ndarray) -> np.ndarray:
    """uint8 (N,H,W) or (N,H,W,C) -> float32 (N,C,H,W) in [-1, 1] (PFLlib's Normalize(0.5, 0.5))."""
    if x.ndim == 3:
        x = x[:, None, :, :]
    else:
        x = np.transpose(x, (0, 3, 1, 2))
    out = x.astype(np.float32)
    out /= 255.0
    out -= 0.5
    out /= 0.5
    return np.ascontiguousarray(out)


def _cache_root(cache_dir: str | None) -> Path:
    chosen = cache_dir or os.environ.get("PFEDKIT_CACHE")
    return Path(chosen) if chosen else Path.home() / ".cache" / "pfedkit"


def _read_npz(root: Path, name: str, cache_root: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The x, y, test arrays of `root/name/name.npz.xz`, checked (`_check_arrays`); decoded once
    into the cache. Nothing is cached until the decoded file has been checked, and a cached file
    that no longer reads is decoded again, so a bad file never sticks in the cache."""
    source = (root / name / f"{name}.npz.xz").resolve()
    if not source.is_file():
        raise DataError(f"missing dataset file {source}: get it with `pfedkit data fetch {name} "
                        f"--data-dir {root}`, or point data_dir at a folder that has it")
    expected = _expected_checksum(root, f"{name}/{name}.npz.xz")
    stat = source.stat()
    cached = cache_root.absolute() / f"{name}-{expected or f'{stat.st_size}-{int(stat.st_mtime)}'}.npz"
    if cached.is_file():
        try:
            return _check_arrays(_load_arrays(cached, source), name, source)
        except DataError:
            cached.unlink(missing_ok=True)  # damaged or stale: decode the source again below
    payload = _decode(source, expected)
    arrays = _check_arrays(_load_arrays(io.BytesIO(payload), source), name, source)
    try:
        atomic_write_bytes(cached, payload)
    except OSError as err:
        raise DataError(f"cannot write the dataset cache {cached} ({err.strerror}): set PFEDKIT_CACHE to a "
                        f"writable folder") from None
    return arrays


def _decode(source: Path, expected: str | None) -> bytes:
    """The decompressed bytes of an xz file, checked against its SHA-256 when one is expected."""
    try:
        raw = source.read_bytes()
    except OSError as err:
        raise DataError(f"cannot read dataset file {source} ({err.strerror})") from None
    if expected is not None and hashlib.sha256(raw).hexdigest() != expected:
        raise DataError(f"corrupt dataset file {source}: its SHA-256 does not match SHA256SUMS; "
                        f"copy the file again from the original source")
    try:
        return lzma.decompress(raw)
    except lzma.LZMAError as err:
        raise DataError(f"corrupt dataset file {source}: xz decoding failed ({err}); copy it again") from None


def _load_arrays(file: Path | io.BytesIO, source: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x, y, test from an .npz (a path or bytes); DataError naming `source` for anything else."""
    try:
        loaded = np.load(file, allow_pickle=False)
        if not isinstance(loaded, np.lib.npyio.NpzFile):  # a lone .npy array
            raise ValueError("not an .npz archive")
        with loaded as arrays:
            missing = {"x", "y", "test"} - set(arrays.files)
            if missing:
                raise DataError(f"dataset file {source} lacks arrays {sorted(missing)}; expected x, y, test")
            return arrays["x"], arrays["y"], arrays["test"]
    except DataError:
        raise
    except (ValueError, OSError, EOFError, zipfile.BadZipFile):
        raise DataError(f"dataset file {source} does not hold an .npz archive (arrays x, y, test) inside its xz "
                        "wrapping; copy the file again (format: ../shared/datasets/README.md)") from None


def _check_arrays(arrays: tuple[np.ndarray, np.ndarray, np.ndarray], name: str,
                  source: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The arrays must describe one sample per row: as many labels and test flags as images,
    integer labels in [0, classes), images of the dataset's shape. Anything else would train on
    misaligned labels (a file whose x and y lengths differed reported 100% accuracy)."""
    x, y, test = arrays
    info = DATASETS[name]
    if not (len(x) == len(y) == len(test)):
        raise DataError(f"dataset file {source}: x has {len(x)} rows, y {len(y)} and test {len(test)}; "
                        "expected one label and one test flag per image")
    if y.ndim != 1 or not np.issubdtype(y.dtype, np.integer):
        raise DataError(f"dataset file {source}: y must be a 1-D integer array of labels "
                        f"(got shape {y.shape}, dtype {y.dtype})")
    if len(y) and (y.min() < 0 or y.max() >= info.num_classes):
        raise DataError(f"dataset file {source}: labels run from {y.min()} to {y.max()}; {name} has "
                        f"{info.num_classes} classes, labelled 0..{info.num_classes - 1}")
    shape = tuple(_normalise_images(x[:1]).shape[1:]) if x.ndim in (3, 4) else tuple(x.shape[1:])
    if x.dtype != np.uint8 or shape != info.input_shape:
        raise DataError(f"dataset file {source}: images of shape {tuple(x.shape[1:])} and dtype {x.dtype}; "
                        f"expected uint8 images giving inputs of shape {info.input_shape}")
    return arrays


def _expected_checksum(root: Path, relative: str) -> str | None:
    sums = root / "SHA256SUMS"
    if not sums.is_file():
        return None
    for line in sums.read_text().splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].lstrip("*") == relative:
            return parts[0].lower()
    return None

