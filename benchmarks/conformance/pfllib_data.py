"""One pfedkit partition in PFLlib's data format: the same clients, rows, labels and pixels.

PFLlib (TsingZ0/PFLlib, `system/utils/data_utils.py`) reads client i's data from
`dataset/<NAME>/train/<i>.npz` and `dataset/<NAME>/test/<i>.npz` (relative to its `system/`
folder: `../dataset`), each file holding one pickled dict, `np.load(f, allow_pickle=True)["data"]`,
with `x` (float32, (n, C, H, W) for images) and `y` (int64 labels). Its loader turns `x` into
tensors as they are: the normalisation is whatever the file holds. We write pfedkit's own rows,
`Dataset.rows(indices)`: uint8 pixels scaled to [-1, 1] by (p / 255 - 0.5) / 0.5, which is also what
PFLlib's own generators write (ToTensor + Normalize(0.5, 0.5)), so neither side changes its inputs.

Rows keep the partition's order (pfedkit's index arrays); `pfedkit_export.json` beside the folders
records the pfedkit config, the seed, the row counts and each client's index arrays are in
`indices.npz`, so the export can be checked against the run that drew it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MANIFEST = "pfedkit_export.json"
INDICES = "indices.npz"
NORMALISATION = "uint8 pixels p -> (p / 255 - 0.5) / 0.5, in [-1, 1] (pfedkit Dataset.rows; PFLlib Normalize(0.5, 0.5))"


@dataclass(frozen=True)
class ClientRows:
    """One client's train and test inputs and labels, as written for PFLlib."""
    train_x: np.ndarray
    train_y: np.ndarray
    test_x: np.ndarray
    test_y: np.ndarray


def client_rows(dataset, train_index: np.ndarray, test_index: np.ndarray) -> ClientRows:
    """pfedkit's normalised rows and int64 labels of one client."""
    return ClientRows(train_x=dataset.rows(train_index), train_y=dataset.y[train_index].astype(np.int64),
                      test_x=dataset.rows(test_index), test_y=dataset.y[test_index].astype(np.int64))


def write_pfllib_npz(path: Path, x: np.ndarray, y: np.ndarray) -> None:
    """One PFLlib client file: `np.savez(path, data={"x": float32, "y": int64})`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as handle:
        np.savez(handle, data={"x": np.ascontiguousarray(x, dtype=np.float32), "y": np.asarray(y, dtype=np.int64)})


def read_pfllib_npz(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """(x, y) of one client file, read as PFLlib reads it (`np.load(..., allow_pickle=True)["data"].tolist()`).
    Only for files this module wrote: unpickling runs code from the file."""
    with open(path, "rb") as handle:
        data = np.load(handle, allow_pickle=True)["data"].tolist()
    return data["x"], data["y"]


def export_to_pfllib(dataset_dir: Path, dataset, train_index: list[np.ndarray], test_index: list[np.ndarray],
                     config: dict) -> Path:
    """Write every client's rows to `dataset_dir/train/<i>.npz` and `test/<i>.npz`, the index arrays
    to `indices.npz` and the manifest. `dataset_dir` must be absent or empty."""
    dataset_dir = Path(dataset_dir)
    if dataset_dir.exists() and any(dataset_dir.iterdir()):
        raise SystemExit(f"{dataset_dir}: exists and is not empty; export into a new folder")
    for cid, (train, test) in enumerate(zip(train_index, test_index)):
        rows = client_rows(dataset, train, test)
        write_pfllib_npz(dataset_dir / "train" / f"{cid}.npz", rows.train_x, rows.train_y)
        write_pfllib_npz(dataset_dir / "test" / f"{cid}.npz", rows.test_x, rows.test_y)
    arrays = {f"train_{c}": t for c, t in enumerate(train_index)} | {f"test_{c}": t for c, t in enumerate(test_index)}
    np.savez(dataset_dir / INDICES, **arrays)
    manifest = {"dataset": dataset.name, "num_clients": len(train_index), "num_classes": int(dataset.num_classes),
                "normalisation": NORMALISATION, "train_rows": [int(len(t)) for t in train_index],
                "test_rows": [int(len(t)) for t in test_index], "config": config}
    (dataset_dir / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return dataset_dir


def read_back(dataset_dir: Path, num_clients: int) -> list[ClientRows]:
    """Every client's rows as PFLlib would load them from `dataset_dir`."""
    clients = []
    for cid in range(num_clients):
        train_x, train_y = read_pfllib_npz(Path(dataset_dir) / "train" / f"{cid}.npz")
        test_x, test_y = read_pfllib_npz(Path(dataset_dir) / "test" / f"{cid}.npz")
        clients.append(ClientRows(train_x, train_y, test_x, test_y))
    return clients
