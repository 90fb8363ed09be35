"""Text classification sets, tokenised once: `pfedkit data fetch ag_news` (cwFedAvg's Table 6).

`fetch_text` downloads the canonical CSV files (checked against their published MD5, through
`fetch._obtain`, so downloads resume and the tests replace `fetch.download`), tokenises them and
writes `<data dir>/<name>/<name>.npz.xz` with arrays
- `x`: uint16 token ids (N, MAX_LENGTH), padded with 0 (`<pad>`) after the text, cut at MAX_LENGTH;
- `y`: uint8 class ids (the CSV's 1-based class index minus one);
- `test`: bool, True for the rows of test.csv (the official test split; train.csv rows first);
- `vocab`: the tokens by id (`vocab[0] = "<pad>"`, `vocab[1] = "<unk>"`);
- `class_names`.
Its SHA-256 goes to SHA256SUMS like the image sets'.

Tokenisation (deterministic, no library): a row's text is `title + " " + description`,
lower-cased; `#39;` becomes an apostrophe, backslashes (the CSVs' escaped line breaks) and other
HTML entities (`&quot;`, `#36;`) become spaces; tokens are maximal runs of letters and digits, with internal apostrophes kept
(`wall street's` -> `wall`, `street's`). The vocabulary is built from the training split only:
tokens seen at least MIN_COUNT times, most frequent first (ties alphabetical), at most
MAX_VOCAB ids in all (the two special ids included); anything else is `<unk>`. These are our
choices: the paper gives none (PFLlib, whose settings it follows, pads to 200 tokens too).

Loaded, the ids are int32 arrays (N, MAX_LENGTH): `Dataset.rows` passes non-image rows through
unchanged, so clients hold integer token tensors and the `fasttext` model embeds them.
"""
from __future__ import annotations

import csv
import hashlib
import io
import lzma
import re
import shutil
import sys
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pfedkit.atomic import atomic_write_bytes, atomic_write_text
from pfedkit.data.datasets import (Dataset, DataError, _cache_root, _decode, _expected_checksum,
                                   resolve_data_dir)

PAD, UNK = "<pad>", "<unk>"
MAX_LENGTH = 200      # tokens per row (PFLlib's max_len for AG News)
MIN_COUNT = 2         # a word must appear this often in the training split to get its own id
MAX_VOCAB = 50_000    # ids in all, specials included (the fasttext model's default vocab_size)

_APOSTROPHE = re.compile(r"&#39;|#39;|&apos;")  # the CSVs' escaped apostrophes: `street#39;s` -> `street's`
_ENTITY = re.compile(r"&[a-z]+;|&?#\d+;|\\")
_TOKEN = re.compile(r"[a-z0-9]+(?:'[a-z0-9]+)*")


@dataclass(frozen=True)
class TextSource:
    files: tuple          # fetch.SourceFile: train.csv first, then test.csv
    class_names: tuple[str, ...]
    citation: str


def _sources() -> dict[str, TextSource]:
    from pfedkit.data.fetch import SourceFile

    base = "https://raw.githubusercontent.com/mhjabreel/CharCnn_Keras/master/data/ag_news_csv/"
    return {
        "ag_news": TextSource(
            (SourceFile("train.csv", (base + "train.csv",), "b1a00f826fdfbd249f79597b59e1dc12"),
             SourceFile("test.csv", (base + "test.csv",), "d52ea96a97a2d943681189a97654912d")),
            ("World", "Sports", "Business", "Sci/Tech"),
            "X. Zhang, J. Zhao, Y. LeCun, Character-level Convolutional Networks for Text Classification, "
            "NeurIPS 2015 (AG's news corpus; the CSVs torchtext used)"),
    }


TEXT_DATASETS = ("ag_news",)
TEXT_SOURCES: dict[str, TextSource] = {}  # filled on first use (fetch.py imports this module lazily)


def text_sources() -> dict[str, TextSource]:
    if not TEXT_SOURCES:
        TEXT_SOURCES.update(_sources())
    return TEXT_SOURCES


# --- tokenisation ------------------------------------------------------------------------------

def tokenize(text: str) -> list[str]:
    """Lower-cased word tokens of `text` (see the module docstring)."""
    return _TOKEN.findall(_ENTITY.sub(" ", _APOSTROPHE.sub("'", text.lower())))


def build_vocab(documents: Iterable[list[str]], min_count: int = MIN_COUNT, max_size: int = MAX_VOCAB) -> list[str]:
    """Tokens by id: `<pad>`, `<unk>`, then the words seen >= min_count times, most frequent
    first, ties in alphabetical order (so the ids do not depend on the order of the rows)."""
    counts = Counter(token for document in documents for token in document)
    words = sorted((w for w, c in counts.items() if c >= min_count), key=lambda w: (-counts[w], w))
    return [PAD, UNK] + words[:max(max_size - 2, 0)]


def encode(documents: list[list[str]], vocab: list[str], max_length: int = MAX_LENGTH) -> np.ndarray:
    """(N, max_length) ids: each document's first max_length tokens, unknown words as `<unk>`,
    padded with `<pad>` (0) after the text."""
    ids = {token: i for i, token in enumerate(vocab)}
    unk = ids[UNK]
    out = np.zeros((len(documents), max_length), dtype=np.uint16 if len(vocab) <= 1 << 16 else np.int32)
    for row, document in enumerate(documents):
        kept = [ids.get(token, unk) for token in document[:max_length]]
        out[row, :len(kept)] = kept
    return out


def read_csv(path: Path, num_classes: int) -> tuple[list[list[str]], np.ndarray]:
    """Tokenised `title description` and 0-based labels of an AG News style CSV (class index
    1..num_classes, title, description; no header)."""
    documents, labels = [], []
    with open(path, newline="", encoding="utf-8") as handle:
        for line, row in enumerate(csv.reader(handle), start=1):
            if len(row) < 2 or not row[0].strip().isdigit() or not 1 <= int(row[0]) <= num_classes:
                raise ValueError(f"{path.name} line {line}: expected class index 1..{num_classes}, title, description")
            labels.append(int(row[0]) - 1)
            documents.append(tokenize(" ".join(row[1:])))
    if not labels:
        raise ValueError(f"{path.name} has no rows")
    return documents, np.asarray(labels, dtype=np.uint8)


def convert(train_csv: Path, test_csv: Path, num_classes: int) -> dict[str, np.ndarray]:
    train_docs, train_y = read_csv(train_csv, num_classes)
    test_docs, test_y = read_csv(test_csv, num_classes)
    vocab = build_vocab(train_docs)
    return {"x": np.concatenate([encode(train_docs, vocab), encode(test_docs, vocab)]),
            "y": np.concatenate([train_y, test_y]),
            "test": np.concatenate([np.zeros(len(train_y), bool), np.ones(len(test_y), bool)]),
            "vocab": np.array(vocab, dtype=str)}


# --- fetch -------------------------------------------------------------------------------------

def fetch_text(name: str, data_dir: str | None = None, progress: bool = True) -> Path:
    """`pfedkit data fetch ag_news`: as `fetch.fetch` for the image sets (download resumable and
    MD5-checked, file written atomically after it reads back identically, SHA256SUMS updated)."""
    from pfedkit.data import fetch as fetch_module

    source = text_sources()[name]
    root = resolve_data_dir(data_dir)
    if root is None:
        raise DataError(f"data fetch {name}: no data directory; give --data-dir DIR "
                        "(or set the PFEDKIT_DATA environment variable)")
    target = fetch_module.dataset_path(root, name)
    if target.is_file():
        _say(f"{name}: already present at {target} (not downloaded)")
        return target
    downloads = root / ".downloads" / name
    downloads.mkdir(parents=True, exist_ok=True)
    files = {item.filename: fetch_module._obtain(item, downloads, progress) for item in source.files}
    if progress:
        _say(f"{name}: tokenising {', '.join(files)}")
    train_csv, test_csv = (files[item.filename] for item in source.files)
    try:
        arrays = convert(train_csv, test_csv, len(source.class_names))
    except (OSError, ValueError, UnicodeDecodeError, csv.Error) as err:
        for path in files.values():
            path.unlink(missing_ok=True)
        raise DataError(f"data fetch {name}: the downloaded CSV does not convert ({type(err).__name__}: {err}); "
                        "it was deleted, run the command again") from None
    arrays["class_names"] = np.array(source.class_names, dtype=str)
    payload = _encode(arrays)
    if not _same(_arrays_of(lzma.decompress(payload), target), arrays):
        raise DataError(f"data fetch {name}: the converted file does not read back identically; nothing written")
    digest = hashlib.sha256(payload).hexdigest()
    atomic_write_text(root / name / "SOURCE.txt", fetch_module._provenance(source, files))
    fetch_module._record_checksum(root, f"{name}/{name}.npz.xz", digest)
    atomic_write_bytes(target, payload)
    shutil.rmtree(downloads, ignore_errors=True)
    _say(f"{name}: {len(arrays['y'])} texts ({int(arrays['test'].sum())} official test), "
         f"{len(arrays['vocab'])} token ids, {MAX_LENGTH} per row -> {target}\nsha256 {digest}")
    return target


def _encode(arrays: dict[str, np.ndarray]) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return lzma.compress(buffer.getvalue(), preset=1)  # mostly padding zeros: preset 1 is 10x faster, ~same size


def _same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return set(a) == set(b) and all(np.array_equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)


# --- load --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TextDataset(Dataset):
    """Token ids (int32, (N, MAX_LENGTH)) with the vocabulary and class names kept."""
    vocab: tuple[str, ...] = ()
    class_names: tuple[str, ...] = ()


def load_text_dataset(name: str, data_dir: str | None = None, cache_dir: str | None = None) -> TextDataset:
    """`<data dir>/<name>/<name>.npz.xz` (checked against SHA256SUMS), decoded once into the cache."""
    root = resolve_data_dir(data_dir)
    if root is None:
        raise DataError(f"dataset {name!r} needs a data directory: set data_dir=PATH or the PFEDKIT_DATA "
                        f"environment variable (get it with `pfedkit data fetch {name} --data-dir DIR`)")
    source = (root / name / f"{name}.npz.xz").resolve()
    if not source.is_file():
        raise DataError(f"missing dataset file {source}: get it with `pfedkit data fetch {name} --data-dir {root}`")
    expected = _expected_checksum(root, f"{name}/{name}.npz.xz")
    stat = source.stat()
    cached = _cache_root(cache_dir).absolute() / f"{name}-{expected or f'{stat.st_size}-{stat.st_mtime_ns}'}.npz"
    if cached in _LOADED:
        return _LOADED[cached]
    arrays = None
    if cached.is_file():
        try:
            arrays = _arrays_of(cached.read_bytes(), source)
        except DataError:
            cached.unlink(missing_ok=True)
    if arrays is None:
        payload = _decode(source, expected)
        arrays = _arrays_of(payload, source)
        atomic_write_bytes(cached, payload)
    dataset = TextDataset(name=name, stored=arrays["x"].astype(np.int32), y=arrays["y"].astype(np.int64),
                          official_test=arrays["test"].astype(bool), num_classes=len(arrays["class_names"]),
                          vocab=tuple(str(t) for t in arrays["vocab"]),
                          class_names=tuple(str(c) for c in arrays["class_names"]))
    _LOADED.clear()
    _LOADED[cached] = dataset
    return dataset


_LOADED: dict[Path, TextDataset] = {}
REQUIRED = ("x", "y", "test", "vocab", "class_names")


def _arrays_of(payload: bytes, source: Path) -> dict[str, np.ndarray]:
    """The arrays of an .npz payload, checked: one label and test flag per row, labels within the
    classes, ids within the vocabulary."""
    try:
        with np.load(io.BytesIO(payload), allow_pickle=False) as saved:
            arrays = {key: saved[key] for key in saved.files}
    except (OSError, ValueError, EOFError) as err:
        raise DataError(f"dataset file {source} does not hold an .npz archive ({err}); fetch it again") from None
    missing = [key for key in REQUIRED if key not in arrays]
    if missing:
        raise DataError(f"dataset file {source} lacks arrays {missing}; expected {', '.join(REQUIRED)}")
    x, y, test = arrays["x"], arrays["y"], arrays["test"]
    if x.ndim != 2 or not (len(x) == len(y) == len(test)) or not np.issubdtype(x.dtype, np.integer):
        raise DataError(f"dataset file {source}: x {x.shape} {x.dtype}, y {y.shape}, test {test.shape}; expected "
                        "integer token ids (N, length) with one label and test flag per row")
    if len(y) and (int(y.max()) >= len(arrays["class_names"]) or int(x.max()) >= len(arrays["vocab"])):
        raise DataError(f"dataset file {source}: labels or token ids out of range; fetch it again")
    return arrays


def _say(text: str) -> None:
    print(text, file=sys.stderr)
