"""Where a processes-backend round spends its time: wall seconds of training and evaluation and
CPU seconds of the main process and of the workers, mean of the rounds after the first.

For before/after comparisons on a shared machine, run two checkouts alternately (the CPU seconds
drift less than the wall seconds):

    python benchmarks/round_cpu.py DATA_DIR 20 fedavg 3           # this checkout
    (cd OLD && PYTHONPATH=OLD python NEW/benchmarks/round_cpu.py DATA_DIR 20 fedavg 3)

Arguments: data directory, clients (Dirichlet 0.1 below 1,000, iid from 1,000), algorithm,
rounds. Prints one JSON line.
"""
from __future__ import annotations

import json
import multiprocessing
import os
import sys
import time

from pfedkit.config import load_config
from pfedkit.runs import prepare


def workers_cpu_seconds() -> float:
    total = 0.0
    for child in multiprocessing.active_children():
        with open(f"/proc/{child.pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime
    return total


def main(data_dir: str, clients: int, algorithm: str, rounds: int) -> None:
    partition = {"scheme": "iid"} if clients >= 1000 else {"scheme": "dirichlet", "alpha": 0.1}
    config = load_config({"algorithm": algorithm, "dataset": "mnist", "data_dir": data_dir, "num_clients": clients,
                          "backend": "processes", "rounds": rounds, "lr": 0.005, "batch_size": 10,
                          "partition": partition})
    prepared = prepare(config)
    measured = []
    for _ in range(rounds):
        workers, main_cpu = workers_cpu_seconds(), time.process_time()
        report = prepared.simulation.run_round(prepared.state)
        measured.append({"train": report.train_seconds, "eval": report.eval_seconds,
                         "main_cpu": time.process_time() - main_cpu, "workers_cpu": workers_cpu_seconds() - workers,
                         "samples": report.train_samples, "acc": report.acc_weighted})
    prepared.runtime.close()
    timed = measured[1:] or measured
    print(json.dumps({key: round(sum(m[key] for m in timed) / len(timed), 4) for key in timed[0]}))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]))
