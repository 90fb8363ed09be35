"""pFedPM's (and R-pFedPM's, defined in the same algorithm module) figures: distance between
each client's local class features and the global ones (`shared.feature_distance`)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from pfedkit.report.methods.shared import feature_distance


def draw(diagnostics: dict[str, dict[int, Any]], out_dir: Path) -> list[Path]:
    return feature_distance(diagnostics, out_dir, "pfedpm_feature_distance", "feature")
