"""Conformance: a pfedkit method beside PFLlib's or FL-bench's, on the same clients (README.md beside this file).

    python benchmarks/conformance/conformance.py export --split mnist_fedrema --seed 0 --out DIR [--data-dir D]
    python benchmarks/conformance/conformance.py run --pfllib CHECKOUT --scratch SCRATCH \\
        --split mnist_fedrema --method FedAvg --seeds 0 1 [--rounds R] [--side both|pfedkit|PFLlib] \\
        [--device cpu|cuda|cuda:N] [--data-dir D] [--init pfllib|flbench]
    python benchmarks/conformance/conformance.py curves --scratch SCRATCH --split mnist_fedrema \\
        --method FedAvg --seeds 0 1 --out docs/results/conformance/mnist_fedrema/FedAvg.csv
    python benchmarks/conformance/conformance.py run --against FL-bench --flbench CHECKOUT --scratch SCRATCH \\
        --split mnist_fedrema --method FedAvg --seeds 0 1 [--side both|pfedkit|FL-bench]
    python benchmarks/conformance/conformance.py curves --against FL-bench --scratch SCRATCH ... \\
        --out docs/results/conformance/mnist_fedrema/flbench/FedAvg.csv
    python benchmarks/conformance/conformance.py row docs/results/conformance/mnist_fedrema/FedAvg.csv [--rounds R]
    python benchmarks/conformance/conformance.py mapping [--method FedAvg]
    python benchmarks/conformance/conformance.py times LOG    # PFLlib's seconds per round in a log

CHECKOUT is a PFLlib or FL-bench tree the user fetched; nothing is written into it. SCRATCH
(outside the repository) receives the exports, the stubs, PFLlib's working folders, the logs and
pfedkit's run directories. Run from the repository root (the splits' data_dir is ../shared/datasets;
--data-dir replaces it). --device is PFLlib's (-dev, -did); the pfedkit side runs as its config says.
--init pfllib (run and curves, the pfedkit side): pfedkit starts from the very weights PFLlib's run of
the seed starts from (config init_weights), in run directories of their own (METHOD-pfllib-init-sS).
--against FL-bench (run, curves, mapping): the other library is FL-bench (flbench_*.py); pfedkit's side
runs FL-bench's loop (flbench_mapping.FLBENCH_PFEDKIT) in run directories of their own (METHOD-flbench-sS);
--init flbench (with --against FL-bench): pfedkit starts from FL-bench's initial weights of the seed
(METHOD-flbench-init-sS).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parent))

from curves import compare, curve_frame, first_common_round, markdown_row, paired_last10, pfedkit_curve, table_header  # noqa: E402
from flbench_data import export_to_flbench  # noqa: E402
from flbench_mapping import (flbench_arguments, flbench_dataset, flbench_mapping_text,  # noqa: E402
                             flbench_pfedkit_overrides)
from flbench_methods import FLBENCH_METHODS, FLBENCH_NOT_COMPARABLE  # noqa: E402
from flbench_run import (curve_from_client_lines, curve_from_metrics, curve_from_test_results,  # noqa: E402
                         flbench_initial_weights, metrics_file, normalisation, run_flbench, run_folder)
from mapping import METHODS, PROTOCOL, SPLITS, Method, Split, pfedkit_overrides, pfllib_arguments  # noqa: E402
from pfllib_data import MANIFEST, export_to_pfllib  # noqa: E402
from pfllib_run import (curve_from_log, device_from_log, pfllib_initial_weights, run_pfllib,  # noqa: E402
                        time_costs_from_log)

FLBENCH = "FL-bench"
OTHER_LIBRARIES = ("PFLlib", FLBENCH)


def dataset_name(split: Split, seed: int) -> str:
    """PFLlib's -data name of a split's export for a seed (starts with the name its model choice reads)."""
    return f"{split.pfllib_dataset}_pfedkit_{split.name}_s{seed}"


def data_overrides(data_dir: Path | None) -> list[str]:
    """The override that replaces the split's data_dir (none without one)."""
    return [f"data_dir={data_dir.resolve()}"] if data_dir is not None else []


def export_split(split: Split, seed: int, out: Path, data_dir: Path | None = None, normalised=None) -> Path:
    """pfedkit's partition of `split` under `seed`, in PFLlib's format at `out` (kept if complete); in
    FL-bench's with `normalised` = FL-bench's (mean, std) of the dataset."""
    if (out / MANIFEST).is_file():
        return out
    from pfedkit.federation import resolve_partition

    items = [str(split.config), f"seed={seed}", *data_overrides(data_dir)]
    config, dataset, train_index, test_index = resolve_partition(items)
    if normalised is not None:
        return export_to_flbench(out, dataset, train_index, test_index, config.to_dict(), *normalised)
    return export_to_pfllib(out, dataset, train_index, test_index, config.to_dict())


def pfllib_log(scratch: Path, split: Split, method: Method, seed: int) -> Path:
    return scratch / "logs" / split.name / f"PFLlib-{method.label}-s{seed}.log"


def pfedkit_run_dir(scratch: Path, split: Split, method: Method, seed: int, init: str | None = None,
                    against: str = "PFLlib") -> Path:
    variant = f"-{init}-init" if init else ("-flbench" if against == FLBENCH else "")
    return scratch / "pfedkit-runs" / split.name / f"{method.label}{variant}-s{seed}"


def flbench_folder(scratch: Path, split: Split, seed: int, method) -> Path:
    """FL-bench's run folder of a split, seed and method. One per method label: FL-bench writes a run to
    out/<its method>/, and FedAdam, FedYogi and FedAdagrad are all its `fedopt`."""
    return scratch / "flbench" / "run" / f"{split.name}-s{seed}" / method.label


def flbench_export(scratch: Path, split: Split, seed: int) -> Path:
    """The split's export of the seed in FL-bench's format, shared by the methods' run folders."""
    return scratch / "flbench" / "data" / f"{split.name}-s{seed}" / flbench_dataset(split)


def prepare_flbench_folder(checkout: Path, scratch: Path, split: Split, seed: int, method,
                           data_dir: Path | None = None) -> Path:
    """The run folder with the checkout's code and, linked as data/<name>, the split's export of the
    seed (written once, flbench_export)."""
    export, name = flbench_export(scratch, split, seed), flbench_dataset(split)
    if not (export / MANIFEST).is_file():  # FL-bench's mean and std are read only for a new export
        export_split(split, seed, export, data_dir, normalised=normalisation(checkout, scratch, name))
    folder = flbench_folder(scratch, split, seed, method)
    run_folder(checkout, folder)
    if not (folder / "data" / name).exists():
        (folder / "data" / name).symlink_to(export, target_is_directory=True)
    return folder


def flbench_log(scratch: Path, split: Split, method, seed: int) -> Path:
    return scratch / "logs" / split.name / f"FL-bench-{method.label}-s{seed}.log"


def run_flbench_side(checkout: Path, scratch: Path, split: Split, method, seed: int, rounds: int,
                     data_dir: Path | None = None) -> int:
    """FL-bench's run of a method and seed; a finished one (its metrics.csv) is kept."""
    folder = prepare_flbench_folder(checkout, scratch, split, seed, method, data_dir)
    if (done := metrics_file(folder, method.flbench, flbench_dataset(split))) is not None:
        print(f"{done}: finished already; kept (delete its folder to run again)")
        return 0
    arguments = flbench_arguments(method, split, rounds, seed)
    return run_flbench(folder, scratch, arguments, flbench_log(scratch, split, method, seed))


def run_pfllib_side(checkout: Path, scratch: Path, split: Split, method: Method, seed: int, rounds: int,
                    device: str = "cpu", data_dir: Path | None = None) -> int:
    name = dataset_name(split, seed)
    export_split(split, seed, scratch / "run" / "dataset" / name, data_dir)
    arguments = pfllib_arguments(method, split, name, rounds, tag=f"{method.label}-s{seed}", device=device)
    return run_pfllib(checkout, scratch, seed, arguments, pfllib_log(scratch, split, method, seed))


def run_pfedkit_side(scratch: Path, split: Split, method: Method, seed: int, rounds: int,
                     data_dir: Path | None = None, checkout: Path | None = None, init: str | None = None,
                     against: str = "PFLlib") -> int:
    run_dir = pfedkit_run_dir(scratch, split, method, seed, init, against)
    shared = flbench_pfedkit_overrides if against == FLBENCH else pfedkit_overrides
    overrides = shared(method, split, seed, rounds) + data_overrides(data_dir)
    overrides += [f"out_dir={run_dir.parent}", f"name={run_dir.name}"]
    if init == "pfllib":
        weights = pfllib_initial_weights(checkout, scratch, seed, split.pfllib_model,
                                         scratch / "init" / f"{split.name}-s{seed}.pt")
        overrides.append(f"init_weights={weights}")
    elif init == "flbench":
        weights = flbench_initial_weights(checkout, scratch, seed, flbench_dataset(split),
                                          scratch / "init" / f"{split.name}-flbench-s{seed}.pt")
        overrides.append(f"init_weights={weights}")
    command = pfedkit_command(run_dir, [str(split.config), *overrides])
    if command is None:
        print(f"{run_dir}: finished already (summary.json); kept")
        return 0
    log = scratch / "logs" / split.name / f"pfedkit-{run_dir.name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a" if "--resume" in command else "w") as out:
        out.write("# " + " ".join(command[2:]) + "\n")
        out.flush()
        return subprocess.call(command, stdout=out, stderr=subprocess.STDOUT)


def pfedkit_command(run_dir: Path, arguments: list[str]) -> list[str] | None:
    """The pfedkit command of a run directory: None when the run finished (summary.json), a resume
    of it from its last checkpoint when it was cut, else a new run. (A new run into an existing
    directory would go to NAME-2, and the curves would be read from the cut one.)"""
    cli = [sys.executable, "-m", "pfedkit.cli", "run"]
    if (run_dir / "summary.json").is_file():
        return None
    if run_dir.is_dir():
        return [*cli, "--resume", str(run_dir)]
    return [*cli, *arguments]


def flbench_curve(metrics: Path, method, export: Path) -> dict[int, float]:
    """FL-bench's curve of a finished run, read where the method's evaluated model is (method.curve)."""
    if method.curve == "before":
        return curve_from_metrics(metrics)
    log = (metrics.parent / "main.log").read_text()
    if method.curve.startswith("test_results"):
        return curve_from_test_results(log, "after" if method.curve == "test_results_after" else "before")
    manifest = json.loads((export / MANIFEST).read_text())
    return curve_from_client_lines(log, manifest["test_rows"])


def collect_curves(scratch: Path, split: Split, method: Method, seeds: list[int], init: str | None = None,
                   against: str = "PFLlib") -> pd.DataFrame:
    frames = []
    for seed in seeds:
        run_dir = pfedkit_run_dir(scratch, split, method, seed, init, against)
        if (run_dir / "metrics.csv").is_file():
            frames.append(curve_frame("pfedkit", seed, pfedkit_curve(run_dir)))
        if against == FLBENCH:
            folder = flbench_folder(scratch, split, seed, method)
            if (found := metrics_file(folder, method.flbench, flbench_dataset(split))) is not None:
                curve = flbench_curve(found, method, flbench_export(scratch, split, seed))
                frames.append(curve_frame(FLBENCH, seed, {k + method.round_shift: a for k, a in curve.items()}))
            continue
        log = pfllib_log(scratch, split, method, seed)
        if log.is_file():
            curve = curve_from_log(log.read_text(), method.pfllib_evaluation)
            shifted = {rnd + method.pfllib_round_shift: accuracy for rnd, accuracy in curve.items()}
            frames.append(curve_frame("PFLlib", seed, shifted))
    return pd.concat(frames, ignore_index=True)


def mapping_text(method: Method | None) -> str:
    lines = ["shared protocol (pfedkit key = value | PFLlib flag value | note):"]
    lines += [f"  {s.pfedkit_key} = {s.pfedkit_value} | {s.pfllib_flag or '-'} {s.pfllib_value} | {s.note}"
              for s in PROTOCOL]
    for m in [method] if method else METHODS.values():
        options = " ".join(f"{k}={v}" for k, v in m.pfedkit_options.items())
        flags = " ".join(f"{k} {v}" for k, v in m.pfllib_flags.items())
        lines.append(f"{m.label}: pfedkit algorithm={m.pfedkit} {options} | PFLlib -algo {m.pfllib} {flags}")
        lines += [f"  departure: {d}" for d in m.departures]
    return "\n".join(lines)


def parse_arguments(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    export = sub.add_parser("export", help="one split and seed in PFLlib's format")
    export.add_argument("--split", choices=SPLITS, required=True)
    export.add_argument("--seed", type=int, default=0)
    export.add_argument("--out", type=Path, required=True)
    export.add_argument("--data-dir", type=Path, help="the folder holding the datasets (default: the split's)")
    for name in ("run", "curves"):
        command = sub.add_parser(name)
        command.add_argument("--scratch", type=Path, required=True)
        command.add_argument("--split", choices=SPLITS, required=True)
        command.add_argument("--method", choices=sorted(set(METHODS) | set(FLBENCH_METHODS) | set(FLBENCH_NOT_COMPARABLE)),
                             required=True)
        command.add_argument("--against", choices=OTHER_LIBRARIES, default="PFLlib",
                             help="the other library (default PFLlib)")
        command.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
        command.add_argument("--init", choices=["pfllib", "flbench"],
                             help="pfedkit starts from PFLlib's (FL-bench's, with --against FL-bench) initial weights "
                             "of each seed (its own run directories; run: needs --pfllib or --flbench)")
    run = sub.choices["run"]
    run.add_argument("--pfllib", type=Path, help="a PFLlib checkout (needed unless --side pfedkit)")
    run.add_argument("--flbench", type=Path, help="an FL-bench checkout (--against FL-bench, unless --side pfedkit)")
    run.add_argument("--rounds", type=int, help="default: the split's committed rounds")
    run.add_argument("--side", choices=["both", "pfedkit", *OTHER_LIBRARIES], default="both")
    run.add_argument("--device", default="cpu", help="PFLlib's device: cpu, cuda or cuda:N (default cpu)")
    run.add_argument("--data-dir", type=Path, help="the folder holding the datasets (default: the split's)")
    sub.choices["curves"].add_argument("--out", type=Path, required=True)
    row = sub.add_parser("row", help="the table row of a curves file")
    row.add_argument("curves", type=Path)
    row.add_argument("--rounds", type=int, help="default: the last round both sides evaluated")
    row.add_argument("--verdict", default="")
    mapping = sub.add_parser("mapping", help="print the option mapping")
    mapping.add_argument("--method", choices=sorted(set(METHODS) | set(FLBENCH_METHODS)))
    mapping.add_argument("--against", choices=OTHER_LIBRARIES, default="PFLlib")
    times = sub.add_parser("times", help="PFLlib's own seconds per round in a log; a JSON line last")
    times.add_argument("log", type=Path)
    return parser.parse_args(argv)


def chosen_method(ns: argparse.Namespace):
    """The method of --method in the table of --against; SystemExit when that library's table lacks it."""
    table = FLBENCH_METHODS if ns.against == FLBENCH else METHODS
    if ns.against == FLBENCH and ns.method in FLBENCH_NOT_COMPARABLE:
        raise SystemExit(f"--method {ns.method}: not comparable against FL-bench: {FLBENCH_NOT_COMPARABLE[ns.method]}")
    if ns.method not in table:
        raise SystemExit(f"--method {ns.method}: not mapped against {ns.against} (mapped: {', '.join(table)})")
    return table[ns.method]


def command_run(ns: argparse.Namespace) -> int:
    if ns.against == FLBENCH:
        return command_run_flbench(ns)
    if ns.side == FLBENCH:
        raise SystemExit("--side FL-bench runs with --against FL-bench")
    split, method = SPLITS[ns.split], chosen_method(ns)
    rounds = ns.rounds or split.rounds
    if ns.side != "pfedkit" and ns.pfllib is None:
        raise SystemExit("--pfllib CHECKOUT is needed to run PFLlib's side (or give --side pfedkit)")
    if ns.init == "flbench":
        raise SystemExit("--init flbench runs with --against FL-bench")
    if ns.init and ns.pfllib is None:
        raise SystemExit("--init pfllib reads PFLlib's initial weights: give --pfllib CHECKOUT")
    try:
        pfllib_arguments(method, split, "check", rounds, "check", device=ns.device)
    except ValueError as error:
        raise SystemExit(f"--device: {error}") from None
    failures = 0
    for seed in ns.seeds:
        if ns.side in ("both", "PFLlib"):
            failures += run_pfllib_side(ns.pfllib, ns.scratch.resolve(), split, method, seed, rounds,
                                        ns.device, ns.data_dir) != 0
        if ns.side in ("both", "pfedkit"):
            failures += run_pfedkit_side(ns.scratch.resolve(), split, method, seed, rounds, ns.data_dir,
                                         ns.pfllib, ns.init) != 0
    return 1 if failures else 0


def command_run_flbench(ns: argparse.Namespace) -> int:
    split, method = SPLITS[ns.split], chosen_method(ns)
    rounds = ns.rounds or split.rounds
    if ns.side == "PFLlib" or ns.init == "pfllib":
        raise SystemExit("--against FL-bench: --side is both, pfedkit or FL-bench, and --init pfllib is PFLlib's")
    if ns.init and ns.flbench is None:
        raise SystemExit("--init flbench reads FL-bench's initial weights: give --flbench CHECKOUT")
    if ns.side != "pfedkit" and ns.flbench is None:
        raise SystemExit("--flbench CHECKOUT is needed to run FL-bench's side (or give --side pfedkit)")
    if ns.device != "cpu":
        raise SystemExit("--against FL-bench runs on the CPU (--device is PFLlib's)")
    failures = 0
    for seed in ns.seeds:
        if ns.side in ("both", FLBENCH):
            failures += run_flbench_side(ns.flbench, ns.scratch.resolve(), split, method, seed, rounds,
                                         ns.data_dir) != 0
        if ns.side in ("both", "pfedkit"):
            failures += run_pfedkit_side(ns.scratch.resolve(), split, method, seed, rounds, ns.data_dir,
                                         ns.flbench, ns.init, against=FLBENCH) != 0
    return 1 if failures else 0


def command_times(ns: argparse.Namespace) -> int:
    """Each round's time cost as PFLlib printed it, then one JSON line: the rounds, the device and the
    mean without round 0 (PFLlib's own 'Average time cost per round'; round 0 pays the warm-up)."""
    text = ns.log.read_text()
    costs = time_costs_from_log(text)
    if not costs:
        print(f"{ns.log}: no 'time cost' line (PFLlib did not finish a round)", file=sys.stderr)
        return 1
    for rnd, seconds in enumerate(costs):
        print(f"PFLlib round {rnd}: {seconds:.3f} s")
    timed = costs[1:] or costs
    print(json.dumps({"library": "PFLlib", "log": ns.log.name, "device": device_from_log(text),
                      "round_seconds": [round(c, 3) for c in costs],
                      "sec_per_round": round(sum(timed) / len(timed), 3)}))
    return 0


def command_row(ns: argparse.Namespace) -> int:
    curves = pd.read_csv(ns.curves)
    evaluated = curves[curves["round"] >= 1].groupby("library")["round"].max()
    rounds = ns.rounds or int(evaluated.min())
    row = compare(ns.curves.stem, curves, rounds, first_common_round(curves))
    print(table_header(row.other_library))
    print(markdown_row(row, ns.verdict or ("agree" if row.complete and row.within_spread else "differs")))
    paired = paired_last10(curves, rounds)
    print(f"paired by seed, last-10 pfedkit - {row.other_library}:",
          ", ".join(f"seed {s} {d:+.2f}" for s, d in paired.items()))
    return 0


def main(argv: list[str] | None = None) -> int:
    ns = parse_arguments(sys.argv[1:] if argv is None else argv)
    if ns.command == "export":
        export_split(SPLITS[ns.split], ns.seed, ns.out)
        return 0
    if ns.command == "run":
        return command_run(ns)
    if ns.command == "curves":
        ns.out.parent.mkdir(parents=True, exist_ok=True)
        collect_curves(ns.scratch, SPLITS[ns.split], chosen_method(ns), ns.seeds, ns.init, ns.against).to_csv(
            ns.out, index=False, float_format="%.6f")
        return 0
    if ns.command == "row":
        return command_row(ns)
    if ns.command == "times":
        return command_times(ns)
    if ns.against == FLBENCH:
        print(flbench_mapping_text([chosen_method(ns)] if ns.method else list(FLBENCH_METHODS.values()),
                                   {} if ns.method else FLBENCH_NOT_COMPARABLE))
    else:
        print(mapping_text(chosen_method(ns) if ns.method else None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
