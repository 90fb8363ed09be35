"""`pfedkit data fetch NAME`: download a dataset from its canonical public source, verify it and
convert it once into pfedkit's format (`<name>/<name>.npz.xz`, arrays x, y, test; see
../shared/datasets/README.md), recording the file's SHA-256 in the data directory's SHA256SUMS.

Downloads go to `<data dir>/.downloads/<name>/<file>.part` and resume from there (HTTP Range) when
interrupted; a file is kept only once its published checksum matches. The dataset file is written
atomically and only after the converted arrays have been read back and compared, so a run never
sees a truncated or half-converted file. The network is touched in one place, `download`, which
the tests replace.
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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pfedkit.atomic import atomic_write_bytes, atomic_write_text
from pfedkit.data.datasets import DATASETS, DataError, _check_arrays, _load_arrays, resolve_data_dir

Arrays = tuple[np.ndarray, np.ndarray, np.ndarray]  # x, y, test
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
    convert: Callable[[dict[str, Path]], Arrays]  # {filename: downloaded path} -> x, y, test
    citation: str


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


def _convert_idx(files: dict[str, Path]) -> Arrays:
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


def _convert_cifar10(files: dict[str, Path]) -> Arrays:
    archive = files["cifar-10-python.tar.gz"]
    x_train, y_train = _cifar_batches(archive, [f"cifar-10-batches-py/data_batch_{i}" for i in range(1, 6)], b"labels")
    x_test, y_test = _cifar_batches(archive, ["cifar-10-batches-py/test_batch"], b"labels")
    return _join(x_train, y_train, x_test, y_test)


def _convert_cifar100(files: dict[str, Path]) -> Arrays:
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


def _idx_files(mirrors: tuple[str, ...], md5s: dict[str, str]) -> tuple[SourceFile, ...]:
    return tuple(SourceFile(name, tuple(base + name for base in mirrors), md5) for name, md5 in md5s.items())


# Canonical sources (torchvision's mirrors first where the original host refuses scripts) and the
# MD5 checksums published with them.
SOURCES: dict[str, Source] = {
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


# --- fetch -------------------------------------------------------------------------------------

def fetchable() -> list[str]:
    return list(SOURCES)


def dataset_path(root: Path, name: str) -> Path:
    return root / name / f"{name}.npz.xz"


def fetch(name: str, data_dir: str | None = None, progress: bool = True) -> Path:
    """The path of `name`'s dataset file in the data directory, downloaded and converted if it is
    not there yet (a file already present is used as it is). DataError (one line) on failure."""
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
    files = {item.filename: _obtain(item, downloads, progress) for item in source.files}
    if progress:  # quiet: only the result or the one-line error
        _say(f"{name}: converting {', '.join(files)}")
    arrays = _convert(name, source, files)
    payload = _encode(arrays)
    _verify_round_trip(payload, arrays, name, target)
    digest = hashlib.sha256(payload).hexdigest()
    # The checksum first, the dataset file last (atomically): stopped in between, the file is
    # simply missing and the next fetch starts over; a file never sits beside a stale checksum.
    atomic_write_text(root / name / "SOURCE.txt", _provenance(source, files))
    _record_checksum(root, f"{name}/{name}.npz.xz", digest)
    atomic_write_bytes(target, payload)
    shutil.rmtree(downloads, ignore_errors=True)  # the archives are no longer needed
    _say(f"{name}: {len(arrays[1])} images ({int(arrays[2].sum())} official test) -> {target}\n"
         f"sha256 {digest}")
    return target


def _source(name: str) -> Source:
    if name in SOURCES:
        return SOURCES[name]
    if name in DATASETS and DATASETS[name].embedded:
        raise DataError(f"data fetch {name}: {name} is embedded in pfedkit; nothing to fetch")
    from pfedkit.config import did_you_mean

    raise DataError(f"data fetch {name}: unknown dataset{did_you_mean(name, list(SOURCES))}; "
                    f"fetchable: {', '.join(SOURCES)}")


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


def _convert(name: str, source: Source, files: dict[str, Path]) -> Arrays:
    try:
        return source.convert(files)
    except (OSError, EOFError, ValueError, KeyError, tarfile.TarError, pickle.UnpicklingError) as err:
        for path in files.values():
            path.unlink(missing_ok=True)  # verified yet unreadable: never reuse it
        raise DataError(f"data fetch {name}: the downloaded archive does not convert ({type(err).__name__}: "
                        f"{err}); it was deleted, run the command again") from None


def _encode(arrays: Arrays) -> bytes:
    x, y, test = arrays
    buffer = io.BytesIO()
    np.savez(buffer, x=x, y=y, test=test)
    return lzma.compress(buffer.getvalue())


def _verify_round_trip(payload: bytes, arrays: Arrays, name: str, target: Path) -> None:
    """Decode what is about to be written through the loader's own checks and compare it with the
    converted arrays: only a file that reads back exactly is installed."""
    decoded = _check_arrays(_load_arrays(io.BytesIO(lzma.decompress(payload)), target), name, target)
    if not all(np.array_equal(a, b) and a.dtype == b.dtype for a, b in zip(decoded, arrays)):
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
