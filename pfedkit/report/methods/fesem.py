"""FeSEM's figures: each client's cluster per round (`shared.clusters`)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from pfedkit.report.methods.shared import clusters


def draw(diagnostics: dict[str, dict[int, Any]], out_dir: Path) -> list[Path]:
    return clusters(diagnostics, out_dir, "fesem")
