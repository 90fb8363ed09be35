"""Per-client class statistics of a partition, as a table (the numbers only: its heatmap is drawn
by pfedkit/report/data_plots.py, since data/ sits below report/ and draws nothing)."""
from __future__ import annotations

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


def class_counts(table: pd.DataFrame) -> np.ndarray:
    """[clients, classes] training counts of a `client_class_table` (its c0, c1, ... columns)."""
    return table[[c for c in table.columns if c.startswith("c")]].to_numpy()
