"""`pfedkit report COMPARISON`: one HTML page for a comparison or reproduce directory.

The page, top to bottom: the headline table (mean ± std over seeds of the compact columns `pfedkit
compare` prints; the other columns of table.csv in a collapsed table below it; beside the paper when reproducing),
then per setting (a table column, or the whole comparison) the accuracy curves of every method
with the spread over seeds (min-max band around the seed mean) and over clients (10-90th
percentile band), then per method its curves over seeds and, collapsed, every seed's own figures.

Every run of the comparison also gets its own report (RUN/report/index.html, what `pfedkit report
RUN` writes); the page links each seed to it and shows that run's figures from there, so nothing
is drawn twice. Accuracies are in percent (0-100) in the tables and on every axis.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

from pfedkit.evaluation import round_table
from pfedkit.experiments.comparison import (MANIFEST, NEW_CLIENTS_NOTE, PERCENT_COLUMNS, SUMMARY_COLUMNS, TABLE_NOTE,
                                            format_cell, slug)
from pfedkit.report.html import Section, render
from pfedkit.report.plots import bands
from pfedkit.report.run_report import ACCURACY_AXIS, ACCURACY_NOTE, PERCENT, client_spread, read_run, report_run

# The columns `pfedkit compare` prints; the page shows the others collapsed, so the table fits.
HEADLINE_COLUMNS = ("best", "last5", "new_clients", "best_unweighted", "last5_unweighted", "worst_client", "MB_per_round",
                    "s_per_round")
PAPER_HEADLINE = ("column", "method", "metric", "ours", "seeds", "paper", "diff", "rank ours / paper", "order")


def is_comparison(path: Path) -> bool:
    return (Path(path) / MANIFEST).is_file()


def common_rounds(tables: list[pd.DataFrame]) -> pd.Index:
    rounds = tables[0].index
    for table in tables[1:]:
        rounds = rounds.intersection(table.index)
    return rounds


def seed_curves(run_dirs: list[Path]) -> tuple[pd.Index, np.ndarray, np.ndarray]:
    """Per round over the seeds' runs: weighted accuracy [seeds, rounds], and the client spread
    (mean, 10th, 90th percentile) averaged over seeds [3, rounds]; rounds common to all runs;
    in % (0-100)."""
    metrics = [read_run(d)[1] for d in run_dirs]
    tables = [round_table(m) for m in metrics]
    spreads = [client_spread(m) for m in metrics]
    rounds = common_rounds(tables)
    weighted = np.stack([t.loc[rounds, "acc_weighted"].to_numpy() for t in tables])
    clients = np.mean([s.loc[rounds, ["mean", "low", "high"]].to_numpy().T for s in spreads], axis=0)
    return rounds, PERCENT * weighted, PERCENT * clients


def mean_min_max(values: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return values.mean(0), values.min(0), values.max(0)


def group_figures(root: Path, group: str, entries: list[dict], out_dir: Path) -> list[Path]:
    seeds_series, client_series = {}, {}
    rounds = None
    for entry in entries:
        rounds, weighted, clients = seed_curves([root / path for path in entry["runs"].values()])
        seeds_series[entry["label"]] = mean_min_max(weighted)
        client_series[entry["label"]] = tuple(clients)
    name = slug(group or "all")
    title = group or "comparison"
    return [bands(rounds, seeds_series, out_dir / f"{name}_seeds.png",
                  f"{title}: sample-weighted accuracy, mean and min-max over seeds", "round", ACCURACY_AXIS),
            bands(rounds, client_series, out_dir / f"{name}_clients.png",
                  f"{title}: mean client accuracy, 10-90th percentile over clients (seed mean)", "round",
                  f"client {ACCURACY_AXIS}")]


def method_figure(root: Path, group: str, entry: dict, out_dir: Path) -> Path:
    """One method over all its seeds: sample-weighted, unweighted and worst-client accuracy, each
    the seed mean with its min-max band."""
    tables = [round_table(read_run(root / path)[1]) for path in entry["runs"].values()]
    rounds = common_rounds(tables)
    series = {name: mean_min_max(PERCENT * np.stack([t.loc[rounds, column].to_numpy() for t in tables]))
              for name, column in (("sample-weighted", "acc_weighted"), ("unweighted", "acc_mean"),
                                   ("worst client", "acc_worst"))}
    seeds = ", ".join(sorted(entry["runs"], key=int))
    label = f"{group}: {entry['label']}" if group else entry["label"]
    return bands(rounds, series, out_dir / f"{slug(group or 'all')}_{slug(entry['label'])}_seeds.png",
                 f"{label}: mean and min-max over seeds {seeds}", "round", ACCURACY_AXIS)


def method_sections(root: Path, group: str, entry: dict, out_dir: Path,
                    run_reports: dict[str, list[Path]]) -> tuple[list[Section], list[Path]]:
    """The method's curves over seeds, a link to each seed's run report, and each seed's figures
    (collapsed)."""
    figure = method_figure(root, group, entry, out_dir)
    seeds = sorted(entry["runs"], key=int)
    pages = [(f"seed {seed}: run report", run_reports[entry["runs"][seed]][-1]) for seed in seeds]
    sections = [Section(f"{group + ': ' if group else ''}{entry['label']}", images=[figure], links=pages, level=3)]
    for seed in seeds:
        run_dir = root / entry["runs"][seed]
        sections.append(Section(f"seed {seed}: figures of {run_dir.name}", images=run_reports[entry["runs"][seed]][:-1],
                                links=[("this run's report", run_reports[entry["runs"][seed]][-1])], collapsed=True))
    return sections, [figure]


def report_comparison(root: str | Path) -> list[Path]:
    """Write root/report/ (PNGs and index.html) and every finished run's own report; returns the
    files written, the comparison page last."""
    root = Path(root)
    manifest = json.loads((root / MANIFEST).read_text())
    out_dir = root / "report"
    groups: dict[str, list[dict]] = {}
    unfinished = []
    for entry in manifest["entries"]:
        missing = [p for p in entry["runs"].values() if not (root / p / "metrics.csv").is_file()]
        if missing:
            unfinished.append(entry["label"])
        else:
            groups.setdefault(entry["group"], []).append(entry)
    run_reports = {path: report_run(root / path) for entries in groups.values() for entry in entries
                   for path in entry["runs"].values()}
    written: list[Path] = [path for files in run_reports.values() for path in files]
    sections = [Section("About", describe(manifest, unfinished))]
    sections += tables_section(root)
    for group, entries in groups.items():
        figures = group_figures(root, group, entries, out_dir)
        written += figures
        sections.append(Section(f"Accuracy curves: {group}" if group else "Accuracy curves", ACCURACY_NOTE,
                                images=figures))
    for group, entries in groups.items():
        sections.append(Section(f"Per method: {group}" if group else "Per method",
                                "each method over its seeds; every seed's own figures in the collapsed blocks"))
        for entry in entries:
            entry_sections, figures = method_sections(root, group, entry, out_dir, run_reports)
            sections += entry_sections
            written += figures
    title = (f"{manifest['paper']} {manifest['table']} ({manifest['budget']} budget)"
             if manifest.get("kind") == "reproduce" else f"comparison {root.name}")
    return written + [render(title, sections, out_dir / "index.html")]


def describe(manifest: dict, unfinished: list[str] | None = None) -> str:
    seeds = ", ".join(str(s) for s in manifest["seeds"])
    waiting = f" Not finished yet (left out below): {', '.join(unfinished)}." if unfinished else ""
    if manifest.get("kind") == "reproduce":
        return (f"{manifest['source']}: {manifest['caption']}. Budget {manifest['budget']}: "
                f"{manifest.get('reduced') or 'no reduction'}. Seeds {seeds}.{waiting}")
    return f"{len(manifest['entries'])} configurations, seeds {seeds}.{waiting}"


def tables_section(root: Path) -> list[Section]:
    sections = []
    if (root / "paper.csv").is_file():
        paper = pd.read_csv(root / "paper.csv")
        sections.append(Section("Beside the paper", "accuracies in %; ours: mean ± std over seeds; diff = ours - "
                                "paper in points; order ≠: the method's rank differs from the paper's",
                                tables=[paper_cells(paper)]))
        sections.append(Section("Beside the paper: every column of paper.csv", tables=[paper], collapsed=True))
    if (root / "table.csv").is_file():
        # labels are text even when they read like numbers or "NA"; table.csv writes missing numbers as ""
        table = pd.read_csv(root / "table.csv", dtype={"group": str, "label": str}, keep_default_na=False,
                            na_values=[""])
        table["group"] = table["group"].fillna("")
        note = TABLE_NOTE + (NEW_CLIENTS_NOTE if "new_clients_mean" in table else "")
        sections.append(Section("Results (mean ± std over seeds)", note,
                                tables=[seed_cells(table, HEADLINE_COLUMNS)]))
        others = tuple(column for column in SUMMARY_COLUMNS if column not in HEADLINE_COLUMNS)
        sections.append(Section(f"More columns: {', '.join(others)} (mean ± std over seeds)",
                                tables=[seed_cells(table, others)], collapsed=True))
    return sections


def seed_cells(table: pd.DataFrame, columns: tuple[str, ...]) -> pd.DataFrame:
    """table.csv as text cells "mean ± std" (accuracies in %), one column per metric; the setting
    column only when the comparison has settings; metrics no run recorded are left out."""
    cells = pd.DataFrame()
    if table["group"].astype(str).str.len().any():
        cells["setting"] = table["group"]
    cells["method"] = table["label"]
    cells["seeds"] = table["seeds"]
    for column in columns:
        if f"{column}_mean" not in table or table[f"{column}_mean"].isna().all():
            continue
        cells[column] = [format_cell(mean, std, column in PERCENT_COLUMNS)
                         for mean, std in zip(table[f"{column}_mean"], table[f"{column}_std"])]
    return cells


def paper_cells(paper: pd.DataFrame) -> pd.DataFrame:
    """paper.csv in the compact form of paper.md: mean ± std cells, ranks as "ours / paper"."""
    def number(value: float, std: float = np.nan) -> str:
        if pd.isna(value):
            return "-"
        return f"{value:.2f}" + ("" if pd.isna(std) else f" ± {std:.2f}")

    cells = pd.DataFrame({
        "column": paper["column"], "method": paper["method"], "metric": paper["metric"],
        "ours": [number(m, s) if status == "ran" else status
                 for m, s, status in zip(paper["ours"], paper["ours_std"], paper["status"])],
        "seeds": paper["seeds"],
        "paper": [number(m, s) for m, s in zip(paper["paper"], paper["paper_std"])],
        "diff": [number(d) for d in paper["diff"]],
        "rank ours / paper": ["-" if pd.isna(o) else f"{int(o)} / {int(p)}"
                              for o, p in zip(paper["rank_ours"], paper["rank_paper"])],
        "order": ["≠" if flag is True or str(flag) == "True" else "" for flag in paper["order_differs"]]})
    return cells[[c for c in PAPER_HEADLINE if c in cells]]
