"""FedDistill's figures: softmax(z̄_c) per class (rows) after the first and the last round."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from pfedkit.report.plots import heatmaps_side_by_side


def draw(diagnostics: dict[str, dict[int, Any]], out_dir: Path) -> list[Path]:
    per_round = diagnostics.get("global_logits", {})
    if not per_round:
        return []
    first, last = min(per_round), max(per_round)
    probabilities = [torch.softmax(torch.as_tensor(per_round[r], dtype=torch.float64), dim=1).numpy()
                     for r in (first, last)]  # rows without a vector stay NaN
    return [heatmaps_side_by_side([np.nan_to_num(p) for p in probabilities],
                                  [f"round {first}", f"round {last}"],
                                  out_dir / "feddistill_global_soft_labels.png",
                                  "softmax of the global mean logits (0: no vector)", "predicted class",
                                  "label")]
