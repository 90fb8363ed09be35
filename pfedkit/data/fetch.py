"""`pfedkit data fetch NAME`: download a dataset from its canonical public source, verify it and
convert it once into pfedkit's format (`<name>/<name>.npz.xz`, arrays x, y, test; see
../shared/datasets/README.md), recording the file's SHA-256 in the data directory's SHA256SUMS.

What comes from where is data/sources.py; downloading (resumable, checked against the published
MD5) and the lock that makes a second fetch of the same dataset wait are data/download.py. This
module ties them: it converts the downloads, writes the file atomically and only after the
converted arrays have been read back through the loader's own checks (data/images.py,
data/text.py) and compared, so a run never sees a truncated or half-converted file.

Conversion starts only once every file of the source has passed its published MD5 (`obtain_all`
returns only checked files): CIFAR's archives are Python pickles, so a tampered or substituted
archive is deleted unread, and even a matching one is read with an unpickler that builds numpy
arrays only (data/converters.py). A fetch that fails leaves no empty folder or lock file behind,
only a `.part` to resume from.
"""
from __future__ import annotations

import csv
import hashlib
import io
import lzma
import pickle
import shutil
import tarfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from pfedkit.atomic import atomic_write_bytes, atomic_write_text
from pfedkit.data import download as network  # `network.download_hub` is looked up per call: tests replace it
from pfedkit.data import images, text
from pfedkit.data.datasets import DATASETS
from pfedkit.data.download import fetch_lock, obtain_all, private_folder, remove_empty, say, sha256_file
from pfedkit.data.hf import require_datasets
from pfedkit.data.sources import SOURCES, HubSource, Source, fetchable
from pfedkit.data.store import (DataError, DatasetInfo, NamedArrays, dataset_path, encode_xz, record_checksum,
                                resolve_data_dir)

@dataclass(frozen=True)
class FileKind:
    """How `data fetch` checks, compresses and reports one kind of dataset file (`DatasetInfo.kind`)."""
    read_checked: Callable[[BinaryIO, DatasetInfo, Path], NamedArrays]  # the loader's own reading and checks
    xz_preset: int | None  # None: by size (store.encode_xz)
    converting: str        # what turning the downloads into arrays is called (progress line)
    download: str          # what a download that does not convert is called (error line)
    summary: Callable[[NamedArrays], str]  # the last line but one: what was written


def _image_summary(arrays: NamedArrays) -> str:
    writers = f", {len(arrays['writer_names'])} writers" if "writer_names" in arrays else ""
    return f"{len(arrays['y'])} images ({int(arrays['test'].sum())} official test{writers})"


def _text_summary(arrays: NamedArrays) -> str:
    return (f"{len(arrays['y'])} texts ({int(arrays['test'].sum())} official test), "
            f"{len(arrays['vocab'])} token ids, {text.MAX_LENGTH} per row")


KINDS = {"image": FileKind(images.read_checked, None, "converting", "archive", _image_summary),
         "text": FileKind(text.read_checked, text.XZ_PRESET, "tokenising", "CSV", _text_summary)}


def fetch(name: str, data_dir: str | None = None, progress: bool = True) -> Path:
    """The path of `name`'s dataset file in the data directory, downloaded and converted if it is
    not there yet (a file already present is used as it is). DataError (one line) on failure.
    Holds `<data dir>/.downloads/<name>.lock` meanwhile: a concurrent fetch of `name` waits."""
    if name in DATASETS and DATASETS[name].source is not None:  # a class subset: its rows are in another file
        say(f"{name}: a class subset of {DATASETS[name].source}; fetching {DATASETS[name].source}")
        name = DATASETS[name].source
    root = resolve_data_dir(data_dir)
    if root is None or name not in fetchable():  # _fetch_locked says why in one line
        return _fetch_locked(name, data_dir, progress)
    created = not root.exists()
    try:
        with fetch_lock(root, name):
            return _fetch_locked(name, data_dir, progress)
    finally:
        if created:  # a data directory this fetch made and left empty (it failed) goes too
            remove_empty(root)


def _fetch_locked(name: str, data_dir: str | None, progress: bool) -> Path:
    """fetch() once the lock is held: the target if present, else download, convert, write."""
    source = _source(name)
    root = resolve_data_dir(data_dir)
    if root is None:
        raise DataError(f"data fetch {name}: no data directory; give --data-dir DIR "
                        "(or set the PFEDKIT_DATA environment variable)")
    target = dataset_path(root, name)
    if target.is_file():
        say(f"{name}: already present at {target} (not downloaded)")
        return target
    downloads = private_folder(private_folder(root / ".downloads") / name)
    info = DATASETS[name]
    kind = KINDS[info.kind]
    try:
        if isinstance(source, HubSource):
            arrays, provenance = _fetch_hub(name, source, downloads, progress)
        else:
            files = obtain_all(source.files, downloads, progress)  # each one MD5-checked: only then converted
            if progress:  # quiet: only the result or the one-line error
                say(f"{name}: {kind.converting} {', '.join(files)}")
            arrays, provenance = _convert(name, source, kind, files, progress), _provenance(source, files)
    finally:
        remove_empty(downloads)  # a failed fetch keeps only what it can resume from
    digest = _install(root, info, kind, arrays, provenance)
    shutil.rmtree(downloads, ignore_errors=True)  # the archives are no longer needed
    say(f"{name}: {kind.summary(arrays)} -> {target}\nsha256 {digest}")
    return target


def _install(root: Path, info: DatasetInfo, kind: FileKind, arrays: NamedArrays, provenance: str) -> str:
    """Write `info.name`'s file (and SOURCE.txt, and its SHA256SUMS line) once it reads back
    identically; returns its SHA-256."""
    name = info.name
    target = dataset_path(root, name)
    payload = encode_xz(arrays, kind.xz_preset)
    _verify_round_trip(payload, arrays, info, kind, target)
    digest = hashlib.sha256(payload).hexdigest()
    # The checksum first, the dataset file last (atomically): stopped in between, the file is
    # simply missing and the next fetch starts over; a file never sits beside a stale checksum.
    atomic_write_text(root / name / "SOURCE.txt", provenance)
    record_checksum(root, f"{name}/{name}.npz.xz", digest)
    atomic_write_bytes(target, payload)
    return digest


def _fetch_hub(name: str, source: HubSource, downloads: Path, progress: bool) -> tuple[NamedArrays, str]:
    """Download (resumable) and convert a Hub dataset; a source that does not convert is deleted."""
    require_datasets(f"data fetch {name} needs")  # before any download: the one-line install hint
    try:
        files = network.download_hub(source.repo_id, source.revision, downloads)
    except Exception as err:  # huggingface_hub / requests raise many types; all end in one line
        reason = " ".join(str(err).split())[:300]
        raise DataError(f"cannot download {source.repo_id} from the Hugging Face Hub ({type(err).__name__}: "
                        f"{reason}); what arrived is kept in {downloads}: run the same command again to resume"
                        ) from None
    if not files:
        raise DataError(f"data fetch {name}: {source.repo_id} gave no parquet files; nothing written")
    if progress:
        say(f"{name}: converting {len(files)} parquet file(s)")
    try:
        arrays = source.convert(files, progress)
    except (OSError, EOFError, ValueError, KeyError, TypeError, _arrow_error(), _datasets_error()) as err:
        shutil.rmtree(downloads, ignore_errors=True)  # verified by nobody and unreadable: never reuse it
        reason = " ".join(str(err).split())[:300]
        raise DataError(f"data fetch {name}: the downloaded files do not convert ({type(err).__name__}: "
                        f"{reason}); they were deleted, run the command again") from None
    lines = [f"# converted by pfedkit data fetch from: {source.citation}",
             f"# hub dataset {source.repo_id} revision {source.revision or 'default branch'}", "# sha256  file"]
    lines += [f"{sha256_file(path)}  {path.relative_to(downloads)}" for path in files]
    return arrays, "\n".join(lines) + "\n"


def _arrow_error() -> type[Exception]:
    import pyarrow

    return pyarrow.ArrowException


def _datasets_error() -> type[Exception]:
    from datasets.exceptions import DatasetGenerationError

    return DatasetGenerationError


def _source(name: str) -> Source | HubSource:
    if name in SOURCES:
        return SOURCES[name]
    if name in DATASETS and DATASETS[name].embedded:
        raise DataError(f"data fetch {name}: {name} is embedded in pfedkit; nothing to fetch")
    from pfedkit.core.errors import did_you_mean

    raise DataError(f"data fetch {name}: unknown dataset{did_you_mean(name, fetchable())}; "
                    f"fetchable: {', '.join(fetchable())}")


def _convert(name: str, source: Source, kind: FileKind, files: dict[str, Path], progress: bool = False) -> NamedArrays:
    try:
        arrays = source.convert(files, progress)
        return arrays if isinstance(arrays, dict) else dict(zip(("x", "y", "test"), arrays))
    except (OSError, EOFError, ValueError, KeyError, tarfile.TarError, zipfile.BadZipFile,
            pickle.UnpicklingError, csv.Error) as err:
        for path in files.values():
            path.unlink(missing_ok=True)  # verified yet unreadable: never reuse it
        raise DataError(f"data fetch {name}: the downloaded {kind.download} does not convert "
                        f"({type(err).__name__}: {err}); it was deleted, run the command again") from None


def _verify_round_trip(payload: bytes, arrays: NamedArrays, info: DatasetInfo, kind: FileKind, target: Path) -> None:
    """Decode what is about to be written through the loader's own checks and compare it with the
    converted arrays: only a file that reads back exactly is installed."""
    decoded = kind.read_checked(io.BytesIO(lzma.decompress(payload)), info, target)
    same = set(decoded) == set(arrays) and all(
        np.array_equal(decoded[key], arrays[key]) and decoded[key].dtype == arrays[key].dtype for key in arrays)
    if not same:
        raise DataError(f"data fetch {info.name}: the converted file does not read back identically; "
                        "nothing written")


def _provenance(source: Source, files: dict[str, Path]) -> str:
    lines = [f"# converted by pfedkit data fetch from: {source.citation}", "# sha256  md5  file  urls"]
    for item in source.files:
        lines.append(f"{sha256_file(files[item.filename])}  {item.md5}  {item.filename}  {' '.join(item.urls)}")
    return "\n".join(lines) + "\n"
