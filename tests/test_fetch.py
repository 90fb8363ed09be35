"""`pfedkit data fetch`, offline: tiny fixtures in the published formats (MNIST IDX gz, CIFAR-10/100
python-pickle tar.gz), served by a replacement of `download.download` that copies bytes."""
from __future__ import annotations

import dataclasses
import gzip
import hashlib
import io
import pickle
import struct
import tarfile

import numpy as np
import pytest

from pfedkit.cli import main
from pfedkit.data import download as download_module
from pfedkit.data import fetch as fetch_module
from pfedkit.data import sources
from pfedkit.data.datasets import load_dataset

RNG = np.random.default_rng(0)


def _idx(array: np.ndarray) -> bytes:
    header = struct.pack(">BBBB", 0, 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    return gzip.compress(header + array.astype(np.uint8).tobytes())


def _mnist_fixture():
    x_train = RNG.integers(0, 256, (5, 28, 28), dtype=np.uint8)
    y_train = np.array([3, 1, 4, 1, 5], np.uint8)
    x_test = RNG.integers(0, 256, (3, 28, 28), dtype=np.uint8)
    y_test = np.array([9, 2, 6], np.uint8)
    files = {"train-images-idx3-ubyte.gz": _idx(x_train), "train-labels-idx1-ubyte.gz": _idx(y_train),
             "t10k-images-idx3-ubyte.gz": _idx(x_test), "t10k-labels-idx1-ubyte.gz": _idx(y_test)}
    return files, (x_train, y_train, x_test, y_test)


def _tar_gz(members: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, payload in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))
    return buffer.getvalue()


def _batch(images: np.ndarray, labels: np.ndarray, label_key: bytes) -> bytes:
    """A CIFAR batch as published: rows of 3072 channel-major values, labels as a list."""
    rows = images.transpose(0, 3, 1, 2).reshape(len(images), 3072)
    return pickle.dumps({b"data": rows, label_key: [int(v) for v in labels]}, protocol=2)


def _cifar10_fixture():
    parts = [(RNG.integers(0, 256, (2, 32, 32, 3), dtype=np.uint8), RNG.integers(0, 10, 2).astype(np.uint8))
             for _ in range(6)]
    members = {f"cifar-10-batches-py/data_batch_{i + 1}": _batch(*parts[i], b"labels") for i in range(5)}
    members["cifar-10-batches-py/test_batch"] = _batch(*parts[5], b"labels")
    x_train = np.concatenate([p[0] for p in parts[:5]])
    y_train = np.concatenate([p[1] for p in parts[:5]])
    return {"cifar-10-python.tar.gz": _tar_gz(members)}, (x_train, y_train, parts[5][0], parts[5][1])


def _cifar100_fixture():
    x_train = RNG.integers(0, 256, (4, 32, 32, 3), dtype=np.uint8)
    y_train = np.array([0, 57, 99, 12], np.uint8)
    x_test = RNG.integers(0, 256, (2, 32, 32, 3), dtype=np.uint8)
    y_test = np.array([98, 3], np.uint8)
    archive = _tar_gz({"cifar-100-python/train": _batch(x_train, y_train, b"fine_labels"),
                       "cifar-100-python/test": _batch(x_test, y_test, b"fine_labels")})
    return {"cifar-100-python.tar.gz": archive}, (x_train, y_train, x_test, y_test)


FIXTURES = {"mnist": _mnist_fixture, "cifar10": _cifar10_fixture, "cifar100": _cifar100_fixture}


class FakeServer:
    """Replaces `download.download`: serves fixture bytes by file name, records every call's offset,
    and can stop a transfer part-way (`cut_after`) like a dropped connection."""

    def __init__(self, files: dict[str, bytes]):
        self.files = files
        self.calls: list[tuple[str, int]] = []
        self.cut_after: int | None = None

    def __call__(self, url, part, offset, progress):
        name = url.rsplit("/", 1)[-1]
        self.calls.append((name, offset))
        payload = self.files[name]
        end = len(payload) if self.cut_after is None else min(len(payload), offset + self.cut_after)
        with open(part, "ab") as handle:
            handle.write(payload[offset:end])
        progress(end, len(payload))
        if end < len(payload):
            raise ConnectionResetError("connection reset by peer")


def _serve(monkeypatch, name: str, files: dict[str, bytes], published: dict[str, bytes] | None = None) -> FakeServer:
    """Install `files` as what the network returns for `name`, with the published MD5s of
    `published` (default: of `files` themselves, i.e. an intact download)."""
    published = published or files
    source = sources.SOURCES[name]
    items = tuple(dataclasses.replace(item, md5=hashlib.md5(published[item.filename]).hexdigest())
                  for item in source.files)
    monkeypatch.setitem(sources.SOURCES, name, dataclasses.replace(source, files=items))
    server = FakeServer(files)
    monkeypatch.setattr(download_module, "download", server)
    return server


def _visible_files(root):
    """Files a run or `sha256sum -c` could pick up: everything outside the .downloads folder."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and ".downloads" not in p.parts)


@pytest.mark.parametrize("name", ["mnist", "cifar10", "cifar100"])
def test_fetch_converts_exactly_and_loads(name, tmp_path, monkeypatch, capsys):
    files, (x_train, y_train, x_test, y_test) = FIXTURES[name]()
    server = _serve(monkeypatch, name, files)
    root = tmp_path / "data"
    assert main(["data", "fetch", name, "--data-dir", str(root), "-q"]) == 0
    assert sorted(call[0] for call in server.calls) == sorted(files)

    target = root / name / f"{name}.npz.xz"
    digest = hashlib.sha256(target.read_bytes()).hexdigest()
    assert f"{digest}  {name}/{name}.npz.xz" in (root / "SHA256SUMS").read_text().splitlines()
    assert str(target) in capsys.readouterr().out

    data = load_dataset(name, str(root), cache_dir=str(tmp_path / "cache"))  # checks SHA256SUMS too
    np.testing.assert_array_equal(data.stored, np.concatenate([x_train, x_test]))
    assert data.stored.dtype == np.uint8
    np.testing.assert_array_equal(data.y, np.concatenate([y_train, y_test]))
    np.testing.assert_array_equal(data.official_test, [False] * len(y_train) + [True] * len(y_test))
    assert data.num_classes == (100 if name == "cifar100" else 10)
    assert not (root / ".downloads" / name).exists(), "the archives are removed once converted"


def test_fetch_appends_to_existing_checksums(tmp_path, monkeypatch):
    root = tmp_path / "data"
    root.mkdir()
    (root / "SHA256SUMS").write_text(f"{'a' * 64}  cifar10/cifar10.npz.xz\n{'b' * 64}  mnist/mnist.npz.xz\n")
    files, _ = _mnist_fixture()
    _serve(monkeypatch, "mnist", files)
    fetch_module.fetch("mnist", str(root), progress=False)
    lines = (root / "SHA256SUMS").read_text().splitlines()
    digest = hashlib.sha256((root / "mnist" / "mnist.npz.xz").read_bytes()).hexdigest()
    assert lines == [f"{'a' * 64}  cifar10/cifar10.npz.xz", f"{digest}  mnist/mnist.npz.xz"]


def test_checksum_mismatch_is_refused_and_leaves_nothing(tmp_path, monkeypatch, capsys):
    files, _ = _mnist_fixture()
    tampered = dict(files, **{"t10k-images-idx3-ubyte.gz": files["t10k-images-idx3-ubyte.gz"][:-7]})  # truncated
    _serve(monkeypatch, "mnist", tampered, published=files)
    root = tmp_path / "data"
    assert main(["data", "fetch", "mnist", "--data-dir", str(root), "-q"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "checksum mismatch for t10k-images-idx3-ubyte.gz" in err
    assert _visible_files(root) == []
    assert not (root / ".downloads" / "mnist" / "t10k-images-idx3-ubyte.gz").exists()
    assert not (root / ".downloads" / "mnist" / "t10k-images-idx3-ubyte.gz.part").exists(), \
        "a bad part would be resumed forever"


def test_broken_archive_with_matching_checksum_is_refused(tmp_path, monkeypatch, capsys):
    files, _ = _cifar100_fixture()
    broken = {"cifar-100-python.tar.gz": files["cifar-100-python.tar.gz"][: len(files["cifar-100-python.tar.gz"]) // 2]}
    _serve(monkeypatch, "cifar100", broken)  # published MD5 = the broken bytes: only conversion can tell
    root = tmp_path / "data"
    assert main(["data", "fetch", "cifar100", "--data-dir", str(root), "-q"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "does not convert" in err
    assert _visible_files(root) == []
    assert not (root / ".downloads").exists(), "no empty folder nor lock file left behind"


def test_pickle_with_foreign_objects_is_refused(tmp_path, monkeypatch, capsys):
    evil = pickle.dumps({b"data": np.zeros((1, 3072), np.uint8), b"fine_labels": [0], b"x": dataclasses.field})
    archive = _tar_gz({"cifar-100-python/train": evil, "cifar-100-python/test": evil})
    _serve(monkeypatch, "cifar100", {"cifar-100-python.tar.gz": archive})
    assert main(["data", "fetch", "cifar100", "--data-dir", str(tmp_path), "-q"]) == 2
    assert "unexpected object dataclasses.field" in capsys.readouterr().err
    assert _visible_files(tmp_path) == []


def test_interrupted_download_resumes_from_the_part(tmp_path, monkeypatch, capsys):
    files, (x_train, _, _, _) = _cifar10_fixture()
    server = _serve(monkeypatch, "cifar10", files)
    size = len(files["cifar-10-python.tar.gz"])
    server.cut_after = size // 3
    root = tmp_path / "data"
    assert main(["data", "fetch", "cifar10", "--data-dir", str(root), "-q"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "run the same command again to resume" in err
    assert _visible_files(root) == []
    part = root / ".downloads" / "cifar10" / "cifar-10-python.tar.gz.part"
    assert part.stat().st_size == size // 3

    server.cut_after = None
    assert main(["data", "fetch", "cifar10", "--data-dir", str(root), "-q"]) == 0
    assert server.calls == [("cifar-10-python.tar.gz", 0), ("cifar-10-python.tar.gz", size // 3)]
    data = load_dataset("cifar10", str(root), cache_dir=str(tmp_path / "cache"))
    np.testing.assert_array_equal(data.stored[: len(x_train)], x_train)


def test_present_file_is_used_without_download(tmp_path, monkeypatch, capsys):
    root = tmp_path / "data"
    (root / "mnist").mkdir(parents=True)
    (root / "mnist" / "mnist.npz.xz").write_bytes(b"already here")
    server = _serve(monkeypatch, "mnist", _mnist_fixture()[0])
    assert main(["data", "fetch", "mnist", "--data-dir", str(root), "-q"]) == 0
    assert server.calls == []
    assert (root / "mnist" / "mnist.npz.xz").read_bytes() == b"already here"
    assert "already present" in capsys.readouterr().err


def test_no_network_says_so_in_one_line(tmp_path, monkeypatch, capsys):
    import socket
    import urllib.error

    def offline(url, part, offset, progress):
        raise urllib.error.URLError(socket.gaierror(-2, "Name or service not known"))

    monkeypatch.setattr(download_module, "download", offline)
    assert main(["data", "fetch", "fashion_mnist", "--data-dir", str(tmp_path), "-q"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no network connection" in err
    assert _visible_files(tmp_path) == []


@pytest.mark.parametrize("name, message", [("cifar101", "did you mean cifar10?"), ("digits", "embedded")])
def test_bad_names_exit_2(name, message, tmp_path, capsys):
    assert main(["data", "fetch", name, "--data-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


def test_run_with_missing_dataset_names_the_fetch_command(tmp_path, capsys):
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    assert main(["run", "-q", "dataset=cifar100", f"data_dir={data_dir}", f"out_dir={tmp_path / 'runs'}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert f"`pfedkit data fetch cifar100 --data-dir {data_dir}`" in err
    assert not (tmp_path / "runs").exists()


def test_converted_data_failing_the_loader_checks_leaves_nothing(tmp_path, monkeypatch, capsys):
    """Only a file that reads back through the loader's checks is installed: here a label 10 in a
    10-class set (a changed upstream format would look like this)."""
    images = RNG.integers(0, 256, (2, 32, 32, 3), dtype=np.uint8)
    members = {f"cifar-10-batches-py/data_batch_{i}": _batch(images, np.array([1, 2]), b"labels") for i in range(1, 6)}
    members["cifar-10-batches-py/test_batch"] = _batch(images, np.array([3, 10]), b"labels")
    _serve(monkeypatch, "cifar10", {"cifar-10-python.tar.gz": _tar_gz(members)})
    assert main(["data", "fetch", "cifar10", "--data-dir", str(tmp_path), "-q"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "labels run from 1 to 10" in err
    assert not (tmp_path / "cifar10" / "cifar10.npz.xz").exists()
    assert not (tmp_path / "SHA256SUMS").exists()


# ---------------------------------------------------------------------------------------------
# Two fetches of one dataset into one data directory (fetch_lock)
# ---------------------------------------------------------------------------------------------

def test_a_second_fetch_waits_for_the_first_and_downloads_nothing(tmp_path, monkeypatch, capsys):
    import threading

    files, (x_train, _, x_test, _) = _mnist_fixture()
    server = _serve(monkeypatch, "mnist", files)
    started, release = threading.Event(), threading.Event()

    def slow_download(url, part, offset, progress):  # the first fetch stalls inside its download
        started.set()
        assert release.wait(10)
        server(url, part, offset, progress)

    monkeypatch.setattr(download_module, "download", slow_download)
    root = tmp_path / "data"
    results, errors = {}, []

    def fetch(tag):
        try:
            results[tag] = fetch_module.fetch("mnist", str(root), progress=False)
        except BaseException as err:  # surfaced by the assertions below
            errors.append(err)

    first = threading.Thread(target=fetch, args=("first",))
    first.start()
    assert started.wait(10)
    second = threading.Thread(target=fetch, args=("second",))
    second.start()
    second.join(0.5)
    assert second.is_alive(), "the second fetch must wait while the first holds the lock"
    assert "another `pfedkit data fetch mnist` is writing to" in capsys.readouterr().err
    assert len(server.calls) == 0  # the first one is still stalled in its first download
    release.set()
    first.join(10)
    second.join(10)
    assert not errors and not first.is_alive() and not second.is_alive()
    assert results["first"] == results["second"] == root / "mnist" / "mnist.npz.xz"
    # each file downloaded once, from offset 0: no two writers appended to one .part
    assert sorted(server.calls) == sorted((name, 0) for name in files)
    assert "already present" in capsys.readouterr().err
    data = load_dataset("mnist", str(root), cache_dir=str(tmp_path / "cache"))
    np.testing.assert_array_equal(data.stored, np.concatenate([x_train, x_test]))


def test_a_killed_fetch_leaves_no_stale_lock(tmp_path, monkeypatch):
    """The lock belongs to a process: kill the holder and the next fetch goes ahead at once."""
    import subprocess
    import sys
    import threading

    server = _serve(monkeypatch, "mnist", _mnist_fixture()[0])
    root = tmp_path / "data"
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, sys, pathlib\n"
        f"p = pathlib.Path({str(root)!r}) / '.downloads' / 'mnist.lock'\n"
        "p.parent.mkdir(parents=True, exist_ok=True)\n"
        "h = open(p, 'a+b'); fcntl.flock(h, fcntl.LOCK_EX)\n"
        "print('locked', flush=True); sys.stdin.read()\n")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        done = threading.Event()
        waiter = threading.Thread(target=lambda: (fetch_module.fetch("mnist", str(root), progress=False), done.set()))
        waiter.start()
        assert not done.wait(0.5) and server.calls == []  # blocked by the other process's lock
    finally:
        holder.kill()
        holder.wait()
    assert done.wait(10), "the fetch must go ahead once the holder is gone"
    waiter.join()
    assert (root / "mnist" / "mnist.npz.xz").is_file()
    assert not (root / ".downloads").exists(), "the lock file goes with the fetch that held it last"


# ---------------------------------------------------------------------------------------------
# Offline, planted links, and pickles only after their MD5 (issue 43)
# ---------------------------------------------------------------------------------------------

def test_offline_fetch_names_every_missing_file_and_every_mirror_and_leaves_nothing(tmp_path, monkeypatch, capsys):
    import socket
    import urllib.error

    tried = []

    def offline(url, part, offset, progress):
        tried.append(url)
        raise urllib.error.URLError(socket.gaierror(-2, "Name or service not known"))

    monkeypatch.setattr(download_module, "download", offline)
    root = tmp_path / "data"
    assert main(["data", "fetch", "mnist", "--data-dir", str(root), "-q"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no network connection" in err, err
    source = sources.SOURCES["mnist"]
    assert sorted(tried) == sorted(url for item in source.files for url in item.urls)  # every file, every mirror
    for item in source.files:
        assert item.filename in err
        for url in item.urls:
            assert url.removesuffix(item.filename) in err
    assert not root.exists(), "no empty .downloads/mnist folder, no lock file, no empty data directory"


VICTIM = b"a file outside the data directory"


@pytest.mark.parametrize("planted", ["train-images-idx3-ubyte.gz", "train-images-idx3-ubyte.gz.part",
                                     "../mnist.lock", "."])
def test_a_link_planted_in_the_downloads_folder_is_never_written_through(planted, tmp_path, monkeypatch):
    """A shared data directory: someone plants a symbolic link where a fetch writes (a download, its
    .part, the lock, the dataset's downloads folder itself); the fetch replaces the link and the
    file (or folder) it points to is untouched."""
    files, (x_train, _, x_test, _) = _mnist_fixture()
    _serve(monkeypatch, "mnist", files)
    root, outside = tmp_path / "data", tmp_path / "outside"
    outside.mkdir()
    victim = outside / ("folder" if planted == "." else "victim")
    if planted == ".":
        victim.mkdir()
        (victim / "kept").write_bytes(VICTIM)
    else:
        victim.write_bytes(VICTIM)
    link = (root / ".downloads" / "mnist" / planted).resolve() if planted != "." else root / ".downloads" / "mnist"
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(victim)

    assert main(["data", "fetch", "mnist", "--data-dir", str(root), "-q"]) == 0

    if planted == ".":
        assert [p.name for p in victim.iterdir()] == ["kept"] and (victim / "kept").read_bytes() == VICTIM
    else:
        assert victim.read_bytes() == VICTIM
    data = load_dataset("mnist", str(root), cache_dir=str(tmp_path / "cache"))
    np.testing.assert_array_equal(data.stored, np.concatenate([x_train, x_test]))


def test_cifar_archives_are_unpickled_only_after_their_md5_matches(tmp_path, monkeypatch, capsys):
    """CIFAR's archives are pickles: a substituted archive (here one whose batch would run code)
    fails its published MD5 and is deleted unread; the converter never sees it."""
    marker = tmp_path / "payload-ran"

    class Payload:
        def __reduce__(self):
            return exec, (f"open({str(marker)!r}, 'w').write('ran')",)

    files, _ = _cifar10_fixture()
    evil = _tar_gz({f"cifar-10-batches-py/{name}": pickle.dumps(Payload())
                    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]})
    _serve(monkeypatch, "cifar10", {"cifar-10-python.tar.gz": evil}, published=files)
    converted = []
    source = sources.SOURCES["cifar10"]
    monkeypatch.setitem(sources.SOURCES, "cifar10", dataclasses.replace(
        source, convert=lambda *args: converted.append(args) or source.convert(*args)))
    assert main(["data", "fetch", "cifar10", "--data-dir", str(tmp_path / "data"), "-q"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "checksum mismatch for cifar-10-python.tar.gz" in err
    assert converted == [] and not marker.exists()
    assert _visible_files(tmp_path / "data") == []
