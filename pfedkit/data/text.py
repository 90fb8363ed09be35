"""Text classification sets as token ids: AG News (cwFedAvg's Table 6), tokenised once by
`pfedkit data fetch ag_news` (the source, its CSVs and their MD5s: data/sources.py; download, checks
and writing: data/fetch.py), which writes `<data dir>/<name>/<name>.npz.xz` with arrays
- `x`: uint16 token ids (N, MAX_LENGTH), padded with 0 (`<pad>`) after the text, cut at MAX_LENGTH;
- `y`: uint8 class ids (the CSV's 1-based class index minus one);
- `test`: bool, True for the rows of test.csv (the official test split; train.csv rows first);
- `vocab`: the tokens by id (`vocab[0] = "<pad>"`, `vocab[1] = "<unk>"`);
- `class_names`.
Its SHA-256 goes to SHA256SUMS like the image sets'.

Tokenisation (deterministic, no library): a row's text is `title + " " + description`,
lower-cased; `#39;` becomes an apostrophe, backslashes (the CSVs' escaped line breaks) and other
HTML entities (`&quot;`, `#36;`) become spaces; tokens are maximal runs of letters and digits,
with internal apostrophes kept (`wall street's` -> `wall`, `street's`). The vocabulary is built
from the training split only: tokens seen at least MIN_COUNT times, most frequent first (ties
alphabetical), at most MAX_VOCAB ids in all (the two special ids included); anything else is
`<unk>`. These are our choices: the paper gives none (PFLlib, whose settings it follows, pads to
200 tokens too).

Loaded, the ids are int32 arrays (N, MAX_LENGTH): `Dataset.rows` passes non-image rows through
unchanged, so clients hold integer token tensors and the `fasttext` model embeds them.
"""
from __future__ import annotations

import csv
import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from pfedkit.data.store import DataError, Dataset, DatasetInfo, NamedArrays, read_dataset_file

PAD, UNK = "<pad>", "<unk>"
MAX_LENGTH = 200      # tokens per row (PFLlib's max_len for AG News)
MIN_COUNT = 2         # a word must appear this often in the training split to get its own id
MAX_VOCAB = 50_000    # ids in all, specials included (the fasttext model's default vocab_size)
XZ_PRESET = 1         # the files are mostly padding zeros: preset 1 is 10x faster than 6 for ~ the same size

_APOSTROPHE = re.compile(r"&#39;|#39;|&apos;")  # the CSVs' escaped apostrophes: `street#39;s` -> `street's`
_ENTITY = re.compile(r"&[a-z]+;|&?#\d+;|\\")
_TOKEN = re.compile(r"[a-z0-9]+(?:'[a-z0-9]+)*")


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


def convert_csv_pair(files: dict[str, Path], progress: bool = False, *,
                     class_names: tuple[str, ...]) -> NamedArrays:
    """A `Source.convert` (data/sources.py) for AG News style CSVs: `train.csv` (official training
    split, first) and `test.csv`, tokenised; the vocabulary from the training split."""
    train_docs, train_y = read_csv(files["train.csv"], len(class_names))
    test_docs, test_y = read_csv(files["test.csv"], len(class_names))
    vocab = build_vocab(train_docs)
    return {"x": np.concatenate([encode(train_docs, vocab), encode(test_docs, vocab)]),
            "y": np.concatenate([train_y, test_y]),
            "test": np.concatenate([np.zeros(len(train_y), bool), np.ones(len(test_y), bool)]),
            "vocab": np.array(vocab, dtype=str),
            "class_names": np.array(class_names, dtype=str)}


# --- load --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TextDataset(Dataset):
    """Token ids (int32, (N, MAX_LENGTH)) with the vocabulary and class names kept."""
    vocab: tuple[str, ...] = ()
    class_names: tuple[str, ...] = ()


def load_text_dataset(info: DatasetInfo, root: Path, cache_dir: str | None = None) -> TextDataset:
    """`root/<info.name>/<info.name>.npz.xz` (checked against SHA256SUMS), decoded once into the cache."""
    arrays = read_dataset_file(root, info.name, cache_dir, lambda file, source: read_checked(file, info, source))
    return TextDataset(name=info.name, stored=arrays["x"].astype(np.int32), y=arrays["y"].astype(np.int64),
                       official_test=arrays["test"].astype(bool), num_classes=len(arrays["class_names"]),
                       vocab=tuple(str(t) for t in arrays["vocab"]),
                       class_names=tuple(str(c) for c in arrays["class_names"]))


REQUIRED = ("x", "y", "test", "vocab", "class_names")


def read_checked(file: Path | BinaryIO, info: DatasetInfo, source: Path) -> NamedArrays:
    """The arrays of a decoded .npz (a path or bytes), checked: one label and test flag per row,
    labels within the classes, ids within the vocabulary. `info` is not needed (the file names its
    classes); it is there so that every format's check has the same signature."""
    try:
        with np.load(file, allow_pickle=False) as saved:
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
