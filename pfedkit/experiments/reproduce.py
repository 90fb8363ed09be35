"""`pfedkit reproduce PAPER`: a paper's table run at a budget, our mean ± std beside the paper's number.

The output table has one line per (column, method): ours (mean ± std over seeds of the table's
metric), the paper's value, the difference ours - paper in points, and each method's rank by ours
and by the paper within the column; `order` flags a method whose rank differs, and each column's
Kendall tau between the two orders says how far the orders agree overall. Methods pfedkit does not
implement keep their line, with the paper's value and "not implemented".

Below each column, every row that ran is set against the paper's method (the table's first row
running the paper's own algorithm): our difference ± its standard error (pfedkit.experiments.verdicts:
paired per client where both runs record per-client accuracies, else binomial, the weaker
estimate), the paper's difference, and whether our order is the paper's, a tie (|difference| < 2
SE) or flipped; the column's Kendall tau is given again with the pairs inside 2 SE as ties.
"""
from __future__ import annotations

import shutil
import sys
from typing import Any
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
from scipy.stats import kendalltau, rankdata

from pfedkit.algorithms import algorithm_names
from pfedkit.atomic import atomic_write_text
from pfedkit.config import Config, deep_merge, parse_overrides
from pfedkit.core.errors import ConfigError, ConfigWarning, did_you_mean
from pfedkit.experiments.comparison import (Entry, RunRecord, changes_from_stored, mean_std, plan_runs,
                                            read_summary, run_comparison, write_seed_table)
from pfedkit.experiments.paper_list import data_status, list_paper, list_papers, table_datasets  # noqa: F401
from pfedkit.experiments.paper_presets import Budget, Column, Paper, Row, Table, load_paper
from pfedkit.experiments.verdicts import Difference, client_test_counts, collapsed_kendall_tau, difference, run_accuracy
from pfedkit.run_identity import EXECUTION_KEYS, describe_changes, flatten

NOT_IMPLEMENTED = "not implemented"
CLIENT_SPREAD = "final_acc_std"  # std of the clients' accuracies at the last evaluation


@dataclass
class Plan:
    paper: Paper
    table: Table
    budget_name: str
    budget: Budget
    entries: list[Entry]
    seeds: list[int]
    scope: list[Entry] | None = None  # the whole table's entries at this budget, when `entries` is part of it
    changed: tuple[str, ...] = ()  # the key=value overrides that change what the runs compute (heading)
    data_dir: str | None = None  # the data_dir override: where to rebuild an old run's test counts


def plan_table(paper: Paper, table: Table, budget_name: str, overrides: list[str] | None = None,
               seeds: int | None = None, rows: list[str] | None = None, columns: list[int] | None = None) -> Plan:
    """The comparison entries of one table at one budget (implemented rows only); `overrides`
    (key=value) apply last, e.g. data_dir or backend. `seeds`: how many (0..seeds-1) instead of the
    budget's. `rows`: only these methods, in this order (chosen_rows), instead of the budget's;
    `columns`: only these columns (1-based positions), in this order (chosen_columns)."""
    budget = paper.budget(table, budget_name)
    extra = parse_overrides(overrides or [])
    running = {row.algorithm for row in table.rows if row.algorithm is not None}
    warn_unused_sections(extra, running, table.id)
    sections = set(algorithm_names())

    def entries(chosen: list[Row], chosen_columns: list[Column]) -> list[Entry]:
        found = []
        for column in chosen_columns:
            for row in chosen:
                if row.algorithm is not None:
                    # an override's algorithm section applies to that algorithm's rows only
                    own = {key: value for key, value in extra.items() if key not in sections - {row.algorithm}}
                    config = deep_merge(paper.cell_config(table, column, row, budget), own)
                    found.append(Entry(row.method, config, group=column.name))
        return found

    count = seeds or budget.seeds or table.seeds
    run_columns = chosen_columns(table, budget, columns)
    # a part of the table (--rows, --columns) keeps the table's other cells: every row, in the
    # budget's columns and the ones named
    budget_columns = chosen_columns(table, budget, None)
    scope_columns = [c for c in table.columns if c in budget_columns or c in run_columns]
    partial = rows is not None or columns is not None
    return Plan(paper, table, budget_name, budget, entries(chosen_rows(table, budget, rows), run_columns),
                list(range(count)), scope=entries(table.rows, scope_columns) if partial else None,
                changed=computing_overrides(extra), data_dir=extra.get("data_dir"))


def computing_overrides(extra: dict) -> tuple[str, ...]:
    """The parsed overrides (`parse_overrides`) that change what a run computes, as `key=value`
    (not data_dir, backend, workers...): a table made with them is not the budget's table, so its
    heading names them."""
    computing = {key: value for key, value in extra.items() if key not in EXECUTION_KEYS}
    return tuple(f"{key}={value}" for key, value in flatten(computing).items())


def chosen_rows(table: Table, budget: Budget, methods: list[str] | None) -> list[Row]:
    """The rows a plan runs: by default the table's, or the budget's (a budget may run only the
    rows that carry the paper's claim); `methods` (`--rows`) names them, in the order to run, any
    row of the table included (a row the budget leaves out runs at the budget's settings)."""
    if methods is None:
        return [row for row in table.rows if budget.rows is None or row.method in budget.rows]
    by_name = {row.method: row for row in table.rows}
    for method in methods:
        if method not in by_name:
            raise ConfigError(f"--rows {method}: table {table.id} has no such row"
                              f"{did_you_mean(method, by_name)}; its rows: {', '.join(by_name)}")
        if by_name[method].algorithm is None:
            raise ConfigError(f"--rows {method}: {NOT_IMPLEMENTED} in pfedkit, so it cannot run")
    if len(set(methods)) != len(methods):
        raise ConfigError(f"--rows {','.join(methods)}: a row named twice")
    return [by_name[method] for method in methods]


def chosen_columns(table: Table, budget: Budget, positions: list[int] | None) -> list[Column]:
    """The columns a plan runs: by default the table's, or the budget's; `positions` (`--columns`,
    1 = the table's first column, as `--list` numbers them) names them, in the order to run, any
    column of the table included (one the budget leaves out runs at the budget's settings)."""
    if positions is None:
        return [column for column in table.columns if budget.columns is None or column.name in budget.columns]
    count = len(table.columns)
    for position in positions:
        if not 1 <= position <= count:
            raise ConfigError(f"--columns {position}: table {table.id} has columns 1-{count}: "
                              + "; ".join(f"{i} = {c.name}" for i, c in enumerate(table.columns, 1)))
    if len(set(positions)) != len(positions):
        raise ConfigError(f"--columns {','.join(map(str, positions))}: a column named twice")
    return [table.columns[position - 1] for position in positions]


def warn_unused_sections(overrides: dict, running: set[str], table_id: str) -> None:
    """One ConfigWarning for override sections of algorithms no row of the table runs."""
    unused = sorted(key for key in overrides if key in algorithm_names() and key not in running)
    if unused:
        warnings.warn(f"{', '.join(unused)} options: no effect, no row of table {table_id} runs "
                      f"{' or '.join(unused)} (rows run: {', '.join(sorted(running))})", ConfigWarning)


def default_out(paper: Paper, table: Table, budget_name: str, out_dir: str = "runs") -> Path:
    """A fixed directory per (paper, table, budget): running the same command again resumes."""
    return Path(out_dir) / "reproduce" / f"{paper.paper}-{table.id}-{budget_name}"


def run_plan(plan: Plan, out_dir: Path, quiet: bool = True) -> pd.DataFrame:
    """Run the plan's comparison and write table.csv/.md (all numbers) and paper.csv/.md (beside
    the paper), rewritten after every run so an interrupted table shows what finished; returns
    the paper table."""
    records = run_comparison(out_dir, plan.entries, plan.seeds, quiet=quiet, scope=plan.scope,
                             after_each=lambda finished: write_tables(plan, out_dir, finished), extra={
        "kind": "reproduce", "paper": plan.paper.paper, "table": plan.table.id, "budget": plan.budget_name,
        "reduced": plan.budget.reduced, "source": plan.table.source, "caption": plan.table.caption})
    return write_tables(plan, out_dir, records)


def write_tables(plan: Plan, out_dir: Path, records: list[RunRecord]) -> pd.DataFrame:
    """table.csv/.md and paper.csv/.md of the finished `records`; returns the paper table."""
    write_seed_table(out_dir, records)
    result = paper_table(plan.table, records)
    pairs = pair_table(plan.paper.paper, plan.table, records, plan.data_dir)
    result = with_collapsed_tau(result, plan.table, records, plan.data_dir)
    left_out = pd.Series(False, index=result.index)  # rows/columns the budget leaves out are not "pending"
    if plan.budget.rows is not None:
        left_out |= ~result["method"].isin(plan.budget.rows)
    if plan.budget.columns is not None:
        left_out |= ~result["column"].isin(plan.budget.columns)
    result.loc[left_out & (result["status"] == "pending"), "status"] = f"not run at budget {plan.budget_name}"
    atomic_write_text(out_dir / "paper.csv", result.to_csv(index=False))
    atomic_write_text(out_dir / "pairs.csv", pairs.to_csv(index=False))
    atomic_write_text(out_dir / "paper.md", paper_markdown(plan, result, pairs))
    return result


def write_finished(plan: Plan, out_dir: Path, planned: list[tuple[RunRecord, Config]]) -> pd.DataFrame:
    """`--table-only`: the tables of the plan's `planned` runs (plan_runs) already finished in
    `out_dir`; runs nothing (a table still running elsewhere, or one started from `--reuse`,
    shown as it stands)."""
    records = []
    for record, _ in planned:
        if (summary := read_summary(record.run_dir)) is not None:
            record.summary = summary
            records.append(record)
    if not records:
        raise ConfigError(f"--table-only: no finished run of {plan.paper.paper} table {plan.table.id} at budget "
                          f"{plan.budget_name} in {out_dir / 'runs'}; run the table first, or add --reuse DIR")
    out_dir.mkdir(parents=True, exist_ok=True)
    return write_tables(plan, out_dir, records)


def paper_table(table: Table, records: list[RunRecord]) -> pd.DataFrame:
    """One line per (column, method): ours, paper, difference, ranks and the order flag."""
    lines = []
    for index, column in enumerate(table.columns):
        for row in table.rows:
            paper_value = row.values()[index]
            metric = row.metric or table.metric
            summaries = [r.summary for r in records if r.entry.group == column.name and r.entry.label == row.method
                         and r.summary.get(metric) is not None]
            mean, std = our_value(summaries, metric, table.spread)
            lines.append({"column": column.name, "method": row.method, "algorithm": row.algorithm, "metric": metric,
                          "paper": np.nan if paper_value is None else paper_value.mean,
                          "paper_std": np.nan if paper_value is None or paper_value.std is None else paper_value.std,
                          "ours": mean, "ours_std": std, "seeds": len(summaries),
                          "status": NOT_IMPLEMENTED if row.algorithm is None else
                          ("ran" if summaries else "pending"), **regime_facts(summaries, metric)})
    frame = pd.DataFrame(lines)
    frame["diff"] = frame["ours"] - frame["paper"]
    return add_ranks(frame)


def method_row(paper_name: str, table: Table) -> Row | None:
    """The paper's own method in a table: its first row that runs the paper's algorithm."""
    return next((row for row in table.rows if row.algorithm == paper_name), None)


def _row_runs(records: list[RunRecord], column: str, method: str, metric: str,
              data_dir: str | None = None) -> dict[int, Any]:
    """{seed: RunAccuracy} of one cell's finished runs; test counts rebuilt from the run's config
    (its data in `data_dir`, else in its config's) where its summary has no per-client accuracies
    (None where that is impossible: no data)."""
    runs = {}
    for record in records:
        if record.entry.group != column or record.entry.label != method or record.summary.get(metric) is None:
            continue
        counts = None
        if not (record.summary.get("clients") or {}).get("n_test"):
            counts = _test_counts(record.run_dir, data_dir)
        runs[record.seed] = run_accuracy(record.summary, metric, counts)
    return runs


def _test_counts(run_dir: Path, data_dir: str | None) -> np.ndarray | None:
    try:
        return client_test_counts(run_dir, data_dir)
    except (OSError, ValueError, RuntimeError):  # no config.yaml (ConfigError), no data (DataError)
        return None


def _difference(a: dict, b: dict, weighted: bool) -> Difference | None:
    try:
        return difference(a, b, weighted)
    except ValueError:  # a run without per-client accuracies or test counts
        return None


def pair_table(paper_name: str, table: Table, records: list[RunRecord], data_dir: str | None = None) -> pd.DataFrame:
    """Per column, every row that ran against the paper's method: ours (row - method) ± SE in
    points, how the SE was estimated, the paper's difference, and `order`: "as printed", "tie"
    (|ours| < 2 SE) or "flipped" (outside 2 SE, opposite sign), "-" without a paper number."""
    method = method_row(paper_name, table)
    lines = []
    for index, column in enumerate(table.columns):
        if method is None:
            break
        metric = method.metric or table.metric
        ours_method = _row_runs(records, column.name, method.method, metric, data_dir)
        if not ours_method:
            continue
        for row in table.rows:
            if row.method == method.method or (row.metric or table.metric) != metric:
                continue
            found = _difference(_row_runs(records, column.name, row.method, metric, data_dir), ours_method,
                                not metric.endswith("_unweighted")) if row.algorithm else None
            if found is None:
                continue
            paper_row, paper_method = row.values()[index], method.values()[index]
            paper_diff = np.nan if paper_row is None or paper_method is None else paper_row.mean - paper_method.mean
            order = "-" if np.isnan(paper_diff) else "tie" if found.tie else \
                "as printed" if np.sign(found.diff) == np.sign(paper_diff) else "flipped"
            lines.append({"column": column.name, "method": row.method, "against": method.method, "metric": metric,
                          "diff": found.diff, "se": found.se, "se_kind": found.kind, "seeds": found.seeds,
                          "paper_diff": paper_diff, "order": order})
    return pd.DataFrame(lines, columns=["column", "method", "against", "metric", "diff", "se", "se_kind", "seeds",
                                        "paper_diff", "order"])


def with_collapsed_tau(frame: pd.DataFrame, table: Table, records: list[RunRecord],
                       data_dir: str | None = None) -> pd.DataFrame:
    """`kendall_tau_ties`: each column's Kendall tau where our pairs within 2 SE count as ties
    (verdicts.collapsed_kendall_tau); NaN where a pair's SE cannot be estimated."""
    frame = frame.copy()
    frame["kendall_tau_ties"] = np.nan
    for (column, metric), block in frame.groupby(["column", "metric"], sort=False):
        both = block.dropna(subset=["ours", "paper"])
        runs = [_row_runs(records, column, method, metric, data_dir) for method in both["method"]]
        tied = _noise_ties(runs, not metric.endswith("_unweighted"))
        if len(both) >= 2 and tied is not None:
            frame.loc[block.index, "kendall_tau_ties"] = collapsed_kendall_tau(
                list(both["ours"]), list(both["paper"]), tied)
    return frame


def _noise_ties(runs: list[dict], weighted: bool) -> np.ndarray | None:
    """tied[i, j]: rows i and j within 2 SE of each other; None if any pair has no SE."""
    tied = np.zeros((len(runs), len(runs)), dtype=bool)
    for i in range(len(runs)):
        for j in range(i + 1, len(runs)):
            found = _difference(runs[i], runs[j], weighted)
            if found is None:
                return None
            tied[i, j] = tied[j, i] = found.tie
    return tied


def regime_facts(summaries: list[dict], metric: str) -> dict:
    """What says whether a run is in the paper's regime and settled, over its seeds: local steps
    per participant and round (mean of the runs' means, lowest and highest), and `moved`, how far
    the mean of the last 10 evaluated rounds lies from the 10 before (in points, mean over seeds),
    with the metric's weighting. NaN where no summary has them (runs from before they were written)."""
    suffix = "_unweighted" if metric.endswith("_unweighted") else ""

    def values(key: str) -> list[float]:
        return [s[key] for s in summaries if s.get(key) is not None]

    moves = [abs(s[f"last10_acc{suffix}"] - s[f"prev10_acc{suffix}"]) * 100 for s in summaries
             if s.get(f"last10_acc{suffix}") is not None and s.get(f"prev10_acc{suffix}") is not None]
    means, lows, highs = values("train_steps_mean"), values("train_steps_min"), values("train_steps_max")
    return {"steps": float(np.mean(means)) if means else np.nan, "steps_min": min(lows, default=np.nan),
            "steps_max": max(highs, default=np.nan), "moved": float(np.mean(moves)) if moves else np.nan}


def our_value(summaries: list[dict], metric: str, spread: str) -> tuple[float, float]:
    """Mean over seeds of `metric` in %, and the spread the paper prints beside its number: the std
    over seeds, or (spread "clients") the std over clients at the last evaluation, mean over seeds."""
    if not summaries:
        return np.nan, np.nan
    mean, std = mean_std([100 * s[metric] for s in summaries])
    if spread == "clients":
        std = float(np.nanmean([np.nan if s.get(CLIENT_SPREAD) is None else 100 * s[CLIENT_SPREAD]
                                for s in summaries]))
    return mean, std


def add_ranks(frame: pd.DataFrame) -> pd.DataFrame:
    """Within each (column, metric), ranks (1 = best) by ours and by the paper among the methods that
    have both numbers; `order_differs` where they disagree; `kendall_tau` of the column."""
    frame = frame.copy()
    frame["rank_ours"] = np.nan
    frame["rank_paper"] = np.nan
    frame["kendall_tau"] = np.nan
    for _, block in frame.groupby(["column", "metric"], sort=False):
        both = block.dropna(subset=["ours", "paper"])
        if len(both) < 2:
            continue
        frame.loc[both.index, "rank_ours"] = rankdata(-both["ours"].to_numpy(), method="min")
        frame.loc[both.index, "rank_paper"] = rankdata(-both["paper"].to_numpy(), method="min")
        frame.loc[block.index, "kendall_tau"] = kendalltau(both["ours"], both["paper"]).statistic
    frame["order_differs"] = (frame["rank_ours"] != frame["rank_paper"]) & frame["rank_ours"].notna()
    return frame


def _num(value: float, std: float | None = None) -> str:
    if value is None or np.isnan(value):
        return "-"
    return f"{value:.2f}" + ("" if std is None or np.isnan(std) else f" ± {std:.2f}")


def _steps(line: pd.Series) -> str:
    """`250 (110-345)`: mean local steps of a participant in a round, and their range."""
    if np.isnan(line["steps"]):
        return "-"
    return f"{line['steps']:.0f} ({line['steps_min']:.0f}-{line['steps_max']:.0f})"


def _seed_counts(plan: Plan, result: pd.DataFrame) -> str:
    """`2`, or `1-2 (per row: the seeds column)` where the rows that ran have different numbers of
    seeds (a table grown with --rows and --seeds)."""
    counts = result.loc[result["status"] == "ran", "seeds"]
    low, high = (int(counts.min()), int(counts.max())) if len(counts) else (len(plan.seeds), len(plan.seeds))
    return str(high) if low == high else f"{low}-{high} (per row: the seeds column)"


def paper_markdown(plan: Plan, result: pd.DataFrame, pairs: pd.DataFrame | None = None) -> str:
    """Markdown: a heading with the source and budget, then one table per column, each followed by
    its rows' differences from the paper's method (`pairs`, pair_table)."""
    table = plan.table
    parts = [f"## {plan.paper.paper} {table.id}: {table.caption}",
             f"Source: {table.source}. Budget: {plan.budget_name} ({plan.budget.reduced or 'no reduction'})"
             + (f", changed by the overrides {' '.join(plan.changed)}" if plan.changed else "") + "; "
             f"seeds: {_seed_counts(plan, result)}. Metric: {table.metric} in % (paper's ± is over {table.spread}; "
             + ("ours is the std over clients at the last evaluation, mean over seeds). " if table.spread == "clients"
                else "ours is over seeds, ddof=0). ") + "diff = ours - paper in points; `order` marks a method whose rank "
             "among the methods with both numbers differs from the paper's; steps a round: local SGD steps of a "
             "participant in a round, mean (lowest-highest); last-10 moved: how far the mean accuracy of the "
             "last 10 evaluated rounds lies from the 10 before, in points (settled below 0.5)."]
    for column, block in result.groupby("column", sort=False):
        tau = block["kendall_tau"].dropna()
        tau_ties = block["kendall_tau_ties"].dropna() if "kendall_tau_ties" in block else pd.Series(dtype=float)
        parts.append(f"\n### {column}" + (f" (Kendall tau ours vs paper: {tau.iloc[0]:.2f}" if len(tau) else "")
                     + (f"; with the pairs inside 2 SE as ties: {tau_ties.iloc[0]:.2f}" if len(tau_ties) else "")
                     + (")" if len(tau) else ""))
        parts.append("| method | metric | ours | seeds | paper | diff | rank ours / paper | order "
                     "| steps a round | last-10 moved |")
        parts.append("|---|---|---|---|---|---|---|---|---|---|")
        for _, line in block.iterrows():
            one_seed = table.spread != "clients" and line["seeds"] == 1  # a std over one seed says nothing
            ours = (_num(line["ours"], None if one_seed else line["ours_std"]) if line["status"] == "ran"
                    else line["status"])
            ranks = "-" if np.isnan(line["rank_ours"]) else f"{int(line['rank_ours'])} / {int(line['rank_paper'])}"
            parts.append(f"| {line['method']} | {line['metric']} | {ours} | {line['seeds']} "
                         f"| {_num(line['paper'], line['paper_std'])} | {_num(line['diff'])} | {ranks} "
                         f"| {'≠' if line['order_differs'] else ''} | {_steps(line)} | {_num(line['moved'])} |")
        if pairs is not None and len(mine := pairs[pairs["column"] == column]):
            parts.append(pairs_markdown(mine))
    return "\n".join(parts) + "\n"


def pairs_markdown(pairs: pd.DataFrame) -> str:
    """One column's rows against the paper's method: ours ± SE, the paper's difference, the order."""
    against = pairs["against"].iloc[0]
    lines = [f"\nAgainst {against} (row - {against}, in points; ± the standard error; `tie`: |ours| < 2 SE, "
             "not a rank; `flipped`: the paper's order reversed outside 2 SE):",
             "| method | ours - method | SE from | seeds | paper - method | order |", "|---|---|---|---|---|---|"]
    for _, pair in pairs.iterrows():
        lines.append(f"| {pair['method']} | {pair['diff']:+.2f} ± {pair['se']:.2f} | {pair['se_kind']} "
                     f"| {pair['seeds']} | {_num(pair['paper_diff'])} | {pair['order']} |")
    return "\n".join(lines)


def check_data(plan: Plan) -> None:
    """ConfigError (one line) naming the `pfedkit data fetch` commands when a file the plan's cells
    read (after overrides: dataset=, data_dir=) is not in their data directory."""
    from pfedkit.data.datasets import DATASETS, data_present, resolve_data_dir

    missing, where = [], None
    for entry in plan.entries:
        info = DATASETS.get(entry.config.get("dataset", ""))
        data_dir = entry.config.get("data_dir")
        if info is not None and not info.embedded and info.file_name not in missing \
                and not data_present(info.file_name, data_dir):
            missing.append(info.file_name)
            where = resolve_data_dir(data_dir)
    if missing:
        place = f"not in {where}" if where is not None else \
            "missing: no data directory (set data_dir=DIR or PFEDKIT_DATA)"
        commands = "; ".join(f"pfedkit data fetch {name} --data-dir DIR" for name in missing)
        raise ConfigError(f"reproduce {plan.paper.paper} --table {plan.table.id}: data {', '.join(missing)} {place}; "
                          f"get it with {commands}")


def _symbolic_links(directory: str, names: list[str]) -> list[str]:
    """copytree's `ignore`: a reused run is copied without its symbolic links, so a link planted in
    a shared results folder never brings its target's content (a file outside it) into out_dir."""
    return [name for name in names if (Path(directory) / name).is_symlink()]


def adopt_finished_runs(source: Path, planned: list[tuple[RunRecord, Config]], out_dir: Path) -> dict[str, str]:
    """Copy into `out_dir`/runs the finished runs in `source` (run directories with config.yaml and
    summary.json, e.g. a table's docs/results/ folder from an earlier machine) that the table's
    `planned` runs (plan_runs) hold with the same settings and `out_dir` lacks, so the table reuses
    them instead of running them again. Returns {run name: what happened} for every run directory
    found in `source`."""
    planned = {record.run_dir.name: config for record, config in planned}
    outcome = {}
    for run_dir in sorted(path for path in source.iterdir() if (path / "summary.json").is_file()):
        target = out_dir / "runs" / run_dir.name
        if run_dir.name not in planned:
            outcome[run_dir.name] = "not a run of this table at this budget"
        elif target.exists():
            outcome[run_dir.name] = f"{target} exists already (kept)"
        elif changes := changes_from_stored(run_dir, planned[run_dir.name]):
            outcome[run_dir.name] = f"made with other settings ({describe_changes(changes)}): not reused"
        else:
            shutil.copytree(run_dir, target, ignore=_symbolic_links)
            outcome[run_dir.name] = "reused"
    return outcome


def reproduce(name: str, table_ids: list[str] | None, budget_name: str, overrides: list[str] | None = None,
              out: str | None = None, quiet: bool = True, reuse: str | None = None,
              table_only: bool = False, seeds: int | None = None,
              rows: list[str] | None = None, columns: list[int] | None = None) -> list[tuple[Path, pd.DataFrame]]:
    """Run the chosen tables (default: all) of paper `name`; returns (directory, paper table) each.
    `reuse`: a directory of finished runs of the (single) table to start from (adopt_finished_runs).
    `table_only`: write the tables of the runs already finished, run nothing. `seeds`, `rows`,
    `columns`: plan_table's (seeds 0..seeds-1; only these rows, these columns, in this order)."""
    paper = load_paper(name)
    tables = [paper.table(t) for t in table_ids] if table_ids else paper.tables
    if seeds is not None and seeds < 1:
        raise ConfigError(f"--seeds {seeds}: at least 1")
    if columns is not None and len(tables) != 1:
        raise ConfigError("--columns picks columns of one table: name a single --table")
    plans = [plan_table(paper, table, budget_name, overrides, seeds, rows, columns) for table in tables]
    out_root = parse_overrides(overrides or []).get("out_dir", "runs")
    outs = [Path(out) / plan.table.id if out and len(plans) > 1 else Path(out) if out
            else default_out(paper, plan.table, budget_name, out_root) for plan in plans]
    if reuse is not None and len(plans) != 1:
        raise ConfigError("--reuse takes the finished runs of one table: name a single --table")
    if reuse is not None and not Path(reuse).is_dir():
        raise ConfigError(f"--reuse {reuse}: not a directory")
    for plan in plans if not table_only else []:  # a missing dataset stops the command before any directory is made
        check_data(plan)
    # every cell of every table validated before the first run; --reuse and --table-only take the
    # whole table's cells (plan.scope) where --rows or --columns runs only some of them
    planned = [plan_runs(out_dir, plan.scope or plan.entries, plan.seeds) for plan, out_dir in zip(plans, outs)]
    if reuse is not None:
        for run_name, what in adopt_finished_runs(Path(reuse), planned[0], outs[0]).items():
            print(f"--reuse {run_name}: {what}", file=sys.stderr)
    if table_only:
        return [(out_dir, write_finished(plan, out_dir, runs)) for plan, out_dir, runs in zip(plans, outs, planned)]
    return [(out_dir, run_plan(plan, out_dir, quiet)) for plan, out_dir in zip(plans, outs)]
