"""One pfedkit partition in FL-bench's data format: the same clients, rows, labels and inputs.

FL-bench (KarhouTam/FL-bench, at the commit of docs/conformance.md) reads a dataset folder
`data/<name>/` of its own checkout:
- the samples, through torchvision's MNIST or CIFAR10 class: the train part then the test part,
  concatenated into one array (`data/utils/datasets.py`, classes MNIST and CIFAR10), each sample
  divided by 255 when the array's maximum exceeds 1 (`BaseDataset._rescale_data`) and normalised by
  `Normalize(DATA_MEAN[name], DATA_STD[name])` (`src/server/fedavg.py`, get_dataset_transforms);
- `partition.pkl`: {"separation": {"train", "val", "test": client lists, "total": N},
  "data_indices": one {"train", "val", "test": row numbers into that array} per client};
- `args.json`: the generator's arguments, merged into the run's `dataset` settings (the server reads
  `split`: "sample", each client holds train and test rows).

The export stores each of pfedkit's normalised rows x (`Dataset.rows`, in [-1, 1]) as
255 * (mean + std * x), which FL-bench's division by 255 and Normalize turn back into x (to float32
rounding: `max_input_error` measures it). The scratch folder's torchvision stub (flbench_run.py) serves
the stored array as torchvision's train part (its test part is empty), in torchvision's layout:
(n, H, W) for MNIST (FL-bench adds the channel), (n, H, W, C) for CIFAR-10 (FL-bench permutes).
Client after client, a client's train rows then its test rows, each in the partition's order.
"""
from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np

from pfllib_data import INDICES, MANIFEST, ClientRows, client_rows

SAMPLES = "pfedkit_samples.npy"   # what the torchvision stub serves as the train part's `data`
TARGETS = "pfedkit_targets.npy"   # ... and as its `targets`
PARTITION = "partition.pkl"
ARGS = "args.json"


def stored_samples(x: np.ndarray, mean: list[float], std: list[float]) -> np.ndarray:
    """pfedkit's rows x (n, C, H, W) as the samples FL-bench must read to compute x: 255 (mean + std x)
    per channel, in torchvision's layout ((n, H, W) for one channel, (n, H, W, C) for several)."""
    shape = (1, -1, 1, 1)
    samples = 255.0 * (np.reshape(mean, shape) + np.reshape(std, shape) * x.astype(np.float64))
    samples = samples[:, 0] if x.shape[1] == 1 else np.transpose(samples, (0, 2, 3, 1))
    return np.ascontiguousarray(samples, dtype=np.float32)


def flbench_inputs(samples: np.ndarray, mean: list[float], std: list[float]) -> np.ndarray:
    """What FL-bench feeds its model, computed as FL-bench does (float32 throughout): the channel
    layout of its dataset classes, x / 255 when the maximum exceeds 1, then (x - mean) / std."""
    import torch

    data = torch.tensor(samples, dtype=torch.float32)  # a copy: FL-bench divides in place
    data = data.unsqueeze(1) if data.dim() == 3 else data.permute([0, -1, 1, 2])
    if data.max() > 1.0:
        data /= 255.0
    mean_t = torch.as_tensor(mean, dtype=data.dtype).view(1, -1, 1, 1)
    std_t = torch.as_tensor(std, dtype=data.dtype).view(1, -1, 1, 1)
    return ((data - mean_t) / std_t).numpy()


def client_layout(train_rows: list[int], test_rows: list[int]) -> list[dict[str, np.ndarray]]:
    """FL-bench's data_indices: client c's train rows, then its test rows, after client c - 1's."""
    layout, start = [], 0
    for n_train, n_test in zip(train_rows, test_rows):
        layout.append({"train": np.arange(start, start + n_train, dtype=np.int64),
                       "val": np.array([], dtype=np.int64),
                       "test": np.arange(start + n_train, start + n_train + n_test, dtype=np.int64)})
        start += n_train + n_test
    return layout


def export_to_flbench(dataset_dir: Path, dataset, train_index: list[np.ndarray], test_index: list[np.ndarray],
                      config: dict, mean: list[float], std: list[float]) -> Path:
    """Write the samples, targets, partition.pkl, args.json, pfedkit's index arrays and the manifest
    into `dataset_dir` (absent or empty). `mean`, `std`: FL-bench's DATA_MEAN / DATA_STD of the dataset."""
    dataset_dir = Path(dataset_dir)
    if dataset_dir.exists() and any(dataset_dir.iterdir()):
        raise SystemExit(f"{dataset_dir}: exists and is not empty; export into a new folder")
    clients = [client_rows(dataset, train, test) for train, test in zip(train_index, test_index)]
    if clients and clients[0].train_x.ndim != 4:
        raise SystemExit(f"{dataset.name}: FL-bench's datasets are images (n, C, H, W); these rows are not")
    x = np.concatenate([part for c in clients for part in (c.train_x, c.test_x)])
    y = np.concatenate([part for c in clients for part in (c.train_y, c.test_y)])
    samples = stored_samples(x, mean, std)
    if samples.max() <= 1.0:  # FL-bench would skip its division by 255 and read other inputs
        raise SystemExit("the stored samples never exceed 1: FL-bench would not divide them by 255")
    dataset_dir.mkdir(parents=True, exist_ok=True)
    np.save(dataset_dir / SAMPLES, samples)
    np.save(dataset_dir / TARGETS, y.astype(np.int64))
    n = len(clients)
    partition = {"separation": {"train": list(range(n)), "val": list(range(n)), "test": list(range(n)), "total": n},
                 "data_indices": client_layout([len(t) for t in train_index], [len(t) for t in test_index])}
    with open(dataset_dir / PARTITION, "wb") as handle:
        pickle.dump(partition, handle)
    args = {"client_num": n, "split": "sample", "test_ratio": None, "val_ratio": 0.0, "seed": config.get("seed"),
            "IID_ratio": 0.0, "monitor_window_name_suffix": f"pfedkit-{dataset.name}-{n}clients"}
    (dataset_dir / ARGS).write_text(json.dumps(args, indent=1) + "\n")
    np.savez(dataset_dir / INDICES, **{f"train_{c}": t for c, t in enumerate(train_index)},
             **{f"test_{c}": t for c, t in enumerate(test_index)})
    manifest = {"dataset": dataset.name, "num_clients": n, "num_classes": int(dataset.num_classes),
                "normalisation": "pfedkit's rows x stored as 255 (mean + std x); FL-bench: / 255, Normalize(mean, std)",
                "mean": list(mean), "std": list(std), "train_rows": [int(len(t)) for t in train_index],
                "test_rows": [int(len(t)) for t in test_index], "config": config}
    (dataset_dir / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return dataset_dir


def read_back(dataset_dir: Path) -> list[ClientRows]:
    """Every client's inputs and labels as FL-bench computes them from `dataset_dir`."""
    dataset_dir = Path(dataset_dir)
    manifest = json.loads((dataset_dir / MANIFEST).read_text())
    inputs = flbench_inputs(np.load(dataset_dir / SAMPLES), manifest["mean"], manifest["std"])
    targets = np.load(dataset_dir / TARGETS)
    with open(dataset_dir / PARTITION, "rb") as handle:  # only files this module wrote
        indices = pickle.load(handle)["data_indices"]
    return [ClientRows(inputs[c["train"]], targets[c["train"]], inputs[c["test"]], targets[c["test"]])
            for c in indices]


def max_input_error(dataset_dir: Path, dataset, train_index: list[np.ndarray], test_index: list[np.ndarray]) -> float:
    """The largest |FL-bench's input - pfedkit's row| over every exported row."""
    worst = 0.0
    for back, train, test in zip(read_back(dataset_dir), train_index, test_index):
        ours = client_rows(dataset, train, test)
        worst = max(worst, float(np.abs(back.train_x - ours.train_x).max(initial=0.0)),
                    float(np.abs(back.test_x - ours.test_x).max(initial=0.0)))
    return worst
