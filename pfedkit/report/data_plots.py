"""Figures of a partition's data (`pfedkit data stats`): the numbers come from
pfedkit.data.stats, the drawing lives here so that data/ imports nothing from report/."""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from pfedkit.data.stats import class_counts
from pfedkit.report.plots import heatmap


def client_class_heatmap(table: pd.DataFrame, path: str | Path, title: str) -> Path:
    """Client x class heatmap of the training counts of a `client_class_table`."""
    return heatmap(class_counts(table), path, title, xlabel="class", ylabel="client", colorbar="training samples")
