"""`pfedkit data fetch NAME`: download a dataset from its canonical public source, verify it and
convert it once into pfedkit's format (`<name>/<name>.npz.xz`, arrays x, y, test; see
../shared/datasets/README.md), recording the file's SHA-256 in the data directory's SHA256SUMS.

Downloads go to `<data dir>/.downloads/<name>/<file>.part` and resume from there (HTTP Range) when
interrupted; a file is kept only once its published checksum matches. The dataset file is written
atomically and only after the converted arrays have been read back and compared, so a run never
sees a truncated or half-converted file. The network is touched in one place per kind of source,
`download` (a URL) and `download_hub` (a Hugging Face Hub dataset: FEMNIST), which the tests replace.

FEMNIST (`flwrlabs/femnist`, LEAF's FEMNIST) is read with the Hugging Face `datasets` library (the
optional `hf` extra); its file also holds `writer` (each image's writer, an index) and
`writer_names` (the writer ids), for `partition.scheme=natural`. It has no official test split.
Tiny-ImageNet: the cs231n zip; its `val` split (labelled) is the official test split.

Two fetches of the same dataset into the same data directory (two terminals, two jobs of a cluster
on a shared disk) would append to the same `.part` file and convert it twice. A fetch therefore
holds an exclusive lock, `<data dir>/.downloads/<name>.lock` (`fcntl.flock`), from its first look
at the target to its last write. A second fetch says so in one line and *waits*; when it gets the
lock the file is there and it returns at once ("already present"). Waiting, not refusing: a script
that fetches before it runs should not fail because a neighbour fetched first; Ctrl-C stops the
wait. flock locks die with their process, so a killed fetch leaves no stale lock (the lock file
itself stays, empty: deleting it could let a third fetch lock a different file). Where `fcntl` does
not exist (Windows), fetches are not locked.
"""
from __future__ import annotations

import errno
import gzip
import hashlib
import http.client
import io
import lzma
import pickle
import shutil
import socket
import struct
import sys
import tarfile
import urllib.error
import urllib.request
import zipfile
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pfedkit.atomic import atomic_write_bytes, atomic_write_text
from pfedkit.data.datasets import DATASETS, DataError, _check_npz, _load_npz, resolve_data_dir

Arrays = tuple[np.ndarray, np.ndarray, np.ndarray]  # x, y, test
NamedArrays = dict[str, np.ndarray]  # x, y, test (+ writer, writer_names): the .npz's arrays
HF_INSTALL_HINT = "pip install 'pfedkit[hf]'"
# received: bytes written so far (the resumed offset included); total: the full size, if known
ProgressCallback = Callable[[int, "int | None"], None]
CHUNK = 1 << 20
TIMEOUT_S = 60


@dataclass(frozen=True)
class SourceFile:
    """One published file: where it lives (mirrors tried in order) and its published MD5."""
    filename: str
    urls: tuple[str, ...]
    md5: str


@dataclass(frozen=True)
class Source:
    files: tuple[SourceFile, ...]
    convert: Callable[..., Arrays | NamedArrays]  # ({filename: downloaded path}, progress) -> arrays
    citation: str


@dataclass(frozen=True)
class HubSource:
    """A dataset published on the Hugging Face Hub as parquet shards, read with `datasets`."""
    repo_id: str
    convert: Callable[[list[Path], bool], NamedArrays]  # (parquet files, progress) -> arrays
    citation: str
    revision: str | None = None  # None: the Hub's default branch


# --- conversion of the published formats -------------------------------------------------------

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


def _convert_idx(files: dict[str, Path], progress: bool = False) -> Arrays:
    """MNIST layout (also Fashion-MNIST): official train then official test, in published order."""
    x_train = _read_idx(files["train-images-idx3-ubyte.gz"], 3)
    y_train = _read_idx(files["train-labels-idx1-ubyte.gz"], 1)
    x_test = _read_idx(files["t10k-images-idx3-ubyte.gz"], 3)
    y_test = _read_idx(files["t10k-labels-idx1-ubyte.gz"], 1)
    return _join(x_train, y_train, x_test, y_test)


class _ArraysOnlyUnpickler(pickle.Unpickler):
    """The CIFAR archives are pickles, and unpickling can run arbitrary code: allow only what a
    pickled numpy array needs, so a tampered archive fails instead of executing."""
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


def _convert_cifar10(files: dict[str, Path], progress: bool = False) -> Arrays:
    archive = files["cifar-10-python.tar.gz"]
    x_train, y_train = _cifar_batches(archive, [f"cifar-10-batches-py/data_batch_{i}" for i in range(1, 6)], b"labels")
    x_test, y_test = _cifar_batches(archive, ["cifar-10-batches-py/test_batch"], b"labels")
    return _join(x_train, y_train, x_test, y_test)


def _convert_cifar100(files: dict[str, Path], progress: bool = False) -> Arrays:
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


def _convert_tiny_imagenet(files: dict[str, Path], progress: bool = False) -> Arrays:
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


def require_datasets():
    """The `datasets` module, or a one-line DataError saying how to install it."""
    try:
        import datasets
    except ImportError:
        raise DataError(f"data fetch femnist needs the Hugging Face datasets library: {HF_INSTALL_HINT}") from None
    return datasets


def _convert_femnist(files: list[Path], progress: bool = False) -> NamedArrays:
    """Rows in published order: image (28x28 grayscale, as published: dark ink on white),
    character (62 classes: digits, A-Z, a-z), writer_id (kept as `writer` + `writer_names`)."""
    import pyarrow.parquet as pq

    datasets = require_datasets()
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


def _idx_files(mirrors: tuple[str, ...], md5s: dict[str, str]) -> tuple[SourceFile, ...]:
    return tuple(SourceFile(name, tuple(base + name for base in mirrors), md5) for name, md5 in md5s.items())


# Canonical sources (torchvision's mirrors first where the original host refuses scripts) and the
# MD5 checksums published with them.
SOURCES: dict[str, Source | HubSource] = {
    "mnist": Source(_idx_files(
        ("https://ossci-datasets.s3.amazonaws.com/mnist/", "http://yann.lecun.com/exdb/mnist/"),
        {"train-images-idx3-ubyte.gz": "f68b3c2dcbeaaa9fbdd348bbdeb94873",
         "train-labels-idx1-ubyte.gz": "d53e105ee54ea40749a09fcbcd1e9432",
         "t10k-images-idx3-ubyte.gz": "9fb629c4189551a2d022fa330f9573f3",
         "t10k-labels-idx1-ubyte.gz": "ec29112dd5afa0611ce80d1b7f02629c"}), _convert_idx,
        "Y. LeCun, C. Cortes, C. J. C. Burges, the MNIST database"),
    "fashion_mnist": Source(_idx_files(
        ("http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",
         "https://raw.githubusercontent.com/zalandoresearch/fashion-mnist/master/data/fashion/"),
        {"train-images-idx3-ubyte.gz": "8d4fb7e6c68d591d4c3dfef9ec88bf0d",
         "train-labels-idx1-ubyte.gz": "25c81989df183df01b3e8a0aad5dffbe",
         "t10k-images-idx3-ubyte.gz": "bef4ecab320f06d8554ea6380940ec79",
         "t10k-labels-idx1-ubyte.gz": "bb300cfdad3c16e7a12a480ee83cd310"}), _convert_idx,
        "H. Xiao, K. Rasul, R. Vollgraf, Fashion-MNIST, arXiv:1708.07747"),
    "cifar10": Source((SourceFile("cifar-10-python.tar.gz",
                                  ("https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz",
                                   "https://cave.cs.toronto.edu/kriz/cifar-10-python.tar.gz"),
                                  "c58f30108f718f92721af3b95e74349a"),), _convert_cifar10,
                      "A. Krizhevsky, Learning Multiple Layers of Features from Tiny Images, 2009"),
    "cifar100": Source((SourceFile("cifar-100-python.tar.gz",
                                   ("https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz",
                                    "https://cave.cs.toronto.edu/kriz/cifar-100-python.tar.gz"),
                                   "eb9058c3a382ffc7106e4002c42a8d85"),), _convert_cifar100,
                       "A. Krizhevsky, Learning Multiple Layers of Features from Tiny Images, 2009"),
    "tiny_imagenet": Source((SourceFile("tiny-imagenet-200.zip", ("http://cs231n.stanford.edu/tiny-imagenet-200.zip",),
                                        "90528d7ca1a48142e341f4ef8d21d0de"),), _convert_tiny_imagenet,
                            "Stanford CS231n Tiny ImageNet (200 ImageNet classes at 64x64; Le and Yang, 2015)"),
    "femnist": HubSource("flwrlabs/femnist", _convert_femnist,
                         "LEAF FEMNIST (S. Caldas et al., arXiv:1812.01097) from NIST SD19, as published by "
                         "Flower Labs on the Hugging Face Hub (flwrlabs/femnist)"),
}


# --- the network: one function ----------------------------------------------------------------

def download(url: str, part: Path, offset: int, progress: ProgressCallback) -> None:
    """Append `url`'s bytes from `offset` on to `part` (which holds the first `offset` bytes),
    asking the server for the rest only (HTTP Range). A server that ignores Range sends the whole
    file: `part` is then rewritten from the start. Raises OSError / urllib / http.client errors."""
    request = urllib.request.Request(url, headers={"User-Agent": "pfedkit-data-fetch"})
    if offset:
        request.add_header("Range", f"bytes={offset}-")
    try:
        response = urllib.request.urlopen(request, timeout=TIMEOUT_S)
    except urllib.error.HTTPError as err:
        if err.code == 416 and offset:  # nothing left past offset: the part is complete
            return
        raise
    with response:
        resumed = offset and response.status == 206
        start = offset if resumed else 0
        length = response.headers.get("Content-Length")
        total = start + int(length) if length and length.isdigit() else None
        with open(part, "ab" if resumed else "wb") as handle:
            received = start
            progress(received, total)
            while chunk := response.read(CHUNK):
                handle.write(chunk)
                received += len(chunk)
                progress(received, total)


def download_hub(repo_id: str, revision: str | None, folder: Path) -> list[Path]:
    """The parquet shards of Hub dataset `repo_id` in `folder` (the datasets library's Hub client,
    huggingface_hub, resumes files left incomplete by an interrupted attempt). Raises its errors."""
    require_datasets()  # the hf extra brings huggingface_hub with it
    from huggingface_hub import snapshot_download

    path = snapshot_download(repo_id=repo_id, repo_type="dataset", revision=revision, local_dir=str(folder),
                             allow_patterns=["*.parquet"])
    return sorted(Path(path).rglob("*.parquet"))


# --- fetch -------------------------------------------------------------------------------------

def fetchable() -> list[str]:
    return list(SOURCES) + ["ag_news"]


def dataset_path(root: Path, name: str) -> Path:
    return root / name / f"{name}.npz.xz"


def fetch(name: str, data_dir: str | None = None, progress: bool = True) -> Path:
    """The path of `name`'s dataset file in the data directory, downloaded and converted if it is
    not there yet (a file already present is used as it is). DataError (one line) on failure.
    Holds `<data dir>/.downloads/<name>.lock` meanwhile: a concurrent fetch of `name` waits."""
    if name in DATASETS and DATASETS[name].source is not None:  # a class subset: its rows are in another file
        _say(f"{name}: a class subset of {DATASETS[name].source}; fetching {DATASETS[name].source}")
        name = DATASETS[name].source
    root = resolve_data_dir(data_dir)
    if root is None or name not in fetchable():  # _fetch_locked says why in one line
        return _fetch_locked(name, data_dir, progress)
    with fetch_lock(root, name):
        return _fetch_locked(name, data_dir, progress)


@contextmanager
def fetch_lock(root: Path, name: str):
    """Exclusive lock on `root/.downloads/<name>.lock` for the body of the `with` (module docstring):
    taken at once when free, else after one line on stderr, waiting for the holder to finish."""
    try:
        import fcntl
    except ImportError:  # Windows: no flock; fetches are not locked
        yield
        return
    path = root / ".downloads" / f"{name}.lock"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(path, "a+b")
    except OSError as err:
        raise DataError(f"data fetch {name}: cannot create the lock file {path} ({err.strerror}); "
                        "is the data directory writable?") from None
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _say(f"{name}: another `pfedkit data fetch {name}` is writing to {root} (lock {path}); "
                 "waiting for it to finish (Ctrl-C to stop)")
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _fetch_locked(name: str, data_dir: str | None, progress: bool) -> Path:
    """fetch() once the lock is held: the target if present, else download, convert, write."""
    if name == "ag_news":  # text: tokenised, not converted to images (pfedkit/data/text.py)
        from pfedkit.data.text import fetch_text

        return fetch_text(name, data_dir, progress)
    source = _source(name)
    root = resolve_data_dir(data_dir)
    if root is None:
        raise DataError(f"data fetch {name}: no data directory; give --data-dir DIR "
                        "(or set the PFEDKIT_DATA environment variable)")
    target = dataset_path(root, name)
    if target.is_file():
        _say(f"{name}: already present at {target} (not downloaded)")
        return target
    downloads = root / ".downloads" / name
    downloads.mkdir(parents=True, exist_ok=True)
    if isinstance(source, HubSource):
        arrays, provenance = _fetch_hub(name, source, downloads, progress)
    else:
        files = {item.filename: _obtain(item, downloads, progress) for item in source.files}
        if progress:  # quiet: only the result or the one-line error
            _say(f"{name}: converting {', '.join(files)}")
        arrays, provenance = _convert(name, source, files, progress), _provenance(source, files)
    payload = _encode(arrays)
    _verify_round_trip(payload, arrays, name, target)
    digest = hashlib.sha256(payload).hexdigest()
    # The checksum first, the dataset file last (atomically): stopped in between, the file is
    # simply missing and the next fetch starts over; a file never sits beside a stale checksum.
    atomic_write_text(root / name / "SOURCE.txt", provenance)
    _record_checksum(root, f"{name}/{name}.npz.xz", digest)
    atomic_write_bytes(target, payload)
    shutil.rmtree(downloads, ignore_errors=True)  # the archives are no longer needed
    writers = f", {len(arrays['writer_names'])} writers" if "writer_names" in arrays else ""
    _say(f"{name}: {len(arrays['y'])} images ({int(arrays['test'].sum())} official test{writers}) -> {target}\n"
         f"sha256 {digest}")
    return target


def _fetch_hub(name: str, source: HubSource, downloads: Path, progress: bool) -> tuple[NamedArrays, str]:
    """Download (resumable) and convert a Hub dataset; a source that does not convert is deleted."""
    require_datasets()  # before any download: the one-line install hint
    try:
        files = download_hub(source.repo_id, source.revision, downloads)
    except Exception as err:  # huggingface_hub / requests raise many types; all end in one line
        reason = " ".join(str(err).split())[:300]
        raise DataError(f"cannot download {source.repo_id} from the Hugging Face Hub ({type(err).__name__}: "
                        f"{reason}); what arrived is kept in {downloads}: run the same command again to resume") from None
    if not files:
        raise DataError(f"data fetch {name}: {source.repo_id} gave no parquet files; nothing written")
    if progress:
        _say(f"{name}: converting {len(files)} parquet file(s)")
    try:
        arrays = source.convert(files, progress)
    except (OSError, EOFError, ValueError, KeyError, TypeError, _arrow_error(), _datasets_error()) as err:
        shutil.rmtree(downloads, ignore_errors=True)  # verified by nobody and unreadable: never reuse it
        reason = " ".join(str(err).split())[:300]
        raise DataError(f"data fetch {name}: the downloaded files do not convert ({type(err).__name__}: "
                        f"{reason}); they were deleted, run the command again") from None
    lines = [f"# converted by pfedkit data fetch from: {source.citation}",
             f"# hub dataset {source.repo_id} revision {source.revision or 'default branch'}", "# sha256  file"]
    lines += [f"{_sha256_file(path)}  {path.relative_to(downloads)}" for path in files]
    return arrays, "\n".join(lines) + "\n"


def _arrow_error() -> type[Exception]:
    import pyarrow

    return pyarrow.ArrowException


def _datasets_error() -> type[Exception]:
    from datasets.exceptions import DatasetGenerationError

    return DatasetGenerationError


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


def _source(name: str) -> Source | HubSource:
    if name in SOURCES:
        return SOURCES[name]
    if name in DATASETS and DATASETS[name].embedded:
        raise DataError(f"data fetch {name}: {name} is embedded in pfedkit; nothing to fetch")
    from pfedkit.config import did_you_mean

    raise DataError(f"data fetch {name}: unknown dataset{did_you_mean(name, fetchable())}; "
                    f"fetchable: {', '.join(fetchable())}")


def _obtain(item: SourceFile, folder: Path, progress: bool) -> Path:
    """`folder/item.filename`, downloaded (resuming a `.part` left by an interrupted attempt) and
    checked against the published MD5. A file placed there by hand is checked and used."""
    done = folder / item.filename
    if done.is_file():
        _check_md5(done, item)
        return done
    part = folder / f"{item.filename}.part"
    refused, unreachable = [], None
    for url in item.urls:  # mirrors serve the same bytes (same MD5): a part resumes on any of them
        before = part.stat().st_size if part.is_file() else 0
        try:
            _download_with_bar(url, part, item.filename, progress)
            break
        except (urllib.error.HTTPError, http.client.HTTPException) as err:
            refused.append(f"{url}: {err}")
        except (urllib.error.URLError, OSError) as err:
            if isinstance(err, OSError) and getattr(err, "filename", None):
                raise  # a local file error (disk full, permissions), not the network
            if (part.stat().st_size if part.is_file() else 0) > before:
                _raise_network(url, err, part, done)  # dropped mid-transfer: resume later, here or elsewhere
            unreachable = (url, err)  # could not connect: try the next mirror
    else:
        if unreachable is not None:
            _raise_network(*unreachable, part, done)
        raise DataError(f"cannot download {item.filename}: every source refused ({'; '.join(refused)}); "
                        f"download it yourself into {done} and run the command again")
    _check_md5(part, item)
    part.replace(done)
    return done


def _download_with_bar(url: str, part: Path, label: str, progress: bool) -> None:
    """`download` with a tqdm bar on stderr, opened at the first byte (a failure to connect stays
    one line) and starting at the bytes already in `part`."""
    from tqdm import tqdm

    offset = part.stat().st_size if part.is_file() else 0
    bars = []

    def update(received: int, total: int | None) -> None:
        if not bars:
            bars.append(tqdm(desc=label, unit="B", unit_scale=True, unit_divisor=1024, initial=offset,
                             total=total, disable=not progress, file=sys.stderr))
        bar = bars[0]
        if total is not None and bar.total != total:
            bar.total = total
        bar.update(received - bar.n)

    try:
        download(url, part, offset, update)
    finally:
        for bar in bars:
            bar.close()


def _raise_network(url: str, err: BaseException, part: Path, done: Path) -> None:
    reason = getattr(err, "reason", err)
    kept = part.stat().st_size if part.is_file() else 0
    resume = f"{kept} bytes kept in {part}: run the same command again to resume" if kept else \
        "run the same command again"
    if isinstance(reason, (socket.gaierror, ConnectionRefusedError)) or getattr(reason, "errno", None) in (errno.ENETUNREACH, errno.EHOSTUNREACH):
        raise DataError(f"cannot download {url}: no network connection ({reason}); run this on a machine "
                        f"with internet access, or download the file yourself into {done}") from None
    raise DataError(f"download of {url} interrupted ({reason}); {resume}") from None


def _check_md5(path: Path, item: SourceFile) -> None:
    digest = hashlib.md5(usedforsecurity=False)  # the published checksums are MD5: integrity, not security
    with open(path, "rb") as handle:
        while block := handle.read(CHUNK):
            digest.update(block)
    if digest.hexdigest() != item.md5:
        path.unlink()  # a bad file would be resumed or reused forever: start again next time
        raise DataError(f"checksum mismatch for {item.filename}: MD5 {digest.hexdigest()}, published "
                        f"{item.md5}; the file was deleted, run the command again to download it afresh")


def _convert(name: str, source: Source, files: dict[str, Path], progress: bool = False) -> NamedArrays:
    try:
        arrays = source.convert(files, progress)
        return arrays if isinstance(arrays, dict) else dict(zip(("x", "y", "test"), arrays))
    except (OSError, EOFError, ValueError, KeyError, tarfile.TarError, zipfile.BadZipFile,
            pickle.UnpicklingError) as err:
        for path in files.values():
            path.unlink(missing_ok=True)  # verified yet unreadable: never reuse it
        raise DataError(f"data fetch {name}: the downloaded archive does not convert ({type(err).__name__}: "
                        f"{err}); it was deleted, run the command again") from None


# xz preset 6 (the default) compresses ~1-3 MB/s here: fine for CIFAR, but Tiny-ImageNet's 1.35 GB
# of pixels would take many minutes; preset 1 is several times faster for a slightly larger file.
LARGE_PAYLOAD = 256 << 20


def _encode(arrays: NamedArrays) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    raw = buffer.getvalue()
    return lzma.compress(raw, preset=1 if len(raw) > LARGE_PAYLOAD else 6)


def _verify_round_trip(payload: bytes, arrays: NamedArrays, name: str, target: Path) -> None:
    """Decode what is about to be written through the loader's own checks and compare it with the
    converted arrays: only a file that reads back exactly is installed."""
    decoded = _check_npz(_load_npz(io.BytesIO(lzma.decompress(payload)), target), name, target)
    same = set(decoded) == set(arrays) and all(
        np.array_equal(decoded[key], arrays[key]) and decoded[key].dtype == arrays[key].dtype for key in arrays)
    if not same:
        raise DataError(f"data fetch {name}: the converted file does not read back identically; nothing written")


def _provenance(source: Source, files: dict[str, Path]) -> str:
    lines = [f"# converted by pfedkit data fetch from: {source.citation}", "# sha256  md5  file  urls"]
    for item in source.files:
        path = files[item.filename]
        lines.append(f"{hashlib.sha256(path.read_bytes()).hexdigest()}  {item.md5}  {item.filename}  "
                     f"{' '.join(item.urls)}")
    return "\n".join(lines) + "\n"


def _record_checksum(root: Path, relative: str, digest: str) -> None:
    """Add `digest  relative` to SHA256SUMS, replacing an older line for the same file."""
    sums = root / "SHA256SUMS"
    kept = [line for line in (sums.read_text().splitlines() if sums.is_file() else [])
            if line.split()[-1:] != [relative] and line.split()[-1:] != [f"*{relative}"]]
    atomic_write_text(sums, "\n".join([*kept, f"{digest}  {relative}"]) + "\n")


def _say(text: str) -> None:
    print(text, file=sys.stderr)
