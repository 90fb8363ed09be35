"""`pfedkit data export RUN_DIR_OR_CONFIG --out DIR`: pfedkit's partition of a run as a Hugging
Face `datasets.DatasetDict` written with `save_to_disk`, so other tools (flwr-datasets, plain
`datasets`) train on exactly the clients pfedkit made. This module writes a dataset and its
per-client rows; which run or config they come from is `pfedkit.federation.export_partition`.

Layout (docs/data.md): one split per client, `client_0` ... `client_<N-1>`, each with the columns
- `image`: the stored uint8 pixels as an `Image` feature (lossless PNG; grayscale or RGB), or, for
  non-image datasets, `features` (float32 vectors, digits) or `input_ids` (int64 tokens, text);
- `label`: a `ClassLabel` (the dataset's class names where it has them, else "0", "1", ...);
- `test`: False for the client's training rows, True for its test rows (one split per client with
  a flag, rather than `client_i_test` splits, so `load_from_disk(DIR)["client_3"]` is the whole
  client and `.filter(lambda r: not r["test"])` its training data);
- `index`: the row in pfedkit's dataset (the numbers in the run's partition.npz), so the export
  can be checked against the run;
- `client`: the client id again, so the concatenated splits suit flwr-datasets'
  `NaturalIdPartitioner(partition_by="client")`.
Rows come in the partition's order: training rows, then test rows. `pfedkit_export.json` beside
the splits records the dataset, the config and the row counts. The folder is written under a
temporary name and renamed when complete.
"""
from __future__ import annotations

import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from pfedkit.atomic import atomic_write_text
from pfedkit.data.hf import require_datasets
from pfedkit.data.store import Dataset

MANIFEST = "pfedkit_export.json"


def write_export(out: Path, dataset: Dataset, train_index: list[np.ndarray], test_index: list[np.ndarray],
                 dataset_name: str, config: dict[str, Any]) -> Path:
    """Write the clients' rows to the folder `out` (absent or empty): under a temporary name,
    renamed when complete. `dataset_name` and `config` (the run's, as a dict) go to the manifest."""
    dataset_dict = to_dataset_dict(dataset, train_index, test_index)
    staging = out.parent / f".{out.name}.partial"
    shutil.rmtree(staging, ignore_errors=True)  # left by an interrupted export
    with quiet_progress():
        dataset_dict.save_to_disk(str(staging))
    manifest = {
        "dataset": dataset_name, "num_clients": len(train_index), "splits": list(dataset_dict),
        "columns": list(dataset_dict["client_0"].column_names),
        "train_rows": [int(len(t)) for t in train_index], "test_rows": [int(len(t)) for t in test_index],
        "class_names": _class_names(dataset), "config": config,
    }
    atomic_write_text(staging / MANIFEST, json.dumps(manifest, indent=1) + "\n")
    if out.exists():
        out.rmdir()  # empty (checked by the caller)
    os.replace(staging, out)
    return out


@contextmanager
def quiet_progress():
    """datasets' per-shard progress bars off (one line of output per export), restored after."""
    datasets = require_datasets()
    was_disabled = datasets.is_progress_bar_enabled() is False
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if not was_disabled:
            datasets.enable_progress_bars()


def _class_names(dataset: Dataset) -> list[str]:
    names = list(getattr(dataset, "class_names", ()) or ())
    return names if len(names) == dataset.num_classes else [str(c) for c in range(dataset.num_classes)]


def data_column(dataset: Dataset) -> tuple[str, Any]:
    """The column name and `datasets` feature of the dataset's rows as stored."""
    datasets = require_datasets()
    stored = dataset.stored
    if stored.ndim >= 3:
        return "image", datasets.Image()
    if np.issubdtype(stored.dtype, np.integer):
        return "input_ids", datasets.Sequence(datasets.Value("int64"), length=stored.shape[1])
    return "features", datasets.Sequence(datasets.Value("float32"), length=stored.shape[1])


def to_dataset_dict(dataset: Dataset, train_index: list[np.ndarray], test_index: list[np.ndarray]):
    """A DatasetDict with one split per client (see the module docstring for the columns)."""
    datasets = require_datasets()
    column, feature = data_column(dataset)
    features = datasets.Features({
        column: feature,
        "label": datasets.ClassLabel(names=_class_names(dataset)),
        "test": datasets.Value("bool"),
        "index": datasets.Value("int64"),
        "client": datasets.Value("int64"),
    })
    splits = {}
    for cid, (train, test) in enumerate(zip(train_index, test_index)):
        rows = np.concatenate([np.asarray(train, np.int64), np.asarray(test, np.int64)])
        values = dataset.stored[rows]
        splits[f"client_{cid}"] = datasets.Dataset.from_dict({
            column: list(values) if column == "image" else values.tolist(),
            "label": dataset.y[rows].astype(np.int64),
            "test": np.concatenate([np.zeros(len(train), bool), np.ones(len(test), bool)]),
            "index": rows,
            "client": np.full(len(rows), cid, np.int64),
        }, features=features)
    return datasets.DatasetDict(splits)
