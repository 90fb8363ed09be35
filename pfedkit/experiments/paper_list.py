"""`pfedkit reproduce --list` and `reproduce PAPER --list`: the papers' tables, their rows and
budgets, and whether each table's data is in the data directory.

Apart from reproduce.py so that listing reads the paper files and the dataset table only: no
torch, pandas or algorithm is imported (tests/test_startup.py). reproduce.py re-exports these.
"""
from __future__ import annotations

import textwrap

from pfedkit.config import deep_merge
from pfedkit.experiments.paper_presets import PAPERS, Paper, Table, load_paper


def table_datasets(paper: Paper, table: Table) -> list[str]:
    """The datasets the table's cells use (the paper's base, the table's, its columns' and rows')."""
    found = []
    for column in table.columns:
        for row in table.rows:
            config = paper.base
            for layer in (table.config, column.config, row.config):
                config = deep_merge(config, layer)
            name = config.get("dataset", "digits")
            if name not in found:
                found.append(name)
    return found


def data_status(paper: Paper, table: Table, data_dir: str | None = None) -> str:
    """`data: cifar100 present` or `data: cifar100 missing -> pfedkit data fetch cifar100`, per file
    the table reads (data_dir, else PFEDKIT_DATA; a subset such as cifar100_first20 reads cifar100).
    Without any data directory, the fetch commands name one (--data-dir DIR) and the line says how
    to point the table at it."""
    from pfedkit.data.datasets import DATASETS, data_present, resolve_data_dir

    files = []
    for name in table_datasets(paper, table):
        info = DATASETS.get(name)
        if info is not None and not info.embedded and info.file_name not in files:
            files.append(info.file_name)
    if not files:
        return "data: embedded"
    nowhere = resolve_data_dir(data_dir) is None
    fetch = " --data-dir DIR" if nowhere else ""
    parts = [f"{name} present" if data_present(name, data_dir) else f"{name} missing -> pfedkit data fetch {name}{fetch}"
             for name in files]
    where = " (no data directory: pass data_dir=DIR or set PFEDKIT_DATA=DIR)" if nowhere else ""
    return "data: " + "; ".join(parts) + where


def list_paper(paper: Paper, data_dir: str | None = None) -> str:
    """`reproduce PAPER --list`: tables with their source, columns, rows, seeds, budgets and whether
    their data is present (in data_dir, else PFEDKIT_DATA)."""
    lines = [f"{paper.paper}: {paper.title}", f"protocol: {paper.protocol}"]
    for table in paper.tables:
        missing = [row.method for row in table.rows if row.algorithm is None]
        lines.append(f"  --table {table.id}: {table.source}; {table.caption}")
        lines.append(f"      {data_status(paper, table, data_dir)}")
        lines.append(f"      columns: {'; '.join(f'{i} = {c.name}' for i, c in enumerate(table.columns, 1))}; "
                     f"metric {table.metric}; "
                     f"paper seeds {table.seeds}")
        lines.append(f"      rows: {', '.join(row.method for row in table.rows)}"
                     + (f" (not implemented: {', '.join(missing)})" if missing else ""))
        for budget_name in [b for b in paper.budget_names(table) if b != "paper"]:
            budget = paper.budget(table, budget_name)
            lines.append(f"      {budget_name}: {budget.seeds or table.seeds} seed(s); {budget.reduced or '-'}")
    for item in paper.unavailable:
        lines.append(f"  (not rebuilt) {item.id}: {item.source}: {item.reason}")
    return "\n".join(lines)


def list_papers() -> str:
    """`reproduce --list` without a paper: every paper with its tables, and those that cannot be
    rebuilt with the reason."""
    lines = []
    for name in PAPERS:
        paper = load_paper(name)
        lines.append(f"{paper.paper}: {paper.title}")
        lines += [f"  --table {table.id}: {textwrap.shorten(table.caption, 110, placeholder=' ...')}"
                  for table in paper.tables]
        lines += [f"  (not rebuilt) {item.id}: {item.reason}" for item in paper.unavailable]
    lines.append("details (rows, budgets): pfedkit reproduce PAPER --list")
    return "\n".join(lines)
