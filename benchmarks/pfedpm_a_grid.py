"""pFedPM's mixing weight a chosen the paper's way: a grid search, here on a validation split.

    python benchmarks/pfedpm_a_grid.py DATA_DIR [--table 1-mnist] [--grid 0.2,0.4,0.6,0.8]
                                       [--columns "n=3,n=4"] [--out runs/pfedpm-a-grid]

pFedPM §IV: "For the vital hyperparameter [a] we adjust the optimal from a limited set of
candidates by grid search" (its Figure 3 does this on FEMNIST; the candidates are not listed, so
the grid is ours). For each column of the table (average ways n) this runs the table's pFedPM
cell at the `regime` budget (the paper's per-round setting) once per candidate a, with
`validation_fraction=0.2`: each client's training split gives 20 % to a validation split that
replaces the test split, so no test sample is read (docs/tuning.md). The score is the table's own
metric (`final_acc_unweighted`) on validation. A finished run is reused and a killed one resumed,
so the same command continues. Prints the grid and each column's best a (ties: the smaller a)
and writes both to OUT/grid.md.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

from pfedkit.atomic import atomic_write_text
from pfedkit.experiments.comparison import Entry, run_comparison
from pfedkit.experiments.paper_presets import load_paper
from pfedkit.experiments.reproduce import plan_table

VALIDATION_FRACTION = 0.2


def grid_entries(table_id: str, grid: list[float], columns: list[str] | None, data_dir: str) -> list[Entry]:
    """The table's pFedPM cells at the regime budget, one entry per (column, a), on validation."""
    paper = load_paper("pfedpm")
    table = paper.table(table_id)
    plan = plan_table(paper, table, "regime", [f"data_dir={data_dir}"])
    cells = [entry for entry in plan.entries if entry.label == "pFedPM"
             and (columns is None or entry.group in columns)]
    if not cells:
        raise SystemExit(f"table {table_id} has no pFedPM cell in columns {columns}")
    return [Entry(f"a={a:g}", {**cell.config, "validation_fraction": VALIDATION_FRACTION,
                               "pfedpm": {**cell.config.get("pfedpm", {}), "a": a}}, group=cell.group)
            for cell in cells for a in grid]


def grid_table(records) -> pd.DataFrame:
    """Validation accuracy (%) with one row per a and one column per table column."""
    rows = [{"a": float(record.entry.label.removeprefix("a=")), "column": record.entry.group,
             "validation": 100 * record.summary["final_acc_unweighted"]} for record in records if record.summary]
    return pd.DataFrame(rows).pivot(index="a", columns="column", values="validation").sort_index()


def grid_markdown(table: pd.DataFrame) -> str:
    """The grid as a Markdown table (rows a, columns the table's columns, values to 2 decimals);
    written here rather than with pandas' to_markdown, which needs the optional `tabulate`."""
    lines = ["| a | " + " | ".join(table.columns) + " |", "|---" * (len(table.columns) + 1) + "|"]
    for a, row in table.iterrows():
        lines.append(f"| {a:g} | " + " | ".join("-" if pd.isna(v) else f"{v:.2f}" for v in row) + " |")
    return "\n".join(lines)


def best_a(table: pd.DataFrame) -> dict[str, float]:
    """Each column's best a; idxmax keeps the first maximum, i.e. the smaller a on a tie."""
    return {column: float(table[column].idxmax()) for column in table.columns if table[column].notna().any()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("data_dir")
    parser.add_argument("--table", default="1-mnist")
    parser.add_argument("--grid", default="0.2,0.4,0.6,0.8")
    parser.add_argument("--columns", help="comma-separated column names (default: all)")
    parser.add_argument("--out", default="runs/pfedpm-a-grid")
    args = parser.parse_args()
    grid = [float(value) for value in args.grid.split(",")]
    if any(not 0.0 <= a <= 1.0 for a in grid):
        raise SystemExit(f"--grid: a mixes local and global prototypes and lies in [0, 1], got {grid}")
    columns = args.columns.split(",") if args.columns else None
    out = Path(args.out) / args.table
    records = run_comparison(out, grid_entries(args.table, grid, columns, args.data_dir), [0], quiet=False)
    table = grid_table(records)
    text = (f"pFedPM {args.table}, regime budget, validation_fraction {VALIDATION_FRACTION}: "
            f"final_acc_unweighted on validation (%)\n\n{grid_markdown(table)}\n\n"
            + "\n".join(f"- {column}: best a = {a:g}" for column, a in best_a(table).items()) + "\n")
    atomic_write_text(out / "grid.md", text)
    print(text)


if __name__ == "__main__":
    main()
