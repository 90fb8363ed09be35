"""FedReMa's figures: relevance S of the first, a middle and the last CCP round, the average
maximum gap (eq. 8) with the round CCP ended, and the last dependency map G."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from pfedkit.report.plots import heatmap, heatmaps_side_by_side, lines


def draw(diagnostics: dict[str, dict[int, Any]], out_dir: Path) -> list[Path]:
    written: list[Path] = []
    gaps = diagnostics.get("mean_max_gap", {})
    ccp_end = next(iter(diagnostics.get("ccp_end", {}).values()), None)
    ccp_rounds = sorted(rnd for rnd, active in diagnostics.get("ccp_active", {}).items() if active)
    relevance = diagnostics.get("relevance", {})
    picks = [ccp_rounds[0], ccp_rounds[len(ccp_rounds) // 2], ccp_rounds[-1]] if ccp_rounds else []
    shown = sorted({rnd for rnd in picks if rnd in relevance})
    if shown:
        written.append(heatmaps_side_by_side(
            [relevance[rnd] for rnd in shown], [f"round {rnd}" for rnd in shown],
            out_dir / "fedrema_relevance.png", "FedReMa relevance S (first, middle, last CCP round)",
            "participant", "participant"))
    if gaps:
        rounds = sorted(gaps)
        marks = {f"CCP ends (round {ccp_end})": ccp_end} if ccp_end is not None else None
        written.append(lines(rounds, {"mean max gap Δs̄": [gaps[r] for r in rounds]},
                             out_dir / "fedrema_max_gap.png", "FedReMa average maximum gap (eq. 8)",
                             "round", "Δs̄", vlines=marks))
    maps = diagnostics.get("dependency_map", {})
    if maps:
        last = max(maps)
        written.append(heatmap(maps[last], out_dir / "fedrema_dependency_map.png",
                               f"FedReMa dependency map G (after round {last})", "peer j", "client i",
                               colorbar="times selected"))
    return written
