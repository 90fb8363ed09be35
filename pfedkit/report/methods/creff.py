"""CReFF's figures: the server-side feature-matching and re-training losses per round."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from pfedkit.report.plots import lines


def draw(diagnostics: dict[str, dict[int, Any]], out_dir: Path) -> list[Path]:
    series = {label: diagnostics.get(key) or {} for key, label in
              (("matching_loss_start", "matching loss, before"), ("matching_loss", "matching loss, after"),
               ("retrain_loss", "re-trained classifier CE on F"))}
    series = {label: values for label, values in series.items() if values}
    if not series:
        return []
    rounds = sorted(next(iter(series.values())))
    return [lines(rounds, {label: [values.get(r, np.nan) for r in rounds] for label, values in series.items()},
                  Path(out_dir) / "creff_losses.png", "CReFF: server-side losses per round", "round", "loss")]
