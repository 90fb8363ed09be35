"""`dataset=hf:NAME_OR_DIR`: any image classification dataset of the Hugging Face Hub, or a folder
written by `datasets.save_to_disk`, as a pfedkit `Dataset` (uint8 images, int labels, official
test flags).

What the conversion does (docs/data.md):
- images (`data.image_column`, default `image`): PIL images or arrays -> uint8 arrays, (H, W) for
  grayscale, (H, W, 3) for colour. Palette and alpha images become RGB ("LA" becomes "L"), 1-bit
  becomes 8-bit; every image must end up with the same shape (pfedkit stacks them), else a
  one-line DataError naming the two shapes. 16-bit or float images are refused, not rescaled.
- labels (`data.label_column`, default `label`): a ClassLabel keeps its ids and names; any other
  column's distinct values (ints or strings), sorted, are numbered 0..K-1.
- splits: the split named `test` is the official test split; every other split (train,
  validation, ...) is the official training split, in the DatasetDict's order.

The conversion runs once: the arrays go to `<cache>/hf/<label>-<key>.npz` (cache: PFEDKIT_CACHE,
else ~/.cache/pfedkit), keyed by the Hub name and `data.revision` (a moving branch is cached as
first seen: pin a revision, or delete the file, to take a newer one) or by the folder's resolved
path and a fingerprint of its files (their metadata JSON, which holds the datasets fingerprint,
and each file's size and modification time), plus the two column names. A cached run does not
import `datasets` at all.
"""
from __future__ import annotations

import hashlib
import io
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pfedkit.atomic import atomic_write_bytes
from pfedkit.data.store import DataError, Dataset, cache_root

PREFIX = "hf:"
INSTALL_HINT = "pip install 'pfedkit[hf]'"
TEST_SPLIT = "test"
BATCH = 1024  # images decoded per step of the conversion
CACHE_FORMAT = 1  # bump when the conversion changes: old cache files are then ignored


@dataclass(frozen=True)
class HFDataset(Dataset):
    """A converted Hugging Face dataset: the class names (ClassLabel's, or the label values) kept."""
    class_names: tuple[str, ...] = ()


@dataclass(frozen=True)
class HFOptions:
    """The config's `data` section as this module reads it (any object with these attributes works)."""
    image_column: str = "image"
    label_column: str = "label"
    revision: str | None = None


def is_hf(name: str) -> bool:
    return isinstance(name, str) and name.startswith(PREFIX)


def hf_source(name: str) -> str:
    """The Hub name or folder after `hf:`; DataError when nothing follows."""
    source = name[len(PREFIX):].strip()
    if not source:
        raise DataError("dataset=hf:: name a Hugging Face Hub dataset (hf:ylecun/mnist) or a folder written by "
                        "datasets.save_to_disk (hf:path/to/folder)")
    return source


def local_folder(source: str) -> Path | None:
    """The folder `source` names when it exists (a folder wins over a Hub name spelt the same)."""
    path = Path(source).expanduser()
    return path.resolve() if path.is_dir() else None


def file_label(dataset: str) -> str:
    """A name safe in file and folder names: `hf:ylecun/mnist` -> `hf-mnist`; other names as they are."""
    if not is_hf(dataset):
        return dataset
    tail = Path(dataset[len(PREFIX):].rstrip("/\\")).name or "dataset"
    return "hf-" + (re.sub(r"[^A-Za-z0-9._-]+", "_", tail).strip("._") or "dataset")


def load_hf_dataset(name: str, options: Any = None, cache_dir: str | None = None) -> HFDataset:
    """`name` (`hf:...`) converted, from the cache when it was converted before."""
    options = options or HFOptions()
    source = hf_source(name)
    folder = local_folder(source)
    key = _cache_key(source, folder, options)
    cached = cache_root(cache_dir).absolute() / "hf" / f"{file_label(name)}-{key[:24]}.npz"
    if cached in _LOADED:
        return _LOADED[cached]
    arrays = _read_cache(cached)
    if arrays is None:
        arrays = convert(_open(name, source, folder, options), name, options)
        _write_cache(cached, arrays)
    x, y, test, class_names = arrays
    dataset = HFDataset(name=name, stored=x, y=y, official_test=test, num_classes=len(class_names),
                        class_names=tuple(class_names))
    _LOADED.clear()  # one dataset held at a time, like datasets.load_dataset
    _LOADED[cached] = dataset
    return dataset


_LOADED: dict[Path, HFDataset] = {}


# --- the cache ---------------------------------------------------------------------------------

def _cache_key(source: str, folder: Path | None, options: Any) -> str:
    parts: dict[str, Any] = {"format": CACHE_FORMAT, "image_column": options.image_column,
                             "label_column": options.label_column}
    if folder is None:
        parts.update(hub=source, revision=options.revision)
    else:
        parts.update(folder=str(folder), fingerprint=folder_fingerprint(folder))
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def folder_fingerprint(folder: Path) -> str:
    """What changes when a save_to_disk folder is rewritten: its JSON metadata (state.json holds
    datasets' own fingerprint) and every file's name, size and modification time. The data files
    themselves are not read (a large dataset would be hashed on every run)."""
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        stat = path.stat()
        digest.update(f"{path.relative_to(folder).as_posix()}|{stat.st_size}|{stat.st_mtime_ns}\n".encode())
        if path.suffix == ".json":
            digest.update(path.read_bytes())
    return digest.hexdigest()


def _read_cache(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[str]] | None:
    if not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as saved:
            arrays = saved["x"], saved["y"], saved["test"], [str(n) for n in saved["class_names"]]
    except (OSError, ValueError, KeyError, EOFError):
        path.unlink(missing_ok=True)  # damaged: convert again
        return None
    if not (len(arrays[0]) == len(arrays[1]) == len(arrays[2])):
        path.unlink(missing_ok=True)
        return None
    return arrays


def _write_cache(path: Path, arrays: tuple[np.ndarray, np.ndarray, np.ndarray, list[str]]) -> None:
    x, y, test, class_names = arrays
    buffer = io.BytesIO()
    np.savez(buffer, x=x, y=y, test=test, class_names=np.array(class_names, dtype=str))
    try:
        atomic_write_bytes(path, buffer.getvalue())
    except OSError as err:
        raise DataError(f"cannot write the dataset cache {path} ({err.strerror}): set PFEDKIT_CACHE to a "
                        "writable folder") from None


# --- opening and converting --------------------------------------------------------------------

def require_datasets(needed_by: str = "hf: datasets need") -> Any:
    """The `datasets` module, or a one-line DataError saying how to install it (`needed_by`: who
    needs it, the message's subject: `data fetch femnist needs`)."""
    try:
        import datasets
    except ImportError:
        raise DataError(f"{needed_by} the Hugging Face datasets library: {INSTALL_HINT}") from None
    return datasets


def _open(name: str, source: str, folder: Path | None, options: Any):
    datasets = require_datasets()
    try:
        if folder is not None:
            return datasets.load_from_disk(str(folder))
        return datasets.load_dataset(source, revision=options.revision)
    except Exception as err:  # the library raises many types (FileNotFoundError, DatasetNotFoundError, ...)
        where = (f"folder {folder} is not a datasets.save_to_disk folder" if folder is not None else
                 f"cannot load {source!r} from the Hugging Face Hub")
        reason = " ".join(str(err).split())[:300]
        raise DataError(f"dataset={name}: {where} ({type(err).__name__}: {reason}); give a Hub dataset name "
                        "(and data.revision) or a folder written by datasets.save_to_disk") from None


def splits_of(dataset) -> list[tuple[str, Any]]:
    """(split name, datasets.Dataset) pairs: a DatasetDict's splits, or one Dataset as `train`."""
    if hasattr(dataset, "column_names") and not isinstance(dataset.column_names, dict):
        return [("train", dataset)]
    return list(dataset.items())


def convert(dataset, name: str, options: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[str]]:
    """x (uint8 images), y (int64 labels), test (bool), class names of a Dataset or DatasetDict.
    Non-test splits come first (in the dict's order), the `test` split last."""
    splits = splits_of(dataset)
    splits = [s for s in splits if s[0] != TEST_SPLIT] + [s for s in splits if s[0] == TEST_SPLIT]
    for split, part in splits:
        for key, column in (("image_column", options.image_column), ("label_column", options.label_column)):
            if column not in part.column_names:
                raise DataError(f"data.{key}: no column {column!r} in {name} (split {split}); "
                                f"its columns: {', '.join(part.column_names)}")
    if not any(split != TEST_SPLIT and len(part) for split, part in splits):
        raise DataError(f"dataset={name}: no training rows (splits: {', '.join(s for s, _ in splits) or 'none'}); "
                        "pfedkit needs a split other than `test`")
    shape: list[tuple[tuple[int, ...], str]] = []  # the first image's shape and where it was
    images = [_split_images(part, split, options.image_column, name, shape) for split, part in splits]
    y, class_names = _labels(splits, options.label_column, name)
    test = np.concatenate([np.full(len(part), split == TEST_SPLIT) for split, part in splits])
    return np.concatenate([part for part in images if len(part)]), y, test, class_names  # empty splits left out


def _split_images(part, split: str, column: str, name: str, shape: list) -> np.ndarray:
    feature = part.features[column]
    is_image = type(feature).__name__ == "Image"
    # Image features decode to PIL images; any other feature is read as numpy arrays.
    view = part.select_columns([column]) if is_image else part.select_columns([column]).with_format("numpy")
    chunks = []
    for start, batch in zip(range(0, len(part), BATCH), view.iter(batch_size=BATCH)):
        arrays = [_image_array(item, name, split, start + i) for i, item in enumerate(batch[column])]
        for i, array in enumerate(arrays):
            if not shape:
                shape.append((array.shape, f"split {split} row {start + i}"))
            elif array.shape != shape[0][0]:
                raise DataError(f"dataset={name}: images of different shapes: {_shape_text(shape[0][0])} "
                                f"({shape[0][1]}) and {_shape_text(array.shape)} (split {split} row {start + i}); "
                                "pfedkit needs one shape: resize the images first (e.g. datasets' map with "
                                "PIL's resize, then save_to_disk)")
        chunks.append(np.stack(arrays) if arrays else np.empty((0,), np.uint8))
    if not chunks or not len(part):
        return np.empty((0, *shape[0][0]) if shape else (0,), dtype=np.uint8)
    return np.concatenate(chunks)


def _shape_text(shape: tuple[int, ...]) -> str:
    return "x".join(map(str, shape)) + (" grayscale" if len(shape) == 2 else " RGB")


# PIL modes turned into 8-bit grayscale ("L") or colour ("RGB"); other modes (16-bit, float) are refused.
_TO_GRAY = {"1", "L", "LA"}
_TO_RGB = {"RGB", "RGBA", "RGBX", "P", "PA", "CMYK", "YCbCr", "LAB", "HSV"}


def _image_array(item: Any, name: str, split: str, row: int) -> np.ndarray:
    where = f"dataset={name}: split {split} row {row}"
    if hasattr(item, "mode") and hasattr(item, "convert"):  # a PIL image
        if item.mode in _TO_GRAY:
            item = item.convert("L") if item.mode != "L" else item
        elif item.mode in _TO_RGB:
            item = item.convert("RGB") if item.mode != "RGB" else item
        else:
            raise DataError(f"{where}: image mode {item.mode}; pfedkit reads 8-bit grayscale or RGB images "
                            "(convert them first, e.g. to L or RGB)")
    array = np.asarray(item)
    if array.dtype == object:
        raise DataError(f"{where}: the image is a ragged array; expected (H, W) or (H, W, 3) pixels")
    if array.ndim == 3 and array.shape[-1] == 1:
        array = array[..., 0]
    if not (array.ndim == 2 or (array.ndim == 3 and array.shape[-1] == 3)) or 0 in array.shape:
        raise DataError(f"{where}: image of shape {array.shape}; expected (H, W) grayscale or (H, W, 3) RGB "
                        "(channels last)")
    if array.dtype != np.uint8:
        integer = np.issubdtype(array.dtype, np.integer) or array.dtype == bool
        if not integer or array.min() < 0 or array.max() > 255:
            raise DataError(f"{where}: pixels of dtype {array.dtype} (range {array.min()}..{array.max()}); "
                            "expected 8-bit values 0..255")
        array = array.astype(np.uint8)
    return np.ascontiguousarray(array)


def _labels(splits: list[tuple[str, Any]], column: str, name: str) -> tuple[np.ndarray, list[str]]:
    """int64 labels of every split (in order) and the class names."""
    features = [part.features[column] for _, part in splits]
    names = next((list(f.names) for f in features if type(f).__name__ == "ClassLabel"), None)
    values = [np.asarray(part.with_format("numpy")[column]) if len(part) else np.empty(0) for _, part in splits]
    if names is not None:  # ClassLabel: ids as they are, every split read with the same names
        for (split, _), feature in zip(splits, features):
            if type(feature).__name__ != "ClassLabel" or list(feature.names) != names:
                raise DataError(f"data.label_column: {column!r} has different classes in split {split} of {name}")
        y = np.concatenate([v for v in values if len(v)]).astype(np.int64)
        if len(y) and (y.min() < 0 or y.max() >= len(names)):
            bad = sorted({s for (s, _), v in zip(splits, values) if len(v) and (v.min() < 0 or v.max() >= len(names))})
            raise DataError(f"data.label_column: {column!r} holds labels outside 0..{len(names) - 1} (-1 = no label) "
                            f"in split {', '.join(bad)} of {name}; pfedkit needs every row labelled")
        return y, names
    joined = np.concatenate([v for v in values if len(v)])
    if joined.ndim != 1 or not (np.issubdtype(joined.dtype, np.integer) or joined.dtype.kind in "UO"):
        raise DataError(f"data.label_column: {column!r} of {name} holds {joined.dtype} values of shape "
                        f"{joined.shape[1:]}; expected one class (an integer or a string) per row")
    distinct, y = np.unique(joined.astype(str) if joined.dtype.kind in "UO" else joined, return_inverse=True)
    return y.astype(np.int64).reshape(-1), [str(v) for v in distinct]
