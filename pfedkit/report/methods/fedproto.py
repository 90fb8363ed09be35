"""FedProto's figures: distance between each client's uploaded prototypes and the new global
ones, per round (`shared.feature_distance`)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from pfedkit.report.methods.shared import feature_distance


def draw(diagnostics: dict[str, dict[int, Any]], out_dir: Path) -> list[Path]:
    return feature_distance(diagnostics, out_dir, "fedproto_prototype_distance", "prototype")
