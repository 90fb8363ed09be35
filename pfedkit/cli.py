"""Command line: `pfedkit run | compare | tune | reproduce | report | list | config | bench | flower |
data stats | data fetch | data export` (see README).

Configuration errors end with one line on stderr naming the key and exit status 2. A command
imports what it computes with (torch, pandas, matplotlib) only after its input is checked, and
`list`, `config` and `reproduce --list` never do (names come from pfedkit.catalog), so they and
every refusal answer at once. A flag that is also a config key takes either spelling
(`flag_settings`).
"""
from __future__ import annotations

import argparse
import errno
import os
import textwrap
import sys
import warnings
from pathlib import Path
from typing import Any

from pfedkit.catalog import catalog
from pfedkit.core.backends import BACKENDS
from pfedkit.core.errors import ConfigError, ConfigWarning, did_you_mean
from pfedkit.writable import check_writable_dir, check_writable_file

EXIT_BAD_INPUT = 2
# `pfedkit compare`'s default (the README quickstart): a personalised method beside the two
# baselines it should beat, on the embedded digits job.
DEFAULT_COMPARE = "local,fedavg,fedper"
EXIT_DIVERGED = 3  # training loss became NaN or infinite (see TrainingDiverged)


def _user_errors() -> tuple[type[Exception], ...]:
    from pfedkit.data.datasets import DataError
    from pfedkit.data.partition import PartitionError

    return ConfigError, PartitionError, DataError


def _diverged() -> type[Exception]:
    from pfedkit.engine.drive import TrainingDiverged  # imported only when an error reaches here

    return TrainingDiverged


# OSErrors that mean "this path cannot be written here" (a bad path given by the user), as opposed
# to a failing disk or a bug: one line and exit 2 instead of a traceback.
PATH_ERRNOS = (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EISDIR, errno.ENAMETOOLONG)


def _show_warning(previous):
    """A `warnings.showwarning` printing ConfigWarnings as one `warning:` line on stderr and
    handing the others to `previous`."""
    def show(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, ConfigWarning):
            print(f"warning: {message}", file=sys.stderr)
        else:
            previous(message, category, filename, lineno, file, line)
    return show


def cmd_run(ns: argparse.Namespace) -> int:
    from pfedkit.config import load_config, split_config_and_overrides

    source, overrides = split_config_and_overrides(ns.items)
    if ns.resume and (source or overrides):
        raise ConfigError("--resume takes no config or overrides: the run directory's config.yaml is used")
    config = None if ns.resume else load_config(source, overrides)
    if config is None:
        check_writable_dir(Path(ns.resume), "--resume")
    else:
        check_writable_dir(Path(config.out_dir), "out_dir")
    from pfedkit.report.summary_table import results_table
    from pfedkit.runs import run

    result = run(config, resume=ns.resume, quiet=ns.quiet)
    print(results_table([result.summary]))
    print(f"run directory: {result.run_dir}")
    return 0


def parse_seeds(text: str) -> list[int]:
    """`0,1,2` or `0-4` -> seeds; ConfigError for anything else."""
    try:
        if "-" in text.strip().lstrip("-"):
            first, last = (int(part) for part in text.split("-", 1))
            seeds = list(range(first, last + 1))
        else:
            seeds = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        seeds = []
    if not seeds or len(set(seeds)) != len(seeds):
        raise ConfigError(f"--seeds {text}: expected distinct integers like 0,1,2 or a range like 0-4")
    return seeds


def cmd_compare(ns: argparse.Namespace) -> int:
    from datetime import datetime

    from pfedkit.config import load_config, split_config_and_overrides

    source, overrides = split_config_and_overrides(ns.items)
    names = algorithm_list(ns.algorithms)
    # Sections of the compared algorithms are expected; any other algorithm's is warned about once.
    base = load_config(source, overrides, expected_sections=names)
    if ns.tuned is not None and not Path(ns.tuned).is_dir():
        raise ConfigError(f"--tuned {ns.tuned}: not a directory; expected a pfedkit tune --out directory")
    from pfedkit.experiments.comparison import compare_entries, markdown_table, run_comparison, write_seed_table

    # --tuned: algorithms with DIR/<algorithm>/best.yaml run with their tuned parameters
    entries, tuned_record = compare_entries(source, overrides, names, ns.tuned)
    out = Path(ns.out) if ns.out else Path(base.out_dir) / f"compare-{datetime.now():%Y%m%d-%H%M%S}"
    check_writable_dir(out, "--out" if ns.out else "out_dir")
    records = run_comparison(out, entries, parse_seeds(ns.seeds), quiet=ns.quiet,
                             extra={"kind": "compare", **tuned_record},
                             after_each=lambda finished: write_seed_table(out, finished))  # a cut sweep keeps its table
    table = write_seed_table(out, records)
    print(markdown_table(table, COMPACT))
    print(f"comparison directory: {out} (table.md, table.csv; the same command with --out {out} resumes)")
    return 0


def algorithm_list(text: str) -> list[str]:
    """`--algorithms a,b` as names; ConfigError for none, a name given twice or an unknown one."""
    from pfedkit.config import unknown_algorithm

    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names or len(set(names)) != len(names):
        raise ConfigError(f"--algorithms {text}: expected distinct algorithm names, comma-separated (pfedkit list)")
    for name in names:
        if name not in catalog().algorithms:
            raise ConfigError(f"--algorithms {text}: {unknown_algorithm(name)}")
    return names


def cmd_tune(ns: argparse.Namespace) -> int:
    from pfedkit.config import load_config, split_config_and_overrides

    source, overrides = split_config_and_overrides(ns.items)
    names = algorithm_list(ns.algorithms) if ns.algorithms is not None else []
    # Without --algorithms: the config's algorithm. With several: each is tuned in turn, in OUT/NAME.
    configs = [load_config(source, overrides + [f"algorithm={name}"], expected_sections=names) for name in names] \
        or [load_config(source, overrides)]
    out = Path(ns.out) if ns.out else Path(configs[0].out_dir) / "tune"
    check_writable_dir(out, "--out" if ns.out else "out_dir")
    from pfedkit.experiments.tuning import tune, tuning_base

    for config in configs[1:]:  # every search space checked before the first study starts
        tuning_base(config, ns.space, log=lambda note: None)
    for config in configs:
        result = tune(config, ns.trials, out, ns.space)
        params = " ".join(f"{key}={value}" for key, value in result.best_params.items())
        print(f"{config.algorithm}: best of {result.finished} trials: trial {result.best_trial}, validation "
              f"{100 * result.best_value:.2f}%: {params}")
        print(f"tuning directory: {result.directory} (best.yaml, best_config.yaml, trials.csv)")
    print(f"pfedkit compare CONFIG --tuned {out} --algorithms ... runs the tuned configs over seeds")
    return 0


COMPACT = ("best", "last5", "best_unweighted", "last5_unweighted", "worst_client", "MB_per_round", "s_per_round")


def column_positions(text: str) -> list[int]:
    """`--columns 2,1` as [2, 1]; ConfigError (one line) for a part that is not a column number."""
    parts = [part.strip() for part in text.split(",") if part.strip()]
    if not parts or not all(part.isdigit() for part in parts):
        raise ConfigError(f"--columns {text}: column numbers as --list shows them, comma-separated (e.g. 2 or 1,2)")
    return [int(part) for part in parts]


def cmd_reproduce(ns: argparse.Namespace) -> int:
    from pfedkit.config import parse_overrides
    from pfedkit.experiments.paper_list import list_paper, list_papers
    from pfedkit.experiments.paper_presets import PAPERS, load_paper

    if ns.list:
        data_dir = parse_overrides(ns.overrides).get("data_dir")  # where --list looks for each table's data
        print(list_paper(load_paper(ns.paper), data_dir) if ns.paper else list_papers())
        return 0
    if ns.paper is None:
        raise ConfigError(f"reproduce: name a paper ({', '.join(PAPERS)}); pfedkit reproduce --list shows their tables")
    from pfedkit.experiments.reproduce import reproduce

    out_root = ns.out or parse_overrides(ns.overrides).get("out_dir") or "runs"
    check_writable_dir(Path(str(out_root)), "--out" if ns.out else "out_dir")
    tables = [t.strip() for t in ns.table.split(",")] if ns.table else None
    rows = [r.strip() for r in ns.rows.split(",") if r.strip()] if ns.rows else None
    columns = column_positions(ns.columns) if ns.columns else None
    for out_dir, _ in reproduce(ns.paper, tables, ns.budget, ns.overrides, out=ns.out, quiet=ns.quiet,
                                 reuse=ns.reuse, table_only=ns.table_only, seeds=ns.seeds, rows=rows,
                                 columns=columns):
        print((out_dir / "paper.md").read_text())
        print(f"directory: {out_dir} (paper.md/.csv beside the paper; table.md/.csv every number)")
    return 0


def algorithm_options(name: str, detailed: bool) -> str:
    """An algorithm's options with defaults (from the catalog): one line (`key=default, ...`) or
    one line per option with its description and the range `pfedkit tune` searches, if any."""
    entry = catalog().algorithms[name]
    if not detailed:
        return ", ".join(f"{key}={option.default}" for key, option in entry.options.items())
    lines = [f"{name}: {entry.description}"]
    lines += [f"  {name}.{key}={option.default}  {option.description}".rstrip()
              + (f" (tune: {option.searched})" if option.searched else "") for key, option in entry.options.items()]
    return "\n".join(lines if entry.options else lines + ["  (no options)"])


def cmd_list(ns: argparse.Namespace) -> int:
    from pfedkit.config import SCHEME_PARAMS, preset_names, preset_summary
    from pfedkit.data.datasets import DATASETS

    algorithms = catalog().algorithms
    if ns.algorithm:
        if ns.algorithm not in algorithms:
            raise ConfigError(f"list {ns.algorithm}: unknown algorithm{did_you_mean(ns.algorithm, algorithms)}; "
                              f"allowed: {', '.join(algorithms)}")
        print(algorithm_options(ns.algorithm, detailed=True))
        return 0
    sections = {
        "algorithms (options: ALGORITHM.KEY=VALUE; details: pfedkit list ALGORITHM):":
            {name: entry.description for name, entry in algorithms.items()},
        "datasets:": {name: info.description for name, info in DATASETS.items()},
        "partitions:": {name: f"parameters: {', '.join(params)}" for name, params in SCHEME_PARAMS.items()},
        "models:": {name: entry.description for name, entry in catalog().models.items()},
        "presets (preset=NAME):": {name: preset_summary(name) for name in preset_names()},
    }
    width = max(len(name) for rows in sections.values() for name in rows)  # one column for every section
    indent = " " * (width + 3)
    for title, rows in sections.items():
        print(title)
        for name, text in rows.items():
            print(f"  {name:<{width}} {text}")
            if name in algorithms and title.startswith("algorithms"):
                options = algorithm_options(name, detailed=False)
                if options:
                    print(textwrap.fill(options, width=100, initial_indent=indent, subsequent_indent=indent))
    return 0


def cmd_config(ns: argparse.Namespace) -> int:
    """Every config key (or those of one section) with its default and description."""
    from pfedkit.config import config_keys

    rows = config_keys()
    if ns.key:
        chosen = [row for row in rows if row[0] == ns.key or row[0].startswith(ns.key + ".")]
        if not chosen:
            names = sorted({key for key, _, _ in rows} | {key.split(".")[0] for key, _, _ in rows})
            raise ConfigError(f"config {ns.key}: no such key or section{did_you_mean(ns.key, names)}; "
                              "pfedkit config lists them all")
        rows = chosen
    settings = [f"{key}={default}" for key, default, _ in rows]
    width = min(max(len(text) for text in settings), 36)
    indent = " " * (width + 4)
    print("config keys with their defaults (in a YAML file, or key=value on the command line; nested keys "
          "dotted; an algorithm's options: pfedkit list ALGORITHM):")
    for setting, (_, _, description) in zip(settings, rows):
        line = f"  {setting:<{width}}  {description}".rstrip()
        print(textwrap.fill(line, width=110, subsequent_indent=indent) if len(line) > 110 else line)
    return 0


def cmd_data_stats(ns: argparse.Namespace) -> int:
    from pfedkit.config import load_config, split_config_and_overrides
    from pfedkit.data.hf import file_label

    source, overrides = split_config_and_overrides(ns.items)
    config = load_config(source, overrides)
    out = Path(ns.out or Path(config.out_dir) / f"data-stats-{file_label(config.dataset)}-{config.partition.scheme}.png")
    check_writable_file(out, "--out" if ns.out else "out_dir")
    from pfedkit.data.federated import split_indices
    from pfedkit.data.stats import client_class_table
    from pfedkit.federation import config_dataset, split_plan
    from pfedkit.report.data_plots import client_class_heatmap

    dataset = config_dataset(config)
    train_index, test_index = split_indices(split_plan(config), dataset)
    table = client_class_table(train_index, test_index, dataset.y, dataset.num_classes)
    print(table.to_string())
    client_class_heatmap(table, out, title=f"{config.dataset}: {config.partition.scheme}, {config.num_clients} clients")
    print(f"heatmap: {out}")
    return 0


def cmd_data_export(ns: argparse.Namespace) -> int:
    from pfedkit.federation import export_partition

    if not ns.items:
        raise ConfigError("data export: give a run directory, or a config file and/or key=value overrides")
    out = Path(ns.out)
    check_writable_dir(out.parent, "--out", given=out)
    written = export_partition(ns.items, out)
    print(f"exported: {written} (datasets.load_from_disk; one split per client, see docs/data.md)")
    return 0


def flag_settings(ns: argparse.Namespace, items: list[str], flags: dict[str, str],
                  defaults: dict[str, Any] | None = None) -> list[str]:
    """Takes the `key=value` items that set one of a command's flags (`flags`: config key -> the
    flag's dest) onto `ns`, so that `--rounds 5` and `rounds=5` are one setting; returns the other
    items. A flag given neither way gets its value in `defaults`. ConfigError when both spellings
    are given with different values."""
    from pfedkit.config import parse_override_value

    rest = []
    for item in items:
        key, _, raw = item.partition("=")
        dest = flags.get(key.strip())
        if dest is None:
            rest.append(item)
            continue
        value, flag = parse_override_value(key, raw), getattr(ns, dest)
        if flag is not None and flag != value:
            raise ConfigError(f"{item} and --{dest.replace('_', '-')} {flag}: two values for one setting; give one")
        setattr(ns, dest, value)
    for dest, default in (defaults or {}).items():
        if getattr(ns, dest) is None:
            setattr(ns, dest, default)
    return rest


def cmd_data_fetch(ns: argparse.Namespace) -> int:
    from pfedkit.data.datasets import resolve_data_dir
    from pfedkit.data.store import checksum_lines

    unknown = flag_settings(ns, ns.overrides, {"data_dir": "data_dir"})
    if unknown:
        raise ConfigError(f"data fetch: {unknown[0]}: not a setting of data fetch; allowed: data_dir=DIR "
                          "(or --data-dir DIR)")
    if ns.data_dir is not None:
        ns.data_dir = str(ns.data_dir)  # data_dir=2024 is a folder name, not a number
    root = resolve_data_dir(ns.data_dir)
    if root is not None:  # refused before any download when the folder cannot be written
        check_writable_dir(root, "--data-dir" if ns.data_dir else "PFEDKIT_DATA")
        checksum_lines(root)  # and when its SHA256SUMS, which the download is recorded in, is damaged
    from pfedkit.data.fetch import fetch

    print(fetch(ns.name, ns.data_dir, progress=not ns.quiet))
    return 0


def cmd_report(ns: argparse.Namespace) -> int:
    from pfedkit.config import parse_overrides
    from pfedkit.report.comparison_report import is_comparison, report_comparison
    from pfedkit.report.run_report import report_run

    options = parse_overrides(ns.options)
    unknown = set(options) - {"tensorboard"}
    if unknown:
        raise ConfigError(f"report: unknown option {', '.join(sorted(unknown))}; allowed: tensorboard=true")
    target = Path(ns.run_dir)
    if not (is_comparison(target) or (target / "metrics.csv").is_file()):
        raise ConfigError(f"report {target.absolute()}: neither a run directory (metrics.csv) nor a comparison "
                          "directory (comparison.json)")
    check_writable_dir(target / "report", "report", fix="copy the directory somewhere writable and report the copy")
    try:
        written = report_comparison(target) if is_comparison(target) else report_run(target)
    except FileNotFoundError as err:
        raise ConfigError(str(err)) from None
    page, parts = written[-1], "the page, its figures" + (" and each run's report" if is_comparison(target) else "")
    if options.get("tensorboard"):
        from pfedkit.report.tensorboard import write_events_of

        written += write_events_of(target)
        parts += f", TensorBoard events in {target / 'report' / 'tensorboard'}"
    print(f"{page} ({len(written)} files written: {parts})")  # the page to open, not every path
    return 0


# `pfedkit bench`'s flags that are config keys (key -> flag), and their defaults: each can be given
# either way (`--clients 5` or `num_clients=5`).
BENCH_FLAGS = {"rounds": "rounds", "num_clients": "clients", "dataset": "dataset", "data_dir": "data_dir",
               "algorithm": "algorithm", "backend": "backend", "workers": "workers", "partition.alpha": "alpha",
               "precision": "precision", "compile": "compile"}
BENCH_DEFAULTS = {"rounds": 3, "clients": 20, "dataset": "mnist", "algorithm": "fedavg", "backend": "sequential",
                  "alpha": 0.1, "precision": "fp32", "compile": False}


def cmd_bench(ns: argparse.Namespace) -> int:
    ns.overrides = flag_settings(ns, ns.overrides, BENCH_FLAGS, BENCH_DEFAULTS)
    from pfedkit.bench import format_bench, run_bench

    print(format_bench(run_bench(ns)))
    return 0


KEYS_EPILOG = "config keys and their defaults: pfedkit config (one section: pfedkit config dp)"


def _add_run(sub) -> None:
    """`pfedkit run`."""
    p_run = sub.add_parser("run", help="run one simulation (no config: the embedded default job)",
                           epilog=KEYS_EPILOG)
    p_run.add_argument("items", nargs="*", help="[CONFIG.yaml] [key=value ...] (dotted keys for nested values)")
    p_run.add_argument("--resume", metavar="DIR", help="continue a killed run from its run directory")
    p_run.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p_run.set_defaults(func=cmd_run)


def _add_compare(sub) -> None:
    """`pfedkit compare`."""
    p_cmp = sub.add_parser("compare", help="several algorithms on the same partitions, over seeds: mean ± std",
                           epilog=KEYS_EPILOG)
    p_cmp.add_argument("items", nargs="*", help="[CONFIG.yaml] [key=value ...]")
    p_cmp.add_argument("--algorithms", "--algorithm", dest="algorithms", default=DEFAULT_COMPARE, metavar="NAMES",
                       help="comma-separated names (default: %(default)s; all: pfedkit list)")
    p_cmp.add_argument("--seeds", default="0", help="0,1,2 or 0-4 (default 0)")
    p_cmp.add_argument("--out", help="comparison directory (default OUT_DIR/compare-TIMESTAMP); "
                       "an existing one resumes")
    p_cmp.add_argument("--tuned", metavar="DIR", help="a pfedkit tune directory: algorithms with DIR/ALGORITHM/"
                       "best.yaml run with their tuned parameters, the others with their defaults")
    p_cmp.add_argument("-q", "--quiet", action="store_true")
    p_cmp.set_defaults(func=cmd_compare)


def _add_tune(sub) -> None:
    """`pfedkit tune`."""
    p_tune = sub.add_parser("tune", help="tune an algorithm's hyperparameters on a validation split (Optuna TPE, "
                            "median pruning); resumable", epilog=KEYS_EPILOG)
    p_tune.add_argument("items", nargs="*", help="[CONFIG.yaml] [key=value ...] (validation_fraction=0.2 by default)")
    p_tune.add_argument("--algorithms", "--algorithm", dest="algorithms", metavar="NAMES",
                        help="the algorithm(s) to tune, comma-separated, one after another, each in OUT/NAME "
                        "(default: the config's algorithm; pfedkit list)")
    p_tune.add_argument("--trials", type=int, required=True,
                        help="finished trials in total (a rerun with more continues the study)")
    p_tune.add_argument("--space", metavar="FILE", help="search-space YAML replacing the shipped spaces "
                        "(lr, and the ranges the algorithms declare on their options; see docs/tuning.md)")
    p_tune.add_argument("--out", metavar="DIR", help="tuning directory (default OUT_DIR/tune); the study goes "
                        "in DIR/ALGORITHM and a rerun resumes it")
    p_tune.set_defaults(func=cmd_tune)


def _add_reproduce(sub) -> None:
    """`pfedkit reproduce`."""
    p_rep = sub.add_parser("reproduce", help="a paper's table at a budget, our mean ± std beside the paper's numbers")
    p_rep.add_argument("paper", nargs="?", help="fedrema, pfedpm, cwfedavg, pfedcs or dapfl "
                       "(--list without a paper: every paper's tables)")
    p_rep.add_argument("overrides", nargs="*", help="key=value applied last (e.g. data_dir=..., backend=sequential)")
    p_rep.add_argument("--table", help="table id(s), comma-separated (default: all; see --list)")
    p_rep.add_argument("--budget", default="cpu", choices=["smoke", "cpu", "regime", "paper"],
                       help="smoke: ~1 minute; cpu: <= 1 hour per table on 2 cores; regime: the paper's per-round "
                       "regime (its epochs, batch, lr, samples per client) with fewer clients/rounds, headline "
                       "tables only; paper: the full setting")
    p_rep.add_argument("--list", action="store_true", help="the paper's tables, rows and budgets (no paper: "
                       "all papers' tables, and why the others cannot be rebuilt)")
    p_rep.add_argument("--rows", help="run only these methods, comma-separated, in this order (names as in --list; "
                       "a row the budget leaves out runs at the budget's settings); the table keeps the rows "
                       "finished earlier in its directory")
    p_rep.add_argument("--columns", metavar="N,N", help="run only these columns, by their number in --list "
                       "(1 = the first), comma-separated, in this order (a column the budget leaves out runs at "
                       "the budget's settings); the table keeps the cells finished earlier in its directory")
    p_rep.add_argument("--seeds", type=int, metavar="N", help="seeds 0..N-1 instead of the budget's (finished "
                       "seeds are reused: --seeds 2 after a 1-seed table runs seed 1 only)")
    p_rep.add_argument("--out", help="directory (default OUT_DIR/reproduce/PAPER-TABLE-BUDGET: reruns resume)")
    p_rep.add_argument("--reuse", metavar="DIR", help="start from the finished runs in DIR (run directories with "
                       "config.yaml and summary.json, e.g. docs/results/fedrema-1-mnist-regime): those this table "
                       "runs with the same settings are reused, the rest run")
    p_rep.add_argument("--table-only", action="store_true", help="write paper.md and table.md from the runs "
                       "already finished in the directory (with --reuse DIR: those of DIR) and run nothing")
    p_rep.add_argument("-q", "--quiet", action="store_true")
    p_rep.set_defaults(func=cmd_reproduce)


def _add_list(sub) -> None:
    """`pfedkit list`."""
    p_list = sub.add_parser("list", help="registered algorithms, datasets, partitions and models")
    p_list.add_argument("algorithm", nargs="?", help="show this algorithm's options with their descriptions")
    p_list.set_defaults(func=cmd_list)


def _add_config(sub) -> None:
    """`pfedkit config`."""
    p_config = sub.add_parser("config", help="every config key with its default and description")
    p_config.add_argument("key", nargs="?", help="only this key or section (e.g. dp, partition.alpha)")
    p_config.set_defaults(func=cmd_config)


def _add_report(sub) -> None:
    """`pfedkit report`."""
    p_report = sub.add_parser("report", help="an HTML page (report/index.html) for a run or a comparison")
    p_report.add_argument("run_dir", help="a run, comparison or reproduce directory")
    p_report.add_argument("options", nargs="*", help="tensorboard=true: also write TensorBoard event files")
    p_report.set_defaults(func=cmd_report)


def _add_bench(sub) -> None:
    """`pfedkit bench`."""
    p_bench = sub.add_parser("bench", help="seconds per round and fraction of matmul peak (FedAvg, MNIST, Dir 0.1, CNN, B=10)")
    p_bench.add_argument("overrides", nargs="*", help="extra key=value config overrides (e.g. channels_last=false); "
                         "a flag's own key sets that flag (rounds=5 is --rounds 5, num_clients=5 is --clients 5)")
    default = BENCH_DEFAULTS
    p_bench.add_argument("--rounds", type=int, help=f"rounds timed, or rounds=N (default: {default['rounds']})")
    p_bench.add_argument("--backend", choices=BACKENDS,
                         help=f"how a round's clients train, or backend=NAME (default: {default['backend']})")
    p_bench.add_argument("--workers", type=int, default=None, help="processes / ray: worker count, or workers=N "
                         "(default: one per core; ray: the cluster's CPUs)")
    p_bench.add_argument("--clients", type=int, help=f"num_clients, all taking part, or num_clients=N "
                         f"(default: {default['clients']})")
    p_bench.add_argument("--dataset", help=f"dataset, or dataset=NAME (default: {default['dataset']}; see pfedkit list)")
    p_bench.add_argument("--data-dir", default=None,
                         help="folder holding DATASET/DATASET.npz.xz, or data_dir=DIR (default: $PFEDKIT_DATA)")
    p_bench.add_argument("--algorithm", help=f"algorithm, or algorithm=NAME (default: {default['algorithm']}; "
                         "see pfedkit list)")
    p_bench.add_argument("--alpha", type=float, help="Dirichlet concentration of the partition, or "
                         f"partition.alpha=A (default: {default['alpha']})")
    p_bench.add_argument("--precision", choices=["fp32", "bf16"], help="bf16: autocast, only where the CPU or GPU "
                         f"has native bf16; or precision=NAME (default: {default['precision']})")
    p_bench.add_argument("--compile", action="store_true", default=None,
                         help="torch.compile the local training step, or compile=true")
    p_bench.add_argument("--parity", action="store_true",
                         help="also run 10 rounds at fp32 and at bf16 and compare their accuracy")
    p_bench.set_defaults(func=cmd_bench)


def _add_flower(sub) -> None:
    """`pfedkit flower simulate | app | local | certs` (`pfedkit.flower.commands`)."""
    from pfedkit.flower.commands import add_parser as add_flower_parser
    add_flower_parser(sub)


def _add_data_stats(data_sub) -> None:
    """`pfedkit data stats`."""
    p_stats = data_sub.add_parser("stats", help="per-client class counts and a heatmap PNG")
    p_stats.add_argument("items", nargs="*", help="[CONFIG.yaml] [key=value ...]")
    p_stats.add_argument("--out", help="PNG path (default: OUT_DIR/data-stats-DATASET-SCHEME.png)")
    p_stats.set_defaults(func=cmd_data_stats)


def _add_data_fetch(data_sub) -> None:
    """`pfedkit data fetch`."""
    from pfedkit.data.fetch import fetchable

    p_fetch = data_sub.add_parser("fetch", help="download a dataset from its public source and convert it "
                                  "(mnist, fashion_mnist, cifar10, cifar100, ...; ag_news: tokenised text)")
    p_fetch.add_argument("name", help=f"dataset to fetch: {', '.join(fetchable())}")
    p_fetch.add_argument("overrides", nargs="*", metavar="data_dir=DIR", help="the same as --data-dir DIR")
    p_fetch.add_argument("--data-dir", default=None, help="folder to put NAME/NAME.npz.xz in, or data_dir=DIR "
                         "(default: $PFEDKIT_DATA)")
    p_fetch.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p_fetch.set_defaults(func=cmd_data_fetch)


def _add_data_export(data_sub) -> None:
    """`pfedkit data export`."""
    p_export = data_sub.add_parser("export", help="a run's partition as a Hugging Face DatasetDict (one split "
                                   "per client) for flwr-datasets / datasets.load_from_disk")
    p_export.add_argument("items", nargs="*", help="RUN_DIR, or [CONFIG.yaml] [key=value ...]")
    p_export.add_argument("--out", required=True, help="new (or empty) folder to write the DatasetDict into")
    p_export.set_defaults(func=cmd_data_export)


def _add_data(sub) -> None:
    """`pfedkit data stats | fetch | export`."""
    p_data = sub.add_parser("data", help="dataset tools")
    data_sub = p_data.add_subparsers(dest="data_command", required=True)
    for add in (_add_data_stats, _add_data_fetch, _add_data_export):
        add(data_sub)


# The subcommands in the order `pfedkit --help` lists them.
SUBCOMMANDS = (_add_run, _add_compare, _add_tune, _add_reproduce, _add_list, _add_config, _add_report, _add_bench,
               _add_flower, _add_data)


def build_parser() -> argparse.ArgumentParser:
    from pfedkit import __version__

    parser = argparse.ArgumentParser(prog="pfedkit", description="Personalized federated learning simulations.")
    parser.add_argument("--version", action="version", version=f"pfedkit {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in SUBCOMMANDS:
        add(sub)
    return parser


def run_command(ns: argparse.Namespace) -> int:
    """The chosen command, its ConfigWarnings printed as one line each (every time: a warning
    belongs to each run that has it, not only to the first run of a process)."""
    with warnings.catch_warnings():
        warnings.simplefilter("always", ConfigWarning)
        warnings.showwarning = _show_warning(warnings.showwarning)
        return ns.func(ns)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # Options may come before, between or after key=value items: collect the leftovers as items.
    ns, leftovers = parser.parse_known_args(argv)
    if leftovers:
        unknown_options = [item for item in leftovers if item.startswith("-")]
        positional = "items" if hasattr(ns, "items") else "overrides" if hasattr(ns, "overrides") else None
        if unknown_options or positional is None:
            parser.error(f"unrecognized arguments: {' '.join(leftovers)}")
        setattr(ns, positional, list(getattr(ns, positional)) + leftovers)
    try:
        return run_command(ns)
    except _user_errors() as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except BrokenPipeError:  # output piped into `head` and the like: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        print("interrupted: resume with `pfedkit run --resume RUN_DIR` (the run directory printed above)",
              file=sys.stderr)
        return 130
    except OSError as err:
        if err.errno not in PATH_ERRNOS or err.filename is None:
            raise
        print(f"error: cannot write {err.filename}: {err.strerror}; choose another path", file=sys.stderr)
        return EXIT_BAD_INPUT
    except _diverged() as err:  # last: only an error nothing above caught imports the engine
        print(f"error: {err}", file=sys.stderr)
        return EXIT_DIVERGED


if __name__ == "__main__":
    sys.exit(main())
