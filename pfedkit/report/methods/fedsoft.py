"""FedSoft's figures: the argmax cluster per round and the last client-to-cluster weights
(`shared.clusters`)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from pfedkit.report.methods.shared import clusters


def draw(diagnostics: dict[str, dict[int, Any]], out_dir: Path) -> list[Path]:
    return clusters(diagnostics, out_dir, "fedsoft")
