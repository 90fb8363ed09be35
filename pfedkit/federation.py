"""A run's data from its Config: the one place where config keys become the data layer's values.

pfedkit/data/ sits below config in the layering (docs/architecture.md) and reads no Config: it
takes a dataset name and folders, and a `SplitPlan` of plain partition settings. This module,
above config, builds them:
- `split_plan(config)`: the partition settings (`split_indices(split_plan(config), dataset)`,
  `build_federated(split_plan(config), dataset)`);
- `config_dataset(config)`: the dataset a config names, loaded;
- `resolve_partition` / `export_partition`: `pfedkit data export` of a run directory or a config.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from pfedkit.config import Config, load_config, split_config_and_overrides
from pfedkit.core.errors import ConfigError
from pfedkit.data.datasets import Dataset, load_dataset
from pfedkit.data.export import write_export
from pfedkit.data.federated import SplitPlan, split_indices
from pfedkit.data.hf import require_datasets
from pfedkit.run_files import read_partition


def split_plan(config: Config) -> SplitPlan:
    """The config's partition settings (`test_split: auto` resolved) as the data layer takes them."""
    part = config.partition
    return SplitPlan(scheme=part.scheme, scheme_params=part.scheme_params(), num_clients=config.num_clients,
                     seed=config.seed, test_split=part.resolved_test_split(), pool_fraction=part.pool_fraction,
                     train_ratio=part.train_ratio, stratified=part.stratified, test_fraction=part.test_fraction,
                     test_shots=part.test_shots, validation_fraction=config.validation_fraction)


def config_dataset(config: Config) -> Dataset:
    """The dataset `config.dataset` names, from `config.data_dir` (`hf:` ones read `config.data`)."""
    return load_dataset(config.dataset, config.data_dir, options=config.data)


def resolve_partition(items: list[str]) -> tuple[Config, Dataset, list[np.ndarray], list[np.ndarray]]:
    """The config, dataset and per-client (train, test) rows of a run directory (its config.yaml
    and partition.npz, no overrides allowed) or of a config file and/or key=value overrides (the
    partition is computed as `pfedkit run` would)."""
    source, overrides = split_config_and_overrides(items)
    first = Path(source) if source is not None else None
    if first is not None and first.is_dir():
        if overrides:
            raise ConfigError(f"data export {first}: a run directory takes no overrides (its config.yaml is used)")
        if not (first / "config.yaml").is_file() or not (first / "partition.npz").is_file():
            raise ConfigError(f"data export {first}: not a run directory (expected config.yaml and partition.npz); "
                              "give a run directory or a config file / key=value overrides")
        config = load_config(first / "config.yaml")
        dataset = config_dataset(config)
        train_index, test_index = read_partition(first / "partition.npz", config.num_clients, len(dataset.y),
                                                 "export a run directory pfedkit wrote, or give its config")
        return config, dataset, train_index, test_index
    config = load_config(source, overrides)
    dataset = config_dataset(config)
    train_index, test_index = split_indices(split_plan(config), dataset)
    return config, dataset, train_index, test_index


def export_partition(items: list[str], out: Path) -> Path:
    """`pfedkit data export`: write the partition `items` name (see `resolve_partition`) to the
    folder `out` as a DatasetDict, one split per client (pfedkit/data/export.py)."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out {out.absolute()}: exists and is not an empty folder; choose a new folder")
    require_datasets()  # before any work: one line naming the extra to install
    config, dataset, train_index, test_index = resolve_partition(items)
    return write_export(out, dataset, train_index, test_index, config.dataset, config.to_dict())
