"""Markdown table of a `benchmarks/baselines.sh` sweep: one row per algorithm, one column block
per partition (best and last-5 sample-weighted accuracy, MB per round up+down, seconds per round).

Usage: python benchmarks/baselines_table.py OUT_DIR
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def load(out_dir: Path) -> dict[tuple[str, str], dict]:
    runs = {}
    for summary_file in sorted(out_dir.glob("*/summary.json")):
        part, algorithm = summary_file.parent.name.split("-", 1)
        runs[(part, algorithm)] = json.loads(summary_file.read_text())
    return runs


def cell(summary: dict | None) -> str:
    if summary is None:
        return "- | - | - | -"
    rounds = max(1, summary["rounds_done"])
    mb = (summary["bytes_up"] + summary["bytes_down"]) / rounds / 1e6
    return (f"{100 * summary['best_acc']:.2f} | {100 * summary['last5_acc']:.2f} | "
            f"{mb:.2f} | {summary['sec_per_round']:.1f}")


def table(runs: dict[tuple[str, str], dict]) -> str:
    parts = sorted({p for p, _ in runs})
    algorithms = sorted({a for _, a in runs}, key=lambda a: -max(runs.get((p, a), {}).get("best_acc", 0) for p in parts))
    header = "| algorithm | " + " | ".join(f"{p} best | {p} last-5 | {p} MB/round | {p} s/round" for p in parts) + " |"
    lines = [header, "|" + "---|" * (1 + 4 * len(parts))]
    for algorithm in algorithms:
        lines.append(f"| {algorithm} | " + " | ".join(cell(runs.get((p, algorithm))) for p in parts) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(load(Path(sys.argv[1] if len(sys.argv) > 1 else "runs/baselines"))))
