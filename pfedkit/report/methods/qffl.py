"""q-FFL's figure: the participants' losses F_k at the received model per round (the quantity whose
spread q-FFL reduces): their mean, the worst and the best client."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from pfedkit.report.plots import lines


def draw(diagnostics: dict[str, dict[int, Any]], out_dir: Path) -> list[Path]:
    losses = diagnostics.get("qffl_loss") or {}
    rounds = [r for r in sorted(losses) if losses[r]]
    if not rounds:
        return []
    per_round = [np.asarray(list(losses[r].values()), dtype=float) for r in rounds]
    series = {"worst client": [v.max() for v in per_round], "mean": [v.mean() for v in per_round],
              "best client": [v.min() for v in per_round]}
    return [lines(rounds, series, Path(out_dir) / "qffl_losses.png",
                  "q-FFL: participants' loss F_k at the received model", "round", "training loss")]
