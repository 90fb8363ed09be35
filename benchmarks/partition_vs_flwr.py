"""pfedkit's Dirichlet and pathological partitions beside flwr-datasets' DirichletPartitioner and
PathologicalPartitioner, on the same labels: statistics of what each produces, not a claim that
they are the same procedure (they are not: see docs/data.md).

    python benchmarks/partition_vs_flwr.py [--clients 20] [--seeds 5] [--data-dir ../shared/datasets]

Labels: the official training split of MNIST from the data directory (default
../shared/datasets beside the repository, or $PFEDKIT_DATA) when it is there, else the embedded
digits. Prints one markdown table: per setting and library, the mean over seeds of classes per
client (mean, min, max; and the mean count of classes holding >= 5% of a client's rows) and client sizes (min, max, mean, std), and the empty clients.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pfedkit.data.datasets import DataError, load_dataset  # noqa: E402
from pfedkit.data.partition import partition  # noqa: E402


def training_labels(data_dir: str | None) -> tuple[str, np.ndarray]:
    """MNIST's official training labels, else digits' (all 1,797)."""
    try:
        mnist = load_dataset("mnist", data_dir)
        return "mnist (official train, 60,000)", mnist.y[~mnist.official_test]
    except DataError:
        return "digits (1,797)", load_dataset("digits").y


def pfedkit_parts(labels: np.ndarray, scheme: str, clients: int, seed: int, **params) -> list[np.ndarray]:
    return partition(labels, scheme, clients, seed, **params)


def flwr_parts(labels: np.ndarray, scheme: str, clients: int, seed: int, **params) -> list[np.ndarray]:
    """flwr-datasets' partitioner for `scheme` over a datasets.Dataset of the labels; the rows of
    each partition, recovered through an index column."""
    import datasets
    from flwr_datasets.partitioner import DirichletPartitioner, PathologicalPartitioner

    table = datasets.Dataset.from_dict({"label": labels.astype(np.int64), "row": np.arange(len(labels))})
    if scheme == "dirichlet":
        partitioner = DirichletPartitioner(num_partitions=clients, partition_by="label", alpha=params["alpha"],
                                           min_partition_size=params.get("min_partition_size", 10),
                                           self_balancing=params.get("self_balancing", False), seed=seed)
    else:
        partitioner = PathologicalPartitioner(num_partitions=clients, partition_by="label",
                                              num_classes_per_partition=params["classes_per_client"],
                                              class_assignment_mode="random", seed=seed)
    partitioner.dataset = table
    return [np.asarray(partitioner.load_partition(cid)["row"], dtype=np.int64) for cid in range(clients)]


def statistics(parts: list[np.ndarray], labels: np.ndarray) -> dict[str, float]:
    sizes = np.array([len(p) for p in parts])
    classes = np.array([len(np.unique(labels[p])) for p in parts])
    # classes holding at least 5% of the client's rows: Dirichlet gives many classes a handful of rows
    major = np.array([int((np.bincount(labels[p]) >= 0.05 * len(p)).sum()) if len(p) else 0 for p in parts])
    covered = np.concatenate(parts)
    assert len(np.unique(covered)) == len(covered), "a row in two clients"
    return {"cls_mean": classes.mean(), "cls_min": classes.min(), "cls_max": classes.max(), "major": major.mean(),
            "size_min": sizes.min(), "size_max": sizes.max(), "size_mean": sizes.mean(), "size_std": sizes.std(),
            "empty": int((sizes == 0).sum()), "used": len(covered) / len(labels)}


SETTINGS = [
    ("Dirichlet alpha=0.1", "dirichlet", {"alpha": 0.1}),
    ("Dirichlet alpha=0.5", "dirichlet", {"alpha": 0.5}),
    ("Dirichlet alpha=1.0", "dirichlet", {"alpha": 1.0}),
    ("pathological 2 classes", "pathological", {"classes_per_client": 2}),
    ("pathological 3 classes", "pathological", {"classes_per_client": 3}),
]


def libraries(scheme: str):
    """(name, partition function, extra parameters): pfedkit, flwr-datasets with its defaults, and
    for Dirichlet also flwr-datasets' self_balancing=True (a cap like the one pfedkit's rule has)."""
    rows = [("pfedkit", pfedkit_parts, {}), ("flwr-datasets", flwr_parts, {})]
    if scheme == "dirichlet":
        rows.append(("flwr-datasets self_balancing", flwr_parts, {"self_balancing": True}))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--data-dir", default=os.environ.get("PFEDKIT_DATA") or str(REPO.parent / "shared" / "datasets"))
    ns = parser.parse_args()
    source, labels = training_labels(ns.data_dir)
    print(f"labels: {source}; {ns.clients} clients; mean over seeds 0..{ns.seeds - 1}\n")
    header = ("| setting | library | classes/client mean | min | max | classes >= 5% | size min | size max | size mean "
              "| size std | empty clients | rows used |")
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for title, scheme, params in SETTINGS:
        for library, build, extra in libraries(scheme):
            rows = [statistics(build(labels, scheme, ns.clients, seed, **params, **extra), labels)
                    for seed in range(ns.seeds)]
            mean = {key: float(np.mean([r[key] for r in rows])) for key in rows[0]}
            print(f"| {title} | {library} | {mean['cls_mean']:.2f} | {mean['cls_min']:.1f} | {mean['cls_max']:.1f} "
                  f"| {mean['major']:.2f} | {mean['size_min']:.0f} | {mean['size_max']:.0f} | {mean['size_mean']:.0f} "
                  f"| {mean['size_std']:.0f} | {mean['empty']:.1f} | {100 * mean['used']:.1f}% |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
