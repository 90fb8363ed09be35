"""Command line: `pfedkit run | compare | reproduce | report | list | bench | flower | data stats` (see README).

Configuration errors end with one line on stderr naming the key and exit status 2.
"""
from __future__ import annotations

import argparse
import os
import textwrap
import sys
from pathlib import Path

from pfedkit.config import ConfigError

EXIT_BAD_INPUT = 2


def _user_errors() -> tuple[type[Exception], ...]:
    from pfedkit.data.datasets import DataError
    from pfedkit.data.partition import PartitionError

    return ConfigError, PartitionError, DataError


def split_config_and_overrides(items: list[str]) -> tuple[str | None, list[str]]:
    """The first item is a config file unless it looks like key=value."""
    if items and "=" not in items[0]:
        return items[0], items[1:]
    return None, items


def results_table(summaries: list[dict]) -> str:
    header = (f"{'algorithm':<12} {'headline':>9} {'final acc':>9} {'last-5 acc':>10} {'best acc':>8} "
              f"{'best round':>10} {'MB up':>8} {'seconds':>8}")
    lines = [header, "-" * len(header)]
    for s in summaries:
        lines.append(f"{s['algorithm']:<12} {_pct(s.get('headline_acc')):>9} {_pct(s['final_acc']):>9} "
                     f"{_pct(s['last5_acc']):>10} {_pct(s['best_acc']):>8} {str(s['best_round']):>10} "
                     f"{s['bytes_up'] / 1e6:>8.2f} {s['seconds']:>8.1f}")
    headlines = sorted({s.get("headline", "") for s in summaries} - {""})
    lines.append("headline: " + " | ".join(headlines) if headlines else "")
    lines.append("other columns: sample-weighted mean over clients' test splits; best round is chosen on test data")
    return "\n".join(line for line in lines if line)


def _pct(value) -> str:
    return "-" if value is None else f"{100 * value:.2f}%"


def cmd_run(ns: argparse.Namespace) -> int:
    from pfedkit.runs import run

    source, overrides = split_config_and_overrides(ns.items)
    if ns.resume and (source or overrides):
        raise ConfigError("--resume takes no config or overrides: the run directory's config.yaml is used")
    result = run(source, overrides, resume=ns.resume, quiet=ns.quiet)
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

    from pfedkit.config import load_config
    from pfedkit.experiments.comparison import Entry, markdown_table, run_comparison, write_seed_table

    source, overrides = split_config_and_overrides(ns.items)
    names = [a.strip() for a in ns.algorithms.split(",") if a.strip()]
    if len(set(names)) != len(names):
        raise ConfigError(f"--algorithms {ns.algorithms}: a name appears twice")
    base = load_config(source, overrides)
    entries = [Entry(name, load_config(source, overrides + [f"algorithm={name}"]).to_dict()) for name in names]
    out = Path(ns.out) if ns.out else Path(base.out_dir) / f"compare-{datetime.now():%Y%m%d-%H%M%S}"
    records = run_comparison(out, entries, parse_seeds(ns.seeds), quiet=ns.quiet, extra={"kind": "compare"})
    table = write_seed_table(out, records)
    print(markdown_table(table, COMPACT))
    print(f"comparison directory: {out} (table.md, table.csv; the same command with --out {out} resumes)")
    return 0


COMPACT = ("best", "last5", "best_unweighted", "last5_unweighted", "worst_client", "MB_per_round", "s_per_round")


def cmd_reproduce(ns: argparse.Namespace) -> int:
    from pfedkit.experiments.paper_presets import load_paper
    from pfedkit.experiments.reproduce import list_paper, reproduce

    if ns.list:
        print(list_paper(load_paper(ns.paper)))
        return 0
    tables = [t.strip() for t in ns.table.split(",")] if ns.table else None
    for out_dir, _ in reproduce(ns.paper, tables, ns.budget, ns.overrides, out=ns.out, quiet=ns.quiet):
        print((out_dir / "paper.md").read_text())
        print(f"directory: {out_dir} (paper.md/.csv beside the paper; table.md/.csv every number)")
    return 0


def algorithm_options(algorithm, detailed: bool) -> str:
    """An algorithm's options with defaults: one line (`key=default, ...`) or one line per option
    with its description."""
    fields = algorithm.Hyper.model_fields
    if not detailed:
        return ", ".join(f"{key}={field.default}" for key, field in fields.items())
    lines = [f"{algorithm.name}: {algorithm.description}"]
    lines += [f"  {algorithm.name}.{key}={field.default}  {field.description or ''}".rstrip()
              for key, field in fields.items()]
    return "\n".join(lines if fields else lines + ["  (no options)"])


def cmd_list(ns: argparse.Namespace) -> int:
    from pfedkit.algorithms import algorithm_names, get_algorithm
    from pfedkit.config import SCHEME_PARAMS, preset_names, preset_summary
    from pfedkit.data.datasets import DATASETS
    from pfedkit.models import MODELS

    if ns.algorithm:
        if ns.algorithm not in algorithm_names():
            raise ConfigError(f"list {ns.algorithm}: unknown algorithm; allowed: {', '.join(algorithm_names())}")
        print(algorithm_options(get_algorithm(ns.algorithm), detailed=True))
        return 0
    print("algorithms (options: ALGORITHM.KEY=VALUE; details: pfedkit list ALGORITHM):")
    for name in algorithm_names():
        print(f"  {name:<14} {get_algorithm(name).description}")
        options = algorithm_options(get_algorithm(name), detailed=False)
        if options:
            print(textwrap.fill(options, width=100, initial_indent=" " * 17, subsequent_indent=" " * 17))
    print("datasets:")
    for name, info in DATASETS.items():
        print(f"  {name:<14} {info.description}")
    print("partitions:")
    for name, params in SCHEME_PARAMS.items():
        print(f"  {name:<14} parameters: {', '.join(params)}")
    print("models:")
    for name, info in MODELS.items():
        print(f"  {name:<14} {info.description}")
    print("presets (preset=NAME):")
    for name in preset_names():
        print(f"  {name:<14} {preset_summary(name)}")
    return 0


def cmd_data_stats(ns: argparse.Namespace) -> int:
    from pfedkit.config import load_config
    from pfedkit.data.datasets import load_dataset
    from pfedkit.data.federated import split_indices
    from pfedkit.data.stats import client_class_table, write_heatmap

    source, overrides = split_config_and_overrides(ns.items)
    config = load_config(source, overrides)
    dataset = load_dataset(config.dataset, config.data_dir)
    train_index, test_index = split_indices(config, dataset)
    table = client_class_table(train_index, test_index, dataset.y, dataset.num_classes)
    print(table.to_string())
    out = Path(ns.out or Path(config.out_dir) / f"data-stats-{config.dataset}-{config.partition.scheme}.png")
    write_heatmap(table, out, title=f"{config.dataset}: {config.partition.scheme}, {config.num_clients} clients")
    print(f"heatmap: {out}")
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
    try:
        written = report_comparison(target) if is_comparison(target) else report_run(target)
    except FileNotFoundError as err:
        raise ConfigError(str(err)) from None
    if options.get("tensorboard"):
        from pfedkit.report.tensorboard import write_events_of

        written += write_events_of(target)
    for path in written:
        print(path)
    return 0


def cmd_bench(ns: argparse.Namespace) -> int:
    from pfedkit.bench import format_bench, run_bench

    print(format_bench(run_bench(ns)))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pfedkit", description="Personalized federated learning simulations.")
    sub = parser.add_subparsers(dest="command", required=True)

    p_run = sub.add_parser("run", help="run one simulation (no config: the embedded default job)")
    p_run.add_argument("items", nargs="*", help="[CONFIG.yaml] [key=value ...] (dotted keys for nested values)")
    p_run.add_argument("--resume", metavar="DIR", help="continue a killed run from its run directory")
    p_run.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p_run.set_defaults(func=cmd_run)

    p_cmp = sub.add_parser("compare", help="several algorithms on the same partitions, over seeds: mean ± std")
    p_cmp.add_argument("items", nargs="*", help="[CONFIG.yaml] [key=value ...]")
    p_cmp.add_argument("--algorithms", default="local,fedavg,fedprox", help="comma-separated names")
    p_cmp.add_argument("--seeds", default="0", help="0,1,2 or 0-4 (default 0)")
    p_cmp.add_argument("--out", help="comparison directory (default OUT_DIR/compare-TIMESTAMP); "
                       "an existing one resumes")
    p_cmp.add_argument("-q", "--quiet", action="store_true")
    p_cmp.set_defaults(func=cmd_compare)

    p_rep = sub.add_parser("reproduce", help="a paper's table at a budget, our mean ± std beside the paper's numbers")
    p_rep.add_argument("paper", help="fedrema, pfedpm, cwfedavg, pfedcs or dapfl")
    p_rep.add_argument("overrides", nargs="*", help="key=value applied last (e.g. data_dir=..., backend=sequential)")
    p_rep.add_argument("--table", help="table id(s), comma-separated (default: all; see --list)")
    p_rep.add_argument("--budget", default="cpu", choices=["smoke", "cpu", "paper"],
                       help="smoke: ~1 minute; cpu: <= 1 hour per table on 2 cores; paper: the full setting")
    p_rep.add_argument("--list", action="store_true", help="the paper's tables, rows and budgets")
    p_rep.add_argument("--out", help="directory (default OUT_DIR/reproduce/PAPER-TABLE-BUDGET: reruns resume)")
    p_rep.add_argument("-q", "--quiet", action="store_true")
    p_rep.set_defaults(func=cmd_reproduce)

    p_list = sub.add_parser("list", help="registered algorithms, datasets, partitions and models")
    p_list.add_argument("algorithm", nargs="?", help="show this algorithm's options with their descriptions")
    p_list.set_defaults(func=cmd_list)

    p_report = sub.add_parser("report", help="an HTML page (report/index.html) for a run or a comparison")
    p_report.add_argument("run_dir", help="a run, comparison or reproduce directory")
    p_report.add_argument("options", nargs="*", help="tensorboard=true: also write TensorBoard event files")
    p_report.set_defaults(func=cmd_report)

    p_bench = sub.add_parser("bench", help="seconds per round and fraction of matmul peak (FedAvg, MNIST, Dir 0.1, CNN, B=10)")
    p_bench.add_argument("overrides", nargs="*", help="extra key=value config overrides (e.g. channels_last=false)")
    p_bench.add_argument("--rounds", type=int, default=3)
    p_bench.add_argument("--backend", default="sequential", choices=["sequential", "processes", "vectorized", "ray"])
    p_bench.add_argument("--workers", type=int, default=None)
    p_bench.add_argument("--clients", type=int, default=20)
    p_bench.add_argument("--dataset", default="mnist")
    p_bench.add_argument("--data-dir", default=None, help="default: $PFEDKIT_DATA")
    p_bench.add_argument("--algorithm", default="fedavg")
    p_bench.add_argument("--alpha", type=float, default=0.1)
    p_bench.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    p_bench.add_argument("--compile", action="store_true", help="torch.compile the local training step")
    p_bench.add_argument("--parity", action="store_true",
                         help="also run 10 rounds at fp32 and at bf16 and compare their accuracy")
    p_bench.set_defaults(func=cmd_bench)

    from pfedkit.flower.commands import add_parser as add_flower_parser
    add_flower_parser(sub)

    p_data = sub.add_parser("data", help="dataset tools")
    data_sub = p_data.add_subparsers(dest="data_command", required=True)
    p_stats = data_sub.add_parser("stats", help="per-client class counts and a heatmap PNG")
    p_stats.add_argument("items", nargs="*", help="[CONFIG.yaml] [key=value ...]")
    p_stats.add_argument("--out", help="PNG path (default: OUT_DIR/data-stats-DATASET-SCHEME.png)")
    p_stats.set_defaults(func=cmd_data_stats)
    return parser


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
        return ns.func(ns)
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


if __name__ == "__main__":
    sys.exit(main())
