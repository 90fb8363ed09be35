"""`pfedkit report COMPARISON`: one HTML page for a comparison or reproduce directory.

Per setting (a table column, or the whole comparison): accuracy curves of every method with the
spread over seeds (min-max band around the seed mean) and over clients (10-90th percentile band),
then the tables (mean ± std over seeds; beside the paper when reproducing), then for every method
its first seed's figures: client x class heatmaps and the algorithm's diagnostics.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

from pfedkit.evaluation import round_table
from pfedkit.experiments.comparison import MANIFEST, slug
from pfedkit.report.html import Section, render
from pfedkit.report.plots import bands
from pfedkit.report.run_report import client_spread, read_run, run_figures


def is_comparison(path: Path) -> bool:
    return (Path(path) / MANIFEST).is_file()


def seed_curves(run_dirs: list[Path]) -> tuple[pd.Index, np.ndarray, np.ndarray]:
    """Per round over the seeds' runs: weighted accuracy [seeds, rounds], and the client spread
    (mean, 10th, 90th percentile) averaged over seeds [3, rounds]; rounds common to all runs."""
    metrics = [read_run(d)[1] for d in run_dirs]
    tables = [round_table(m) for m in metrics]
    spreads = [client_spread(m) for m in metrics]
    rounds = tables[0].index
    for table in tables[1:]:
        rounds = rounds.intersection(table.index)
    weighted = np.stack([t.loc[rounds, "acc_weighted"].to_numpy() for t in tables])
    clients = np.mean([s.loc[rounds, ["mean", "low", "high"]].to_numpy().T for s in spreads], axis=0)
    return rounds, weighted, clients


def group_figures(root: Path, group: str, entries: list[dict], out_dir: Path) -> list[Path]:
    seeds_series, client_series = {}, {}
    rounds = None
    for entry in entries:
        rounds, weighted, clients = seed_curves([root / path for path in entry["runs"].values()])
        seeds_series[entry["label"]] = (weighted.mean(0), weighted.min(0), weighted.max(0))
        client_series[entry["label"]] = tuple(clients)
    name = slug(group or "all")
    title = group or "comparison"
    return [bands(rounds, seeds_series, out_dir / f"{name}_seeds.png",
                  f"{title}: sample-weighted accuracy, mean and min-max over seeds", "round", "test accuracy"),
            bands(rounds, client_series, out_dir / f"{name}_clients.png",
                  f"{title}: mean client accuracy, 10-90th percentile over clients (seed mean)", "round",
                  "client test accuracy")]


def report_comparison(root: str | Path) -> list[Path]:
    """Write root/report/ (PNGs and index.html); returns the files written, the page last."""
    root = Path(root)
    manifest = json.loads((root / MANIFEST).read_text())
    out_dir = root / "report"
    groups: dict[str, list[dict]] = {}
    for entry in manifest["entries"]:
        missing = [p for p in entry["runs"].values() if not (root / p / "metrics.csv").is_file()]
        if not missing:
            groups.setdefault(entry["group"], []).append(entry)
    written: list[Path] = []
    sections = [Section("About", describe(manifest))]
    sections += tables_section(root)
    for group, entries in groups.items():
        figures = group_figures(root, group, entries, out_dir)
        written += figures
        sections.append(Section(f"Accuracy curves: {group}" if group else "Accuracy curves", images=figures))
    for group, entries in groups.items():
        for entry in entries:
            first_seed = sorted(entry["runs"], key=int)[0]
            run_dir = root / entry["runs"][first_seed]
            figures = run_figures(run_dir, out_dir / "runs" / run_dir.name)
            written += figures
            sections.append(Section(f"{group + ': ' if group else ''}{entry['label']} (seed {first_seed})",
                                    images=figures, level=3,
                                    links=[(f"run directory seed {s}", root / p / "summary.json")
                                           for s, p in entry["runs"].items() if (root / p / "summary.json").is_file()]))
    title = (f"{manifest['paper']} {manifest['table']} ({manifest['budget']} budget)"
             if manifest.get("kind") == "reproduce" else f"comparison {root.name}")
    return written + [render(title, sections, out_dir / "index.html")]


def describe(manifest: dict) -> str:
    seeds = ", ".join(str(s) for s in manifest["seeds"])
    if manifest.get("kind") == "reproduce":
        return (f"{manifest['source']}: {manifest['caption']}. Budget {manifest['budget']}: "
                f"{manifest.get('reduced') or 'no reduction'}. Seeds {seeds}.")
    return f"{len(manifest['entries'])} configurations, seeds {seeds}."


def tables_section(root: Path) -> list[Section]:
    sections = []
    if (root / "paper.csv").is_file():
        paper = pd.read_csv(root / "paper.csv")
        columns = ["column", "method", "metric", "ours", "ours_std", "paper", "paper_std", "diff",
                   "rank_ours", "rank_paper", "order_differs", "status"]
        sections.append(Section("Beside the paper", "accuracies in %; ours: mean and std over seeds; order_differs: "
                                "the method's rank differs from the paper's", tables=[paper[columns]]))
    if (root / "table.csv").is_file():
        table = pd.read_csv(root / "table.csv")
        percent = [c for c in table.columns if c.endswith(("_mean", "_std")) and not c.startswith(("MB", "s_per"))]
        table[percent] = table[percent] * 100
        sections.append(Section("Every number (mean and std over seeds)", "accuracies in %", tables=[table]))
    return sections
