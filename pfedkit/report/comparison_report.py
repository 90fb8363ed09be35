"""`pfedkit report COMPARISON`: one HTML page for a comparison or reproduce directory.

The page, top to bottom: what was compared (dataset, model, clients, partition, rounds, local
training, seeds: what every run shares, and the values of what differs); the headline table (mean
± std over seeds of the compact columns `pfedkit compare` prints, a run's value alone with one
seed; the other columns of table.csv in a collapsed table below it; beside the paper when
reproducing); then per setting (a table column, or the whole comparison) the sample-weighted
accuracy of every method (seed means, lines only: bands of several methods would overlap into a
blur) and the spread over clients (10-90th percentile band) in one panel per method; then per
method its curves over seeds (min-max band), all methods of a setting on the same y range, and,
collapsed, every seed's own figures.

Every run of the comparison also gets its own report (RUN/report/index.html, what `pfedkit report
RUN` writes); the page links each seed to it and shows that run's figures from there, so nothing
is drawn twice. Each run's metrics are read once. Accuracies are in percent (0-100) in the tables
and on every axis.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from pfedkit.config import load_config
from pfedkit.evaluation import round_table
from pfedkit.experiments.comparison import (MANIFEST, PERCENT_COLUMNS, SUMMARY_COLUMNS, format_cell, one_seed, slug,
                                            table_note)
from pfedkit.report.html import Section, render
from pfedkit.report.plots import bands, lines, panels
from pfedkit.report.run_report import (ACCURACY_AXIS, ACCURACY_NOTE, CLIENT_BAND, PERCENT, client_spread, read_run,
                                       report_run)
from pfedkit.report.run_settings import settings_words

# The columns `pfedkit compare` prints (new_clients and epsilon where a run has them); the page
# shows the others collapsed, so the table fits.
HEADLINE_COLUMNS = ("best", "last5", "new_clients", "epsilon", "best_unweighted", "last5_unweighted", "worst_client",
                    "MB_per_round", "s_per_round")
PAPER_HEADLINE = ("column", "method", "metric", "ours", "seeds", "paper", "diff", "rank ours / paper", "order")
# A method's own figure: these round_table columns, each over its seeds.
METHOD_CURVES = (("sample-weighted", "acc_weighted"), ("unweighted", "acc_mean"), ("worst client", "acc_worst"))


def is_comparison(path: Path) -> bool:
    return (Path(path) / MANIFEST).is_file()


def common_rounds(tables: list[pd.DataFrame]) -> pd.Index:
    rounds = tables[0].index
    for table in tables[1:]:
        rounds = rounds.intersection(table.index)
    return rounds


@dataclass
class EntryCurves:
    """One entry's runs over the rounds common to its seeds, in % (0-100)."""
    label: str
    seeds: list[str]
    rounds: pd.Index
    accuracy: dict[str, np.ndarray]  # METHOD_CURVES name -> [seeds, rounds]
    clients: np.ndarray  # [3, rounds]: mean, low and high CLIENT_BAND percentile over clients, seed mean

    def at(self, rounds: pd.Index) -> "EntryCurves":
        """The same curves at `rounds` (a subset of self.rounds)."""
        where = self.rounds.get_indexer(rounds)
        return EntryCurves(self.label, self.seeds, rounds, {k: v[:, where] for k, v in self.accuracy.items()},
                           self.clients[:, where])


def entry_curves(root: Path, entry: dict) -> EntryCurves:
    seeds = sorted(entry["runs"], key=int)
    metrics = [read_run(root / entry["runs"][seed])[1] for seed in seeds]
    tables = [round_table(m) for m in metrics]
    rounds = common_rounds(tables)
    accuracy = {name: PERCENT * np.stack([t.loc[rounds, column].to_numpy() for t in tables])
                for name, column in METHOD_CURVES}
    spreads = [client_spread(m).loc[rounds, ["mean", "low", "high"]].to_numpy().T for m in metrics]
    return EntryCurves(entry["label"], seeds, rounds, accuracy, PERCENT * np.mean(spreads, axis=0))


def over_seeds(seeds: list[str], spread: str = "") -> str:
    """`seed 0`, or `mean over seeds 0, 1` (+ the `spread` drawn around it)."""
    if len(seeds) == 1:
        return f"seed {seeds[0]}"
    return f"mean{' and ' + spread if spread else ''} over seeds {', '.join(seeds)}"


def mean_min_max(values: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return values.mean(0), values.min(0), values.max(0)


def group_figures(group: str, curves: list[EntryCurves], out_dir: Path) -> list[Path]:
    """The setting's methods together: seed-mean accuracy (lines), client spread (one panel each)."""
    rounds = common_rounds([pd.DataFrame(index=c.rounds) for c in curves])
    curves = [c.at(rounds) for c in curves]
    seeds = sorted({seed for c in curves for seed in c.seeds}, key=int)
    name, title = slug(group or "all"), group or "comparison"
    low, high = CLIENT_BAND
    spread = " (min-max over seeds: each method's figure)" if len(seeds) > 1 else ""
    return [lines(rounds, {c.label: c.accuracy["sample-weighted"].mean(0) for c in curves},
                  out_dir / f"{name}_seeds.png", f"{title}: sample-weighted accuracy, {over_seeds(seeds)}{spread}",
                  "round", ACCURACY_AXIS),
            panels(rounds, {c.label: tuple(c.clients) for c in curves}, out_dir / f"{name}_clients.png",
                   f"{title}: mean client accuracy and its {low}-{high}th percentile over clients "
                   f"({'seed mean' if len(seeds) > 1 else over_seeds(seeds)}); grey: the other methods",
                   "round", f"client {ACCURACY_AXIS}")]


def shared_y_range(curves: list[EntryCurves]) -> tuple[float, float]:
    """One y range for every method figure of a setting (all seeds, all curves), with a margin."""
    low = min(float(np.nanmin(values)) for c in curves for values in c.accuracy.values())
    high = max(float(np.nanmax(values)) for c in curves for values in c.accuracy.values())
    margin = 0.04 * max(high - low, 1.0)
    return low - margin, high + margin


def method_figure(group: str, curves: EntryCurves, ylim: tuple[float, float], out_dir: Path) -> Path:
    """One method over all its seeds: sample-weighted, unweighted and worst-client accuracy, each
    the seed mean with its min-max band (one seed: the run's curves)."""
    series = {name: mean_min_max(curves.accuracy[name]) for name, _ in METHOD_CURVES}
    label = f"{group}: {curves.label}" if group else curves.label
    return bands(curves.rounds, series, out_dir / f"{slug(group or 'all')}_{slug(curves.label)}_seeds.png",
                 f"{label}: {over_seeds(curves.seeds, 'min-max')}", "round", ACCURACY_AXIS, ylim=ylim)


def method_sections(root: Path, group: str, entry: dict, figure: Path,
                    run_reports: dict[str, list[Path]]) -> list[Section]:
    """The method's curves over seeds, a link to each seed's run report, and each seed's figures
    (collapsed)."""
    seeds = sorted(entry["runs"], key=int)
    pages = [(f"seed {seed}: run report", run_reports[entry["runs"][seed]][-1]) for seed in seeds]
    sections = [Section(f"{group + ': ' if group else ''}{entry['label']}", images=[figure], links=pages, level=3)]
    for seed in seeds:
        run_dir = root / entry["runs"][seed]
        sections.append(Section(f"seed {seed}: figures of {run_dir.name}", images=run_reports[entry["runs"][seed]][:-1],
                                links=[("this run's report", run_reports[entry["runs"][seed]][-1])], collapsed=True))
    return sections


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
    runs = [path for entries in groups.values() for entry in entries for path in entry["runs"].values()]
    run_reports = {path: report_run(root / path) for path in runs}
    written: list[Path] = [path for files in run_reports.values() for path in files]
    configs = [load_config(root / path / "config.yaml") for path in dict.fromkeys(runs)]
    sections = [Section("About", describe(manifest, unfinished, settings_words(configs) if configs else ""))]
    sections += tables_section(root)
    curves = {group: [entry_curves(root, entry) for entry in entries] for group, entries in groups.items()}
    for group, group_curves in curves.items():
        figures = group_figures(group, group_curves, out_dir)
        written += figures
        sections.append(Section(f"Accuracy curves: {group}" if group else "Accuracy curves", ACCURACY_NOTE,
                                images=figures))
    for group, entries in groups.items():
        ylim = shared_y_range(curves[group])
        sections.append(Section(f"Per method: {group}" if group else "Per method",
                                "each method over its seeds, all on the same y range; every seed's own figures in "
                                "the collapsed blocks"))
        for entry, entry_curve in zip(entries, curves[group]):
            figure = method_figure(group, entry_curve, ylim, out_dir)
            sections += method_sections(root, group, entry, figure, run_reports)
            written.append(figure)
    title = (f"{manifest['paper']} {manifest['table']} ({manifest['budget']} budget)"
             if manifest.get("kind") == "reproduce" else f"comparison {root.name}")
    return written + [render(title, sections, out_dir / "index.html")]


def describe(manifest: dict, unfinished: list[str] | None = None, settings: str = "") -> str:
    seeds = ", ".join(str(s) for s in manifest["seeds"])
    waiting = f" Not finished yet (left out below): {', '.join(unfinished)}." if unfinished else ""
    shared = f" Settings: {settings}." if settings else ""
    if manifest.get("kind") == "reproduce":
        return (f"{manifest['source']}: {manifest['caption']}. Budget {manifest['budget']}: "
                f"{manifest.get('reduced') or 'no reduction'}. Seeds {seeds}.{shared}{waiting}")
    return f"{len(manifest['entries'])} configurations, seeds {seeds}.{shared}{waiting}"


def tables_section(root: Path) -> list[Section]:
    sections = []
    if (root / "paper.csv").is_file():
        paper = pd.read_csv(root / "paper.csv")
        sections.append(Section("Beside the paper", "accuracies in %; ours: mean over seeds ± the spread the paper "
                                "prints (over seeds, or across clients: see About); diff = ours - paper in points; "
                                "order ≠: the method's rank differs from the paper's",
                                tables=[paper_cells(paper)]))
        sections.append(Section("Beside the paper: every column of paper.csv", tables=[paper], collapsed=True))
    if (root / "table.csv").is_file():
        # labels are text even when they read like numbers or "NA"; table.csv writes missing numbers as ""
        table = pd.read_csv(root / "table.csv", dtype={"group": str, "label": str}, keep_default_na=False,
                            na_values=[""])
        table["group"] = table["group"].fillna("")
        cells = "one seed" if one_seed(table) else "mean ± std over seeds"
        sections.append(Section(f"Results ({cells})", table_note(table), tables=[seed_cells(table, HEADLINE_COLUMNS)]))
        others = seed_cells(table, tuple(column for column in SUMMARY_COLUMNS if column not in HEADLINE_COLUMNS))
        shown = [column for column in others.columns if column in SUMMARY_COLUMNS]
        sections.append(Section(f"More columns: {', '.join(shown)} ({cells})", tables=[others], collapsed=True))
    return sections


def seed_cells(table: pd.DataFrame, columns: tuple[str, ...]) -> pd.DataFrame:
    """table.csv as text cells "mean ± std" (accuracies in %; one seed: the value alone), one column
    per metric; the setting column only when the comparison has settings; metrics no run recorded
    are left out."""
    cells = pd.DataFrame()
    if table["group"].astype(str).str.len().any():
        cells["setting"] = table["group"]
    cells["method"] = table["label"]
    cells["seeds"] = table["seeds"]
    for column in columns:
        if f"{column}_mean" not in table or table[f"{column}_mean"].isna().all():
            continue
        cells[column] = [format_cell(mean, std, column in PERCENT_COLUMNS, seeds) for mean, std, seeds
                         in zip(table[f"{column}_mean"], table[f"{column}_std"], table["seeds"])]
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
