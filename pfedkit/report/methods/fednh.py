"""FedNH's figures: cosine similarity of the last recorded prototypes, 1 - cos(mu^t, mu^{t-1})
per class and round, and the logit scale s over rounds."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from pfedkit.report.plots import heatmap, lines


def draw(diagnostics: dict[str, dict[int, Any]], out_dir: Path) -> list[Path]:
    written = []
    recorded = diagnostics.get("prototypes", {})
    if recorded:
        last = max(recorded)
        mu = np.asarray(recorded[last], dtype=float)
        mu = mu / np.maximum(np.linalg.norm(mu, axis=1, keepdims=True), 1e-12)
        written.append(heatmap(mu @ mu.T, out_dir / "fednh_prototype_similarity.png",
                               f"cosine similarity of the prototypes after round {last}", "class", "class",
                               colorbar="cosine", vmin=-1, vmax=1))
    shifts = diagnostics.get("prototype_shift", {})
    if shifts:
        rounds = sorted(shifts)
        matrix = np.stack([np.asarray(shifts[r], dtype=float) for r in rounds]).T  # [C, T]
        written.append(heatmap(matrix, out_dir / "fednh_prototype_shift.png",
                               "1 - cos(mu_c after, mu_c before) per round", "round index (0 = first round)",
                               "class", colorbar="1 - cosine"))
    scales = diagnostics.get("scale", {})
    if scales:
        rounds = sorted(scales)
        written.append(lines(rounds, {"s": [scales[r] for r in rounds]}, out_dir / "fednh_scale.png",
                             "scale s of the cosine logits (server mean)", "round", "s"))
    return written
