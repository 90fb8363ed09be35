"""The network side of `pfedkit data fetch`: downloading published files (resumable, MD5-checked,
mirrors tried in order), Hub datasets, and the lock that keeps two fetches of one dataset apart.

Downloads go to `<data dir>/.downloads/<name>/<file>.part` and resume from there (HTTP Range) when
interrupted; a file is kept, as `<file>`, only once its published checksum matches, so nothing
downloaded is read (CIFAR's pickles included) before its MD5 is checked. The data directory may be
shared, so nothing there is written through a symbolic link: a link planted at `.downloads`,
`.downloads/<name>`, a `.part`, a downloaded file's name or the lock is removed (the link, never its
target); a new `.part` is created fresh (O_EXCL, mode 0600) and `download` refuses to open a link
(O_NOFOLLOW). (The `.part` keeps its fixed name rather than a random temporary one so that a
download killed outright, `kill -9` included, still resumes.) The network is touched in
one place per kind of source, `download` (a URL) and `download_hub` (a Hugging Face Hub dataset:
FEMNIST); the tests replace these two (`monkeypatch.setattr(pfedkit.data.download, "download",
...)`: callers look them up in this module when they call).

Two fetches of the same dataset into the same data directory (two terminals, two jobs of a cluster
on a shared disk) would append to the same `.part` file and convert it twice. A fetch therefore
holds an exclusive lock, `<data dir>/.downloads/<name>.lock` (`fcntl.flock`), from its first look
at the target to its last write. A second fetch says so in one line and *waits*; when it gets the
lock the file is there and it returns at once ("already present"). Waiting, not refusing: a script
that fetches before it runs should not fail because a neighbour fetched first; Ctrl-C stops the
wait. flock locks die with their process, so a killed fetch leaves no stale lock. A fetch that
ends deletes the lock file while it still holds the lock (and `.downloads` when empty), and a
fetch that gets a lock checks that the file it locked is still the one at the lock's path
(else it locks the new one), so deleting never lets two fetches in at once. Where `fcntl` does
not exist (Windows), fetches are not locked.
"""
from __future__ import annotations

import errno
import hashlib
import http.client
import os
import socket
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

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
        with open_no_follow(part, append=bool(resumed)) as handle:
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

@dataclass
class DownloadFailed(Exception):
    """One file that no mirror delivered: `obtain_all` reports every such file in one line."""
    filename: str
    urls: tuple[str, ...]  # the mirrors tried
    reason: str            # why, in a few words
    kind: str              # "offline" (no connection), "refused" (HTTP errors) or "interrupted"


def obtain_all(items: Iterable[SourceFile], folder: Path, progress: bool) -> dict[str, Path]:
    """{filename: path} of every item (`obtain`); every file tried before a failure is reported,
    in one DataError naming each file missing and each mirror tried."""
    files, failures = {}, []
    for item in items:
        try:
            files[item.filename] = obtain(item, folder, progress)
        except DownloadFailed as failure:
            failures.append(failure)
    if failures:
        raise DataError(describe_failures(failures, folder))
    return files


def describe_failures(failures: list[DownloadFailed], folder: Path) -> str:
    """One line: the files not downloaded, why, every mirror tried, and what to do."""
    mirrors = list(dict.fromkeys(url.removesuffix(f.filename) or url for f in failures for url in f.urls))
    reasons = list(dict.fromkeys(f.reason for f in failures))
    if len(reasons) == 1:
        what = f"{', '.join(f.filename for f in failures)}: {reasons[0]}"
    else:
        what = "; ".join(f"{f.filename}: {f.reason}" for f in failures)
    kinds = {f.kind for f in failures}
    if "interrupted" in kinds:
        fix = "run the same command again to resume"
    elif kinds == {"offline"}:
        fix = f"run this on a machine with internet access, or download the file(s) yourself into {folder}"
    else:
        fix = f"download the file(s) yourself into {folder} and run the command again"
    count = f"{len(failures)} files" if len(failures) > 1 else "1 file"
    return f"cannot download {count} ({what}; mirrors tried: {', '.join(mirrors)}); {fix}"


def obtain(item: SourceFile, folder: Path, progress: bool) -> Path:
    """`folder/item.filename`, downloaded (resuming a `.part` left by an interrupted attempt) and
    checked against the published MD5. A file placed there by hand is checked and used; a link
    there is removed, never followed. DownloadFailed when no mirror delivers it."""
    done = folder / item.filename
    if done.is_file() and not done.is_symlink():
        check_md5(done, item)
        return done
    remove_link(done)
    part = _own_part(folder / f"{item.filename}.part")
    try:
        _download_from_mirrors(item, part, progress)
    except BaseException:
        if part.is_file() and not part.stat().st_size:  # nothing arrived: nothing to resume, nothing left
            part.unlink()
        raise
    check_md5(part, item)  # a mismatch deletes it: the next attempt starts afresh
    part.replace(done)
    return done


def _own_part(part: Path) -> Path:
    """`part` as a regular file to append to: a link there is removed (its target untouched), a
    missing part is created new (O_EXCL, never through a link, mode 0600)."""
    remove_link(part)
    if not part.exists():
        os.close(os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600))
    return part


def _download_from_mirrors(item: SourceFile, part: Path, progress: bool) -> None:
    """Append `item` to `part` from the first mirror that delivers it; DownloadFailed if none."""
    refused, unreachable = [], None
    for url in item.urls:  # mirrors serve the same bytes (same MD5): a part resumes on any of them
        before = part.stat().st_size
        try:
            _download_with_bar(url, part, item.filename, progress)
            return
        except (urllib.error.HTTPError, http.client.HTTPException) as err:
            refused.append(f"{url}: {err}")
        except (urllib.error.URLError, OSError) as err:
            if isinstance(err, OSError) and getattr(err, "filename", None):
                raise  # a local file error (disk full, permissions), not the network
            if part.stat().st_size > before:  # dropped mid-transfer: resume later, here or elsewhere
                raise _network_failure(item, url, err, part) from None
            unreachable = err  # could not connect: try the next mirror
    if unreachable is not None:
        raise _network_failure(item, None, unreachable, part) from None
    raise DownloadFailed(item.filename, item.urls, f"every mirror refused ({'; '.join(refused)})", "refused")


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


def _network_failure(item: SourceFile, url: str | None, err: BaseException, part: Path) -> DownloadFailed:
    """`url` None: no mirror could be reached; else `url` dropped the transfer (`part` keeps what came)."""
    reason = getattr(err, "reason", err)
    unreachable = getattr(reason, "errno", None) in (errno.ENETUNREACH, errno.EHOSTUNREACH)
    if url is None and (isinstance(reason, (socket.gaierror, ConnectionRefusedError)) or unreachable):
        return DownloadFailed(item.filename, item.urls, f"no network connection ({reason})", "offline")
    tried = item.urls if url is None else item.urls[:item.urls.index(url) + 1]
    kept = part.stat().st_size if part.is_file() else 0
    kept_text = f", {kept} bytes kept in {part}" if kept else ""
    return DownloadFailed(item.filename, tried, f"interrupted ({reason}){kept_text}", "interrupted")


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


# --- no symbolic links in a shared data directory ---------------------------------------------

def remove_link(path: Path) -> None:
    """Remove `path` if it is a symbolic link (the link itself: its target is never touched)."""
    if path.is_symlink():
        path.unlink()


def private_folder(path: Path) -> Path:
    """`path` as a real folder, created if needed: a link planted there is removed first."""
    remove_link(path)
    path.mkdir(parents=True, exist_ok=True)
    return path


def open_no_follow(path: Path, append: bool) -> BinaryIO:
    """`path` opened for writing (appending, or from the start), refusing to follow a link."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC) | getattr(os, "O_NOFOLLOW", 0)
    return open(os.open(path, flags, 0o600), "ab" if append else "wb")


def remove_empty(folder: Path) -> None:
    """Remove `folder` if it is an empty real folder (another fetch may be using it: then kept)."""
    try:
        if not folder.is_symlink():
            folder.rmdir()
    except OSError:  # not empty, or gone
        pass


# --- one fetch per dataset and data directory at a time -------------------------------------

@contextmanager
def fetch_lock(root: Path, name: str):
    """Exclusive lock on `root/.downloads/<name>.lock` for the body of the `with` (module docstring):
    taken at once when free, else after one line on stderr, waiting for the holder to finish. The
    lock file (and `.downloads`, when empty) is removed when the body ends."""
    try:
        import fcntl
    except ImportError:  # Windows: no flock; fetches are not locked
        yield
        return
    path = root / ".downloads" / f"{name}.lock"
    handle = _take_lock(fcntl, path, root, name)
    try:
        yield
    finally:
        path.unlink(missing_ok=True)  # while still locked: a waiter sees it gone and locks a new file
        remove_empty(path.parent)
        fcntl.flock(handle, fcntl.LOCK_UN)
        handle.close()


def _take_lock(fcntl, path: Path, root: Path, name: str) -> BinaryIO:
    """The lock file at `path`, opened (never through a link) and flock-ed; if the holder we
    waited for removed it meanwhile, the new file at `path` is locked instead."""
    waited = False
    while True:
        handle = _open_lock_file(path, name)
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not waited:
                say(f"{name}: another `pfedkit data fetch {name}` is writing to {root} (lock {path}); "
                    "waiting for it to finish (Ctrl-C to stop)")
                waited = True
            fcntl.flock(handle, fcntl.LOCK_EX)
        if _is_file_at(handle, path):
            return handle
        handle.close()


def _open_lock_file(path: Path, name: str) -> BinaryIO:
    while True:
        try:
            private_folder(path.parent)  # .downloads
            remove_link(path)
            flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0)
            return open(os.open(path, flags, 0o644), "r+b")
        except FileNotFoundError:  # a fetch that ended removed .downloads just now: again
            continue
        except OSError as err:
            if err.errno == errno.ELOOP:  # a link planted between the two calls: removed next time
                continue
            raise DataError(f"data fetch {name}: cannot create the lock file {path} ({err.strerror}); "
                            "is the data directory writable?") from None


def _is_file_at(handle: BinaryIO, path: Path) -> bool:
    """Whether the open `handle` is still the file at `path` (not removed nor replaced)."""
    try:
        here = os.lstat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(handle.fileno())
    return (here.st_dev, here.st_ino) == (mine.st_dev, mine.st_ino)


def say(text: str) -> None:
    """A line of `data fetch` output, on stderr (stdout carries only the dataset file's path)."""
    print(text, file=sys.stderr)
