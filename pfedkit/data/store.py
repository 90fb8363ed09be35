"""What every dataset loader shares, at the bottom of pfedkit/data/ (it imports no other data module):

- `DataError`, the in-memory `Dataset` and `DatasetInfo` (what is known before loading: the
  `DATASETS` table of data/datasets.py is made of them);
- the data directory (`data_dir`, else $PFEDKIT_DATA) and the files in it: `<name>/<name>.npz.xz`
  (an xz-wrapped `.npz`, ../shared/datasets/README.md) and SHA256SUMS, read by the loaders and
  written by `pfedkit data fetch` (a SHA256SUMS that is not text, and a symbolic link on a file's
  path that loops, are DataErrors naming the file or the link);
- the decode cache (`cache_dir`, else $PFEDKIT_CACHE, else ~/.cache/pfedkit): a file is decoded
  from xz once, and only a decoded file that passes its format's checks is cached, so a bad file
  never sticks there.

What a file must hold is its format's business (data/images.py, data/text.py): they pass
`read_dataset_file` a `parse` that reads and checks the arrays.
"""
from __future__ import annotations

import hashlib
import io
import lzma
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Literal

import numpy as np

from pfedkit.atomic import atomic_write_bytes, atomic_write_text

NamedArrays = dict[str, np.ndarray]  # a dataset file's arrays by name (x, y, test, ...)
# (the decoded .npz, as a cached file or as bytes; the source file, for messages) -> checked arrays
Parse = Callable[[Path | BinaryIO, Path], NamedArrays]


class DataError(RuntimeError):
    """A dataset file is missing, corrupt or unreadable; the message says what to do."""


@dataclass(frozen=True)
class DatasetInfo:
    """One row of the DATASETS table (data/datasets.py): all pfedkit knows of a dataset before loading it."""
    name: str
    num_classes: int
    input_shape: tuple[int, ...]
    num_samples: int
    embedded: bool
    description: str
    model: str                             # the model `model: auto` picks (pfedkit.models)
    kind: Literal["image", "text", "features"] = "image"  # the file's format: data/images.py, data/text.py
    writers: bool = False                  # the file has `writer` ids (partition.scheme=natural)
    source: str | None = None              # a class subset of this dataset's file ...
    classes: tuple[int, ...] | None = None  # ... keeping these labels, relabelled 0..len-1 in this order

    @property
    def file_name(self) -> str:
        """The dataset whose `<name>/<name>.npz.xz` holds the rows (`pfedkit data fetch` it)."""
        return self.source or self.name


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
        return normalise_images(picked) if self.stored.ndim >= 3 else picked  # images, or features/token ids

    @property
    def x(self) -> np.ndarray:
        """Every row, normalised (a new float32 array: for inspection, not for training loops)."""
        return self.rows(slice(None))

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.rows(slice(0, 1)).shape[1:])


def normalise_images(x: np.ndarray) -> np.ndarray:
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


# --- where files are ---------------------------------------------------------------------------

def resolve_data_dir(data_dir: str | None) -> Path | None:
    """Config `data_dir` first, then the PFEDKIT_DATA environment variable."""
    chosen = data_dir or os.environ.get("PFEDKIT_DATA")
    return Path(chosen).expanduser() if chosen else None


def cache_root(cache_dir: str | None) -> Path:
    chosen = cache_dir or os.environ.get("PFEDKIT_CACHE")
    return Path(chosen) if chosen else Path.home() / ".cache" / "pfedkit"


def dataset_path(root: Path, name: str) -> Path:
    return root / name / f"{name}.npz.xz"


def resolved(path: Path) -> Path:
    """`path` absolute, its symbolic links followed; DataError naming the link when one on the way
    loops (a link to itself, or two links to each other), which no file can be found behind."""
    try:
        return path.resolve()
    except (RuntimeError, OSError):  # Python < 3.13: RuntimeError("Symlink loop ..."); later: ELOOP
        looping = next((part for part in reversed((path, *path.parents)) if part.is_symlink() and _loops(part)), path)
        raise DataError(f"dataset path {path.absolute()}: the symbolic link {looping.absolute()} loops (it leads back "
                        "to itself); fix the link or point data_dir at the folder holding the data") from None


def _loops(link: Path) -> bool:
    try:
        link.resolve()
        return False
    except (RuntimeError, OSError):
        return True


# --- SHA256SUMS --------------------------------------------------------------------------------

def checksum_lines(root: Path) -> list[str]:
    """The lines of `root`/SHA256SUMS (none without the file); DataError (one line) for a file
    that is not text, such as a binary file under that name."""
    sums = root / "SHA256SUMS"
    if not sums.is_file():
        return []
    try:
        return sums.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as err:
        problem = f"not text (byte {err.start}: {err.reason})"
    except OSError as err:
        problem = f"cannot be read ({err.strerror})"
    raise DataError(f"checksum file {sums.absolute()}: {problem}; it should hold lines `SHA256  NAME/NAME.npz.xz`: "
                    "delete it (the files are then not checked) or copy it again with the data")


def expected_checksum(root: Path, relative: str) -> str | None:
    for line in checksum_lines(root):
        parts = line.split()
        if len(parts) == 2 and parts[1].lstrip("*") == relative:
            return parts[0].lower()
    return None


def record_checksum(root: Path, relative: str, digest: str) -> None:
    """Add `digest  relative` to SHA256SUMS, replacing an older line for the same file."""
    sums = root / "SHA256SUMS"
    kept = [line for line in checksum_lines(root)
            if line.split()[-1:] != [relative] and line.split()[-1:] != [f"*{relative}"]]
    atomic_write_text(sums, "\n".join([*kept, f"{digest}  {relative}"]) + "\n")


# --- the xz-wrapped .npz -----------------------------------------------------------------------

# xz preset 6 (the default) compresses ~1-3 MB/s here: fine for CIFAR, but Tiny-ImageNet's 1.35 GB
# of pixels would take many minutes; preset 1 is several times faster for a slightly larger file.
LARGE_PAYLOAD = 256 << 20


def encode_xz(arrays: NamedArrays, preset: int | None = None) -> bytes:
    """The bytes of `<name>.npz.xz` holding `arrays`; preset None: 6, or 1 for a large payload."""
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    raw = buffer.getvalue()
    if preset is None:
        preset = 1 if len(raw) > LARGE_PAYLOAD else 6
    return lzma.compress(raw, preset=preset)


def decode_xz(source: Path, expected: str | None) -> bytes:
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


def read_dataset_file(root: Path, name: str, cache_dir: str | None, parse: Parse) -> NamedArrays:
    """The checked arrays of `root/name/name.npz.xz`, decoded once into the cache. Nothing is
    cached until the decoded file has passed `parse`, and a cached file that no longer parses is
    decoded again. The cache file is named by the SHA256SUMS entry, else by size and mtime."""
    source = resolved(dataset_path(root, name))
    if not source.is_file():
        raise DataError(f"missing dataset file {source}: get it with `pfedkit data fetch {name} "
                        f"--data-dir {root}`, or point data_dir at a folder that has it")
    expected = expected_checksum(root, f"{name}/{name}.npz.xz")
    stat = source.stat()
    cached = cache_root(cache_dir).absolute() / f"{name}-{expected or f'{stat.st_size}-{stat.st_mtime_ns}'}.npz"
    if cached.is_file():
        try:
            return parse(cached, source)
        except DataError:
            cached.unlink(missing_ok=True)  # damaged or stale: decode the source again below
    payload = decode_xz(source, expected)
    arrays = parse(io.BytesIO(payload), source)
    try:
        atomic_write_bytes(cached, payload)
    except OSError as err:
        raise DataError(f"cannot write the dataset cache {cached} ({err.strerror}): set PFEDKIT_CACHE to a "
                        f"writable folder") from None
    return arrays
