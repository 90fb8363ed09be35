"""A comparison: several configurations ("entries") x several seeds, in one directory that resumes.

Layout of a comparison directory:
    comparison.json   the manifest: entries (label, group, algorithm, run directory per seed), seeds
    runs/<label>-s<seed>/   one ordinary run directory per (entry, seed) (see pfedkit.runs)
    table.csv, table.md     mean ± std over seeds of every summary number, one seed: its value (written by the caller)
Every entry runs on the same partition and client-sampling stream for a given seed, because both
derive from the seed alone. Running the same request again reuses finished runs, resumes a half
run from its checkpoint, and refuses a directory whose runs were made with other settings.
A request with fewer entries or seeds than an earlier one keeps the earlier finished cells
(manifest and tables hold them all), provided they share the settings this request holds fixed.
"""
from __future__ import annotations

import json
import re
from collections import Counter
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pandas as pd

from pfedkit.atomic import atomic_write_json, atomic_write_text
from pfedkit.config import Config, load_config
from pfedkit.core.errors import ConfigError
# EXECUTION_KEYS (where or how fast a run executes, not what it computes: a resumed comparison may
# change them) now lives in run_identity, with `identity`; still importable from here.
from pfedkit.run_identity import EXECUTION_KEYS  # noqa: F401
from pfedkit.run_identity import MISSING, changed_keys, describe_changes, flatten, identity

MANIFEST = "comparison.json"


@dataclass(frozen=True)
class Entry:
    """One configuration of a comparison; `group` is a table column (reproduce) or ""."""
    label: str
    config: dict[str, Any]
    group: str = ""


@dataclass
class RunRecord:
    entry: Entry
    seed: int
    run_dir: Path
    summary: dict[str, Any] = field(default_factory=dict)


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_") or "run"


def run_name(entry: Entry, seed: int) -> str:
    return f"{slug(f'{entry.group}-{entry.label}' if entry.group else entry.label)}-s{seed}"


def plan_runs(out_dir: Path, entries: list[Entry], seeds: list[int]) -> list[tuple[RunRecord, Config]]:
    """Validate every (entry, seed) config up front; entries with the same config share runs."""
    planned, by_identity = [], {}
    for entry in entries:
        for seed in seeds:
            config = load_config(entry.config, {"seed": seed, "out_dir": str(out_dir / "runs"),
                                                "name": run_name(entry, seed)})
            key = json.dumps(identity(config), sort_keys=True)
            if key in by_identity:  # e.g. a "best" and a "final" row of the same run
                config = by_identity[key]
            by_identity.setdefault(key, config)
            planned.append((RunRecord(entry, seed, out_dir / "runs" / config.name), config))
    return planned


def write_manifest(out_dir: Path, records: list[RunRecord], seeds: list[int], extra: dict[str, Any]) -> None:
    entries = []
    for record in records:
        if not entries or (entries[-1]["label"], entries[-1]["group"]) != (record.entry.label, record.entry.group):
            entries.append({"label": record.entry.label, "group": record.entry.group,
                            "algorithm": record.entry.config.get("algorithm"), "runs": {}})
        entries[-1]["runs"][str(record.seed)] = str(record.run_dir.relative_to(out_dir))
    manifest = {"seeds": seeds, "entries": entries, **extra}
    atomic_write_json(out_dir / MANIFEST, manifest)


def run_comparison(out_dir: str | Path, entries: list[Entry], seeds: list[int], *, quiet: bool = True,
                   extra: dict[str, Any] | None = None,
                   log: Callable[[str], None] = lambda text: print(text, file=sys.stderr),
                   after_each: Callable[[list[RunRecord]], None] | None = None,
                   scope: list[Entry] | None = None) -> list[RunRecord]:
    """Run (or reuse, or resume) every entry for every seed; returns one record per (entry, seed).
    `after_each(finished records)` is called after every run: tables that grow as runs finish.
    `scope`: every entry of the whole table when `entries` is part of it (reproduce --rows): its
    cells finished in `out_dir` join the table, and a kept cell must share the settings the whole
    table shares, not those that only the entries run now happen to share."""
    if not entries or not seeds:
        raise ConfigError("a comparison needs at least one entry and one seed")
    out_dir = Path(out_dir)
    planned = plan_runs(out_dir, entries, seeds)
    earlier = read_manifest(out_dir)
    kept = finished_cells_kept(out_dir, earlier, planned, plan_runs(out_dir, scope, seeds) if scope else None)
    records = in_table_order(earlier, [record for record, _ in planned] + kept)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_manifest(out_dir, records, sorted({record.seed for record in records}), extra or {})
    done: dict[Path, dict[str, Any]] = {}
    for number, (record, config) in enumerate(planned, 1):
        if record.run_dir not in done:
            done[record.run_dir], how = _run_once(record.run_dir, config, quiet)
            log(f"[{number}/{len(planned)}] {record.entry.group + ' ' if record.entry.group else ''}"
                f"{record.entry.label} seed {record.seed}: {how} ({record.run_dir})")
        record.summary = done[record.run_dir]
        if after_each is not None:
            after_each([r for r in records if r.summary])
    return records


def read_summary(run_dir: Path) -> dict[str, Any] | None:
    """A finished run's summary.json (None while the run has not finished)."""
    summary_file = run_dir / "summary.json"
    return json.loads(summary_file.read_text()) if summary_file.is_file() else None


def manifest_cells(out_dir: Path, manifest: dict[str, Any]) -> dict[tuple[str, str, int], tuple[Path, dict]]:
    """{(group, label, seed): (run directory, manifest entry)} of a comparison's manifest, in its order."""
    return {(item.get("group", ""), item.get("label", ""), int(seed)): (out_dir / path, item)
            for item in manifest.get("entries", []) for seed, path in item.get("runs", {}).items()}


def finished_records(out_dir: Path) -> list[RunRecord]:
    """The finished cells of a comparison directory, in its manifest's order: what its table holds
    so far (a sweep cut midway keeps them; `pfedkit compare` writes the table after every run)."""
    out_dir = Path(out_dir)
    records = []
    for (group, label, seed), (run_dir, item) in manifest_cells(out_dir, read_manifest(out_dir)).items():
        if (summary := read_summary(run_dir)) is not None:
            records.append(RunRecord(Entry(label, {"algorithm": item.get("algorithm")}, group), seed, run_dir, summary))
    return records


def read_manifest(out_dir: Path) -> dict[str, Any]:
    """The directory's comparison.json ({} if none yet)."""
    manifest_file = out_dir / MANIFEST
    return json.loads(manifest_file.read_text()) if manifest_file.is_file() else {}


def finished_cells_kept(out_dir: Path, earlier: dict[str, Any], planned: list[tuple[RunRecord, Config]],
                        scope: list[tuple[RunRecord, Config]] | None = None) -> list[RunRecord]:
    """The finished (entry, seed) cells that this request does not plan, with their summaries: those
    of the `earlier` manifest and, given a `scope` (plan_runs of the whole table when `planned` is
    part of it: reproduce --rows), the scope's cells finished in `out_dir` (adopted with --reuse,
    say). A rerun with a subset of the entries, rows or seeds adds to the table instead of replacing
    it. Refused (ConfigError naming the keys) when a kept cell differs from this request in a
    setting all planned runs (with a scope: all the table's runs) share (rounds, data,
    partition...), or a cell of the scope in anything from the scope's run of it (its algorithm's
    options included): the table would mix settings."""
    planned_cells = {(record.entry.group, record.entry.label, record.seed) for record, _ in planned}
    fixed = shared_settings([config for _, config in (scope or planned)])
    candidates = {cell: run_dir for cell, (run_dir, _) in manifest_cells(out_dir, earlier).items()}
    expected = {}  # a cell of the scope must be the scope's run of it, every setting included
    for record, config in scope or []:
        cell = (record.entry.group, record.entry.label, record.seed)
        candidates.setdefault(cell, record.run_dir)
        expected[cell] = config
    kept = []
    for (group, label, seed), run_dir in candidates.items():
        summary = read_summary(run_dir)
        if (group, label, seed) in planned_cells or summary is None:
            continue  # replanned, or never finished (its directory stays, for a later request)
        config = load_config(run_dir / "config.yaml")
        stored_identity = identity(config)
        stored = flatten(stored_identity)
        changes = changed_keys({key: stored.get(key, MISSING) for key in fixed}, fixed)
        if not changes and (group, label, seed) in expected:  # the config read above, not a second read
            changes = changed_keys(stored_identity, identity(expected[(group, label, seed)]))
        if changes:
            raise ConfigError(f"{out_dir}: its finished run {run_dir.relative_to(out_dir)} was made with other "
                              f"settings ({describe_changes(changes)}); rerun with those settings to add to its "
                              "table, or use another --out directory")
        kept.append(RunRecord(Entry(label, config.to_dict(), group), seed, run_dir, summary))
    return kept


def shared_settings(configs: list[Config]) -> dict[str, Any]:
    """The dotted settings with one value in all `configs`, leaving out what a comparison varies
    on purpose: the algorithm, algorithm sections and the seed."""
    from pfedkit.algorithms import algorithm_names

    varied = {"algorithm", "seed", *algorithm_names()}
    flats = [flatten(identity(config)) for config in configs]
    return {key: value for key, value in flats[0].items()
            if key.split(".")[0] not in varied and all(key in flat and flat[key] == value for flat in flats[1:])}


def in_table_order(earlier: dict[str, Any], records: list[RunRecord]) -> list[RunRecord]:
    """Entries in the order of the `earlier` manifest, new ones after (in request order); seeds ascending."""
    order: dict[tuple[str, str], int] = {}
    for item in earlier.get("entries", []):
        order.setdefault((item.get("group", ""), item.get("label", "")), len(order))
    for record in records:
        order.setdefault((record.entry.group, record.entry.label), len(order))
    return sorted(records, key=lambda record: (order[(record.entry.group, record.entry.label)], record.seed))


def changes_from_stored(run_dir: Path, config: Config) -> dict[str, tuple[Any, Any]]:
    """How `config` differs, in what it computes, from the run whose config.yaml is in `run_dir`
    (run_identity.changed_keys; empty: the stored run is this config's run)."""
    return changed_keys(identity(load_config(run_dir / "config.yaml")), identity(config))


def _run_once(run_dir: Path, config: Config, quiet: bool) -> tuple[dict[str, Any], str]:
    """A finished run's summary (reused), a half run resumed, or a new run."""
    from pfedkit.engine.client_states import STATES_DIR
    from pfedkit.runs import CHECKPOINT, run

    if (run_dir / "config.yaml").is_file():
        changes = changes_from_stored(run_dir, config)
        if changes:
            raise ConfigError(f"{run_dir} was made with other settings ({describe_changes(changes)}); "
                              "use another --out directory or delete that run")
        if (summary := read_summary(run_dir)) is not None:
            return summary, "reused"
        summary, how = run(resume=run_dir, quiet=quiet).summary, "resumed"
    else:
        if run_dir.exists():  # killed before its config was written: nothing in it to keep
            shutil.rmtree(run_dir)
        summary, how = run(config, quiet=quiet).summary, "ran"
    # A finished run is never resumed; its checkpoint (every client's model: ~1 GB for 20
    # ResNet-18s) would only fill the disk over a table's dozens of runs.
    (run_dir / CHECKPOINT).unlink(missing_ok=True)
    shutil.rmtree(run_dir / STATES_DIR, ignore_errors=True)  # the client states it named (client_states=disk)
    return summary, how


# ---- mean ± std over seeds -------------------------------------------------------------------

SUMMARY_COLUMNS = {  # table column -> how to read it from summary.json
    "best": lambda s: s.get("best_acc"),
    "last5": lambda s: s.get("last5_acc"),
    # clients that never trained (config new_clients): their last5; only where some run has them
    "new_clients": lambda s: s.get("new_clients_last5_acc"),
    "best_unweighted": lambda s: s.get("best_acc_unweighted"),
    "last5_unweighted": lambda s: s.get("last5_acc_unweighted"),
    "last10_unweighted": lambda s: s.get("last10_acc_unweighted"),
    "worst_client": lambda s: s.get("final_acc_worst"),
    "many": lambda s: (s.get("final_group_acc") or {}).get("many"),
    "medium": lambda s: (s.get("final_group_acc") or {}).get("medium"),
    "few": lambda s: (s.get("final_group_acc") or {}).get("few"),
    "MB_per_round": lambda s: (s["bytes_up"] + s["bytes_down"]) / 1e6 / max(1, s["rounds_done"]),
    "s_per_round": lambda s: s.get("sec_per_round"),
    "epsilon": lambda s: s.get("epsilon"),  # dp: the run's (epsilon, dp.delta) guarantee; only where some run has dp
}
PERCENT_COLUMNS = ("best", "last5", "new_clients", "best_unweighted", "last5_unweighted", "last10_unweighted", "worst_client",
                   "many", "medium", "few")
# Columns only a run with that option fills: left out of table.csv / table.md when no run has them,
# and shown after "last5" in any column list when some run has them.
OPTIONAL_COLUMNS = ("new_clients", "epsilon")
NEW_CLIENTS_NOTE = (" new_clients: the clients that never trained (config new_clients), mean of their last 5 "
                    "evaluated rounds, weighted by test samples; the other accuracies are the participants'.")


def with_optional_columns(columns: tuple[str, ...], table: pd.DataFrame) -> tuple[str, ...]:
    """`columns` with each optional column the table has (after "last5", else at the end)."""
    present = [c for c in OPTIONAL_COLUMNS if f"{c}_mean" in table and c not in columns]
    if not present:
        return tuple(columns)
    columns = list(columns)
    at = columns.index("last5") + 1 if "last5" in columns else len(columns)
    return tuple(columns[:at] + present + columns[at:])


def seed_values(records: list[RunRecord], read: Callable[[dict], Any]) -> dict[tuple[str, str], list[float]]:
    """Per (group, label), the value `read` from each seed's summary (None -> nan), in record order."""
    values: dict[tuple[str, str], list[float]] = {}
    for record in records:
        value = read(record.summary)
        values.setdefault((record.entry.group, record.entry.label), []).append(
            float("nan") if value is None else float(value))
    return values


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and population std (ddof=0, numpy's and PFLlib's) over seeds, ignoring missing values."""
    array = np.asarray(values, dtype=float)
    array = array[~np.isnan(array)]
    if not len(array):
        return float("nan"), float("nan")
    return float(array.mean()), float(array.std())


def seed_table(records: list[RunRecord]) -> pd.DataFrame:
    """One row per entry: `<column>_mean` and `<column>_std` for every SUMMARY_COLUMNS column."""
    table = pd.DataFrame(index=pd.MultiIndex.from_tuples(
        list(dict.fromkeys((r.entry.group, r.entry.label) for r in records)), names=["group", "label"]))
    counts = Counter((r.entry.group, r.entry.label) for r in records)
    table["seeds"] = [counts[key] for key in table.index]
    for column, read in SUMMARY_COLUMNS.items():
        stats = {key: mean_std(values) for key, values in seed_values(records, read).items()}
        if column in OPTIONAL_COLUMNS and all(np.isnan(mean) for mean, _ in stats.values()):
            continue  # no run has it: table.csv as without the option
        table[f"{column}_mean"] = [stats[key][0] for key in table.index]
        table[f"{column}_std"] = [stats[key][1] for key in table.index]
    return table


def format_cell(mean: float, std: float, percent: bool, seeds: int) -> str:
    """"mean ± std" over `seeds` seeds; with one seed the value alone (its std, 0, says nothing)."""
    if np.isnan(mean):
        return "-"
    scale, digits = (100, 2) if percent else (1, 3)
    value = f"{scale * mean:.{digits}f}"
    return value if seeds <= 1 or np.isnan(std) else f"{value} ± {scale * std:.{digits}f}"


def markdown_table(table: pd.DataFrame, columns: tuple[str, ...] = tuple(SUMMARY_COLUMNS)) -> str:
    """The seed table as Markdown: percent columns as mean ± std in %, the others in their unit
    (optional columns such as new_clients added where the table has them)."""
    columns = tuple(c for c in with_optional_columns(columns, table) if f"{c}_mean" in table)
    groups = table.index.get_level_values("group")
    first = ["method"] if not any(groups) else ["setting", "method"]
    header = first + ["seeds"] + list(columns)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for (group, label), row in table.iterrows():
        cells = ([label] if not any(groups) else [group, label]) + [str(int(row["seeds"]))]
        cells += [format_cell(row[f"{c}_mean"], row[f"{c}_std"], c in PERCENT_COLUMNS, int(row["seeds"]))
                  for c in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


SPREAD_NOTE = "mean ± std over seeds (population std, ddof=0; a method with one seed: its value alone); "
ONE_SEED_NOTE = "one seed: each cell is that run's value; "
TABLE_NOTE = ("accuracies in %: best = best round (chosen on test data, optimistic), last5 = mean of the last 5 "
              "evaluated rounds, weighted by test samples unless _unweighted; worst_client, many/medium/few: last "
              "evaluated round; MB_per_round: bytes up + down of all clients; s_per_round: wall time of a round "
              "(training and evaluation), the mean over the rounds after the first, which pays one-off start-up "
              "(imports, warm-up; summary.json's sec_first_round).")
EPSILON_NOTE = (" epsilon: the (epsilon, dp.delta) guarantee of a run with dp after its rounds (summary.json's "
                "epsilon and delta).")


def one_seed(table: pd.DataFrame) -> bool:
    """Every row of a seed table (or of table.csv read back) holds one seed."""
    return bool((table["seeds"] <= 1).all())


def table_note(table: pd.DataFrame) -> str:
    """What the cells of `table` are: the spread over seeds (or one seed's values), the columns, and
    the optional columns it has."""
    note = (ONE_SEED_NOTE if one_seed(table) else SPREAD_NOTE) + TABLE_NOTE
    note += NEW_CLIENTS_NOTE if "new_clients_mean" in table else ""
    return note + (EPSILON_NOTE if "epsilon_mean" in table else "")


def write_seed_table(out_dir: Path, records: list[RunRecord]) -> pd.DataFrame:
    table = seed_table(records)
    atomic_write_text(out_dir / "table.csv", table.to_csv())
    atomic_write_text(out_dir / "table.md", markdown_table(table) + "\n\n" + table_note(table) + "\n")
    return table


# ---- entries of `pfedkit compare` (--tuned: methods tuned with the same budget) ---------------

TUNED_SUFFIX = " (tuned)"


def compare_entries(source, overrides: list[str], names: list[str], tuned_dir: str | Path | None = None,
                    log: Callable[[str], None] = lambda text: print(text, file=sys.stderr)
                    ) -> tuple[list[Entry], dict[str, Any]]:
    """One entry per algorithm, and the manifest's `tuned` record. With `tuned_dir` (a `pfedkit
    tune` directory), an algorithm with DIR/<algorithm>/best.yaml runs with its tuned parameters
    (label `NAME (tuned)`), the others with their defaults; a ConfigWarning names tuned methods
    whose studies had other budgets or other settings than this comparison."""
    import warnings

    from pfedkit.algorithms import algorithm_names
    from pfedkit.core.errors import ConfigWarning
    from pfedkit.experiments.tuning import read_tuned, tuned_config, tuned_setting_changes

    entries, record = [], {}
    for name in names:
        tuned = read_tuned(tuned_dir, name) if tuned_dir is not None else None
        if tuned is None:
            config = load_config(source, overrides + [f"algorithm={name}"], expected_sections=algorithm_names())
            entries.append(Entry(name, config.to_dict()))
            continue
        config = tuned_config(source, overrides, name, tuned, expected_sections=algorithm_names())
        changes = tuned_setting_changes(tuned, config)
        if changes:
            warnings.warn(f"{name} was tuned with other settings than this comparison ({changes})",
                          ConfigWarning, stacklevel=2)
        entries.append(Entry(name + TUNED_SUFFIX, config.to_dict()))
        record[name] = {"params": tuned.params, "trials": tuned.trials}
    if tuned_dir is not None:
        budgets = {name: item["trials"] for name, item in record.items()}
        defaults = [name for name in names if name not in record]
        log(f"tuned ({tuned_dir}): " + (", ".join(f"{n} {t} trials" for n, t in budgets.items()) or "none")
            + (f"; defaults: {', '.join(defaults)} (no best.yaml)" if defaults else ""))
        if len(set(budgets.values())) > 1:
            warnings.warn(f"the tuned methods had different budgets ({', '.join(f'{n}: {t}' for n, t in budgets.items())} "
                          "trials); tune them with the same --trials for a fair table", ConfigWarning, stacklevel=2)
    return entries, ({"tuned": {"dir": str(tuned_dir), "algorithms": record}} if tuned_dir is not None else {})
