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
    writers: bool = False                  # the file has `writer` ids (partition.scheme=natural)
    source: str | None = None              # a class subset of this dataset's file ...
    classes: tuple[int, ...] | None = None  # ... keeping these labels, relabelled 0..len-1 in this order

    @property
    def file_name(self) -> str:
        """The dataset whose `<name>/<name>.npz.xz` holds the rows (`pfedkit data fetch` it)."""
        return self.source or self.name


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
    # DA-PFL's CIFAR-100: "the first 20 classes" (fine labels 0-19, 500 train + 100 test images each)
    "cifar100_first20": DatasetInfo("cifar100_first20", 20, (3, 32, 32), 12000, False,
                                    "CIFAR-100 fine classes 0-19 only, relabelled 0-19 (DA-PFL; file: cifar100)",
                                    source="cifar100", classes=tuple(range(20))),
    # No official test split: every row is training data; split per client (test_split per_client).
    "femnist": DatasetInfo("femnist", 62, (1, 28, 28), 814277, False,
                           "FEMNIST 28x28 grayscale, 62 classes (0-9, A-Z, a-z), writer ids kept, no official "
                           "test split (pfedkit data fetch femnist)", writers=True),
    # DA-PFL's FEMNIST: "10 lowercase letters"; which ten is not stated: a-j (labels 36-45) [ours]
    "femnist_lower10": DatasetInfo("femnist_lower10", 10, (1, 28, 28), 814277, False,
                                   "FEMNIST lowercase letters a-j only, relabelled 0-9 (DA-PFL; file: femnist; "
                                   "sample count: the full set's, an upper bound)",
                                   writers=True, source="femnist", classes=tuple(range(36, 46))),
    "tiny_imagenet": DatasetInfo("tiny_imagenet", 200, (3, 64, 64), 110000, False,
                                 "Tiny-ImageNet 64x64 colour, 200 classes; the official val split is the test "
                                 "split (pfedkit data fetch tiny_imagenet)"),
    # Text: token ids (N, 200), tokenised once by `pfedkit data fetch ag_news` (pfedkit/data/text.py)
    "ag_news": DatasetInfo("ag_news", 4, (200,), 127600, False,
                           "AG News text, 4 classes, 200 token ids per row (cwFedAvg; pfedkit data fetch ag_news)"),
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
    writer: np.ndarray | None = None        # int32 (N,): each row's writer, an index into writer_names
    writer_names: np.ndarray | None = None  # str (W,): the source's writer ids (FEMNIST: "f0000_14")

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


def load_dataset(name: str, data_dir: str | None = None, cache_dir: str | None = None,
                 options=None) -> Dataset:
    """`options`: the config's `data` section (columns of `hf:` datasets; see data/hf.py)."""
    if name.startswith("hf:"):  # a Hugging Face dataset, converted once (pfedkit/data/hf.py)
        from pfedkit.data.hf import load_hf_dataset

        return load_hf_dataset(name, options, cache_dir)
    info = dataset_info(name)
    if info.embedded:
        return _load_digits()
    if name == "ag_news":  # token ids, not images (pfedkit/data/text.py)
        from pfedkit.data.text import load_text_dataset

        return load_text_dataset(name, data_dir, cache_dir)
    root = resolve_data_dir(data_dir)
    if root is None:
        file = info.file_name
        raise DataError(f"dataset {name!r} needs a data directory: set data_dir=PATH or the "
                        f"PFEDKIT_DATA environment variable to a folder holding {file}/{file}.npz.xz "
                        f"(get it with `pfedkit data fetch {file} --data-dir DIR`)")
    key = (name, str(root.resolve()), str(_cache_root(cache_dir)))
    if key not in _LOADED:  # runs of a comparison in one process decode and normalise once
        arrays = _read_npz(root, info.file_name, _cache_root(cache_dir))
        _LOADED.clear()  # one dataset held at a time
        _LOADED[key] = _class_subset(_as_dataset(info.file_name, arrays), info)
    return _LOADED[key]


def data_present(name: str, data_dir: str | None = None) -> bool:
    """Whether `name`'s file is in the data directory (embedded sets always are); nothing is read."""
    info = dataset_info(name)
    if info.embedded:
        return True
    root = resolve_data_dir(data_dir)
    return root is not None and (root / info.file_name / f"{info.file_name}.npz.xz").is_file()


def _as_dataset(name: str, arrays: dict[str, np.ndarray]) -> Dataset:
    writer = arrays.get("writer")
    return Dataset(name, arrays["x"], arrays["y"].astype(np.int64), arrays["test"].astype(bool),
                   DATASETS[name].num_classes, None if writer is None else writer.astype(np.int32),
                   arrays.get("writer_names"))


def _class_subset(full: Dataset, info: DatasetInfo) -> Dataset:
    """`full` itself, or (info.classes) its rows of those classes, relabelled 0..k-1 in that order;
    writer ids keep pointing into the full set's writer_names."""
    if info.classes is None:
        return full
    relabel = np.full(full.num_classes, -1, dtype=np.int64)
    relabel[list(info.classes)] = np.arange(len(info.classes))
    keep = np.flatnonzero(relabel[full.y] >= 0)
    return Dataset(info.name, full.stored[keep], relabel[full.y[keep]], full.official_test[keep],
                   info.num_classes, None if full.writer is None else full.writer[keep], full.writer_names)


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


def _read_npz(root: Path, name: str, cache_root: Path) -> dict[str, np.ndarray]:
    """The arrays of `root/name/name.npz.xz` (x, y, test; writer, writer_names where the dataset
    has writers), checked (`_check_npz`); decoded once
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
            return _check_npz(_load_npz(cached, source), name, source)
        except DataError:
            cached.unlink(missing_ok=True)  # damaged or stale: decode the source again below
    payload = _decode(source, expected)
    arrays = _check_npz(_load_npz(io.BytesIO(payload), source), name, source)
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


WRITER_ARRAYS = ("writer", "writer_names")  # optional: each row's writer index, the writers' ids


def _load_arrays(file: Path | io.BytesIO, source: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x, y, test from an .npz (a path or bytes); DataError naming `source` for anything else."""
    arrays = _load_npz(file, source)
    return arrays["x"], arrays["y"], arrays["test"]


def _load_npz(file: Path | io.BytesIO, source: Path) -> dict[str, np.ndarray]:
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


def _check_npz(arrays: dict[str, np.ndarray], name: str, source: Path) -> dict[str, np.ndarray]:
    """`_check_arrays`, plus the writer arrays: present exactly when the dataset has writers, one
    writer per row, indices into writer_names, and every listed writer owning a row."""
    _check_arrays((arrays["x"], arrays["y"], arrays["test"]), name, source)
    present = [key for key in WRITER_ARRAYS if key in arrays]
    if DATASETS[name].writers and len(present) < len(WRITER_ARRAYS):
        raise DataError(f"dataset file {source}: {name} needs arrays writer and writer_names (one writer per "
                        f"image); get the file again with `pfedkit data fetch {name}`")
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

