"""Seconds per round per method on `digits`: where a method's time goes, measured.

    python benchmarks/round_seconds.py [--rounds 4] [--methods fedavg,pfedcs | all] [--metrics DIR]
                                       [--profile FILE] [KEY=VALUE ...]

Each method runs `--rounds` rounds of the README's default job (digits, 10 clients, Dirichlet 0.5,
the config's defaults) plus the KEY=VALUE overrides (e.g. `dp.level=client`), with `threads=1`
unless an override says otherwise (on a shared machine more threads measure the contention, not
the method), one method after another in this process. Printed per method:
- setup: data, partition, model, algorithm and runtime, until the first round starts;
- first round: pays one-off start-up (the first optimiser imports torch._dynamo, about 2-4 s, once
  per process; kernels warm up), so it is shown apart;
- s/round: the mean of the rounds after the first (what `sec_per_round` in summary.json reports);
- between: the run loop's time outside rounds per round (privacy accounting, metrics.csv and
  checkpoint writes, the summary at the end).
`--metrics DIR` copies each run's metrics.csv to DIR/<method>.csv: run it before and after a speed
change and `cmp` the files to check that every number is kept. `--profile FILE` writes a cProfile
of the rounds after the first (all methods) for `python -m pstats FILE`.
"""
from __future__ import annotations

import argparse
import cProfile
import shutil
import tempfile
import time
import warnings
from pathlib import Path

from pfedkit.algorithms import algorithm_names
from pfedkit.config import load_config
from pfedkit.engine.simulate import Simulation
from pfedkit.runs import run


class RoundClock:
    """Wraps Simulation.run_round: when the first round of a run starts, and each round's seconds;
    the rounds after the first run under `profiler` when one is given."""

    def __init__(self, profiler: cProfile.Profile | None = None):
        self.profiler = profiler
        self.first_started: float | None = None
        self.seconds: list[float] = []
        self.original = Simulation.run_round

    def __enter__(self) -> "RoundClock":
        clock = self

        def timed_round(simulation, state):
            started = time.perf_counter()
            if clock.first_started is None:
                clock.first_started = started
            profiled = clock.profiler is not None and clock.seconds
            if profiled:
                clock.profiler.enable()
            try:
                return clock.original(simulation, state)
            finally:
                if profiled:
                    clock.profiler.disable()
                clock.seconds.append(time.perf_counter() - started)

        Simulation.run_round = timed_round
        return self

    def __exit__(self, *exc) -> None:
        Simulation.run_round = self.original


def time_method(name: str, rounds: int, overrides: list[str], metrics_dir: Path | None,
                profiler: cProfile.Profile | None) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        config = load_config({"threads": 1, "rounds": rounds, "out_dir": tmp},
                             [f"algorithm={name}", *overrides])
        started = time.perf_counter()
        with RoundClock(profiler) as clock:
            result = run(config)
        wall = time.perf_counter() - started
        if metrics_dir is not None:
            shutil.copy(result.run_dir / "metrics.csv", metrics_dir / f"{name}.csv")
    setup = clock.first_started - started
    later = clock.seconds[1:] or clock.seconds
    between = (wall - setup - sum(clock.seconds)) / len(clock.seconds)
    return {"method": name, "setup": setup, "first": clock.seconds[0], "per_round": sum(later) / len(later),
            "between": between, "summary_sec_per_round": result.summary["sec_per_round"],
            "accuracy": result.summary["final_acc"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--methods", default="fedavg,pfedcs", help="comma-separated, or all")
    parser.add_argument("--metrics", type=Path, help="copy each run's metrics.csv to DIR/<method>.csv")
    parser.add_argument("--profile", type=Path, help="cProfile of the rounds after the first, to FILE")
    parser.add_argument("overrides", nargs="*", help="KEY=VALUE config overrides for every method")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    names = algorithm_names() if args.methods == "all" else args.methods.split(",")
    if args.metrics is not None:
        args.metrics.mkdir(parents=True, exist_ok=True)
    profiler = cProfile.Profile() if args.profile else None
    print(f"digits, {args.rounds} rounds, overrides: {' '.join(args.overrides) or 'none'}; seconds")
    print(f"{'method':<12} {'setup':>6} {'first round':>11} {'s/round':>8} {'between':>8} {'final acc':>9}")
    for name in names:
        row = time_method(name, args.rounds, args.overrides, args.metrics, profiler)
        print(f"{row['method']:<12} {row['setup']:>6.2f} {row['first']:>11.2f} {row['per_round']:>8.3f} "
              f"{row['between']:>8.3f} {100 * row['accuracy']:>8.2f}%", flush=True)
    if profiler is not None:
        profiler.dump_stats(args.profile)


if __name__ == "__main__":
    main()
