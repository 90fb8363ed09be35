"""Seconds of whole `pfedkit` commands on an idle and on a loaded machine, by OpenMP wait policy.

Issue 43: on a shared server (load 8-12) the README's `pfedkit compare` took 814 s with the default
threads and 31.6 s with threads=1; OpenMP threads spun while waiting for cores other jobs held.
pfedkit now chooses at start (pfedkit/__init__.py: openmp_waiting): passive waiting where the
machine is loaded (load >= cores), a short spin (GOMP_SPINCOUNT=10000) where it is idle. libgomp's
own default spins 300,000 times and `OMP_WAIT_POLICY=PASSIVE` not at all: all are measured here,
with the same numbers (metrics.csv compared).

    python benchmarks/busy_machine.py [--load 8] [--repeats 3] [--command run|compare]

The load is LOAD busy Python processes (one core each when they get one), started before and
stopped after the loaded measurements. Prints one line per (machine state, setting): the median,
min and max seconds, and whether metrics.csv matched the first setting's.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

COMMANDS = {
    "run": ["run", "-q", "rounds=3"],  # FedAvg on digits, the README's defaults
    "compare": ["compare", "-q", "rounds=5", "--seeds", "0"],  # the README's three methods, 5 rounds
}
SETTINGS = {  # name -> (environment, extra config); GOMP_SPINCOUNT overrides the wait policy's spin
    "libgomp's default (spin 300000, then sleep)": ({"GOMP_SPINCOUNT": "300000"}, []),
    "passive (no spin)": ({"OMP_WAIT_POLICY": "PASSIVE"}, []),
    "pfedkit's default (by load: passive, or spin 10000)": ({}, []),
    "threads=1": ({}, ["threads=1"]),
}


@contextmanager
def busy_cores(count: int):
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        time.sleep(1.0)
        yield
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


def timed(command: list[str], env: dict[str, str]) -> tuple[float, str]:
    """Wall seconds of one whole process, and a digest of the metrics it wrote."""
    with tempfile.TemporaryDirectory() as out:
        environment = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")} | env
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "pfedkit.cli", *command, f"--out={out}" if command[0] == "compare"
                        else f"out_dir={out}"], env=environment, check=True, capture_output=True)
        seconds = time.perf_counter() - start
        digest = hashlib.sha256(b"".join(p.read_bytes() for p in sorted(Path(out).rglob("metrics.csv"))))
        return seconds, digest.hexdigest()[:12]


def measure(label: str, command: list[str], repeats: int) -> None:
    reference = None
    for name, (env, extra) in SETTINGS.items():
        runs = [timed(command + extra, env) for _ in range(repeats)]
        seconds = [s for s, _ in runs]
        digest = runs[0][1]
        same = "" if extra else ("metrics identical" if reference in (None, digest) else "METRICS DIFFER")
        reference = reference or digest
        print(f"{label:7} {name:52} median {statistics.median(seconds):7.1f} s  "
              f"(min {min(seconds):.1f}, max {max(seconds):.1f})  {same}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--load", type=int, default=8, help="busy processes for the loaded measurements")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--command", choices=sorted(COMMANDS), default="run")
    parser.add_argument("--only", choices=["idle", "loaded"], default=None)
    args = parser.parse_args()
    command = COMMANDS[args.command]
    print(f"pfedkit {' '.join(command)}; {os.cpu_count()} cores; load {args.load} busy processes", flush=True)
    if args.only != "loaded":
        measure("idle", command, args.repeats)
    if args.only != "idle":
        with busy_cores(args.load):
            measure("loaded", command, args.repeats)


if __name__ == "__main__":
    main()
