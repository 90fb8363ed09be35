"""Per-client class statistics of a partition: a table and a client x class heatmap."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd


def client_class_table(train_index: list[np.ndarray], test_index: list[np.ndarray], labels: np.ndarray,
                       num_classes: int) -> pd.DataFrame:
    """Rows = clients; columns = training count per class, then train/test totals."""
    counts = np.stack([np.bincount(labels[idx], minlength=num_classes) for idx in train_index])
    table = pd.DataFrame(counts, columns=[f"c{c}" for c in range(num_classes)])
    table.index.name = "client"
    table["train"] = [len(i) for i in train_index]
    table["test"] = [len(i) for i in test_index]
    return table


def write_heatmap(table: pd.DataFrame, path: str | Path, title: str) -> Path:
    from pfedkit.report.plots import heatmap

    counts = table[[c for c in table.columns if c.startswith("c")]].to_numpy()
    return heatmap(counts, path, title, xlabel="class", ylabel="client", colorbar="training samples")
