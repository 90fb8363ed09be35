"""The network side of `pfedkit data fetch`: downloading published files (resumable, MD5-checked,
mirrors tried in order), Hub datasets, and the lock that keeps two fetches of one dataset apart.

Downloads go to `<data dir>/.downloads/<name>/<file>.part` and resume from there (HTTP Range) when
interrupted; a file is kept only once its published checksum matches. The network is touched in
one place per kind of source, `download` (a URL) and `download_hub` (a Hugging Face Hub dataset:
FEMNIST); the tests replace these two (`monkeypatch.setattr(pfedkit.data.download, "download",
...)`: callers look them up in this module when they call).

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
import hashlib
import http.client
import socket
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

from pfedkit.data.hf import require_datasets
from pfedkit.data.sources import SourceFile
from pfedkit.data.store import DataError

# received: bytes written so far (the resumed offset included); total: the full size, if known
ProgressCallback = Callable[[int, "int | None"], None]
CHUNK = 1 << 20
TIMEOUT_S = 60


# --- the network: one function per kind of source ---------------------------------------------

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
    require_datasets("data fetch from the Hugging Face Hub needs")  # the hf extra brings huggingface_hub with it
    from huggingface_hub import snapshot_download

    path = snapshot_download(repo_id=repo_id, repo_type="dataset", revision=revision, local_dir=str(folder),
                             allow_patterns=["*.parquet"])
    return sorted(Path(path).rglob("*.parquet"))


# --- published files: mirrors, resume, MD5 ----------------------------------------------------

def obtain(item: SourceFile, folder: Path, progress: bool) -> Path:
    """`folder/item.filename`, downloaded (resuming a `.part` left by an interrupted attempt) and
    checked against the published MD5. A file placed there by hand is checked and used."""
    done = folder / item.filename
    if done.is_file():
        check_md5(done, item)
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
    check_md5(part, item)
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
    unreachable = getattr(reason, "errno", None) in (errno.ENETUNREACH, errno.EHOSTUNREACH)
    if isinstance(reason, (socket.gaierror, ConnectionRefusedError)) or unreachable:
        raise DataError(f"cannot download {url}: no network connection ({reason}); run this on a machine "
                        f"with internet access, or download the file yourself into {done}") from None
    raise DataError(f"download of {url} interrupted ({reason}); {resume}") from None


def check_md5(path: Path, item: SourceFile) -> None:
    actual = _file_digest(path, hashlib.md5(usedforsecurity=False))  # published MD5s: integrity, not security
    if actual != item.md5:
        path.unlink()  # a bad file would be resumed or reused forever: start again next time
        raise DataError(f"checksum mismatch for {item.filename}: MD5 {actual}, published "
                        f"{item.md5}; the file was deleted, run the command again to download it afresh")


def sha256_file(path: Path) -> str:
    return _file_digest(path, hashlib.sha256())


def _file_digest(path: Path, digest) -> str:
    """The hex digest of a file read in chunks (archives can be larger than memory allows twice)."""
    with open(path, "rb") as handle:
        while block := handle.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


# --- one fetch per dataset and data directory at a time -------------------------------------

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
            say(f"{name}: another `pfedkit data fetch {name}` is writing to {root} (lock {path}); "
                "waiting for it to finish (Ctrl-C to stop)")
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def say(text: str) -> None:
    """A line of `data fetch` output, on stderr (stdout carries only the dataset file's path)."""
    print(text, file=sys.stderr)
