"""Issue 27's measured table: participants vs clients that never trained, and accuracy under DP.

    python benchmarks/new_clients_dp.py DATA_DIR [OUT]        # OUT default: runs/new-clients-dp

MNIST, Dirichlet(0.1) over 50 clients (25% of the training pool, stratified), FedAvgCNN, B = 10,
E = 1, lr 0.01, 50 rounds, 10 clients a round, seed 0. Part 1: FedAvg, FedPer, Ditto and FedReMa
with 10 of the 50 clients held out (`new_clients=10`), evaluated as received
(`new_client_finetune=0`) and after one local epoch (`=1`). Part 2: FedAvg without DP and at
epsilon 1, 4 and 8 (delta 1e-5) with client-level DP (DP-FedAvg) and with sample-level DP-SGD;
the noise multiplier of each is the smallest that keeps epsilon after the last round within the
target (bisection, `pfedkit.privacy.calibrate`, on pfedkit's own accountant read on the schedule of
the run without DP). Client level uses pfedkit's default fixed-size sampling (replace-one adjacency,
docs/privacy.md). A finished run is
reused (its summary.json), so the same command resumes. Prints both tables in Markdown.
"""
from __future__ import annotations

import json
import shutil
import sys
import warnings
from pathlib import Path

import pandas as pd

from pfedkit.engine.drive import TrainingDiverged
from pfedkit.privacy.accounting import PrivacyBudget
from pfedkit.privacy.calibrate import noise_for_epsilon
from pfedkit.runs import run

BASE = {"dataset": "mnist", "num_clients": 50, "join_ratio": 0.2, "rounds": 50, "lr": 0.01, "batch_size": 10,
        "local_epochs": 1, "seed": 0, "partition": {"scheme": "dirichlet", "alpha": 0.1, "pool_fraction": 0.25},
        "backend": "sequential", "threads": 1, "checkpoint_every": 10}
NEW = {"new_clients": 10}
EPSILONS = (1.0, 4.0, 8.0)
DELTA = 1e-5


def new_client_runs() -> dict[str, dict]:
    runs = {}
    for algorithm in ("fedavg", "fedper", "ditto", "fedrema"):
        for epochs in (0, 1):
            runs[f"{algorithm}-new-e{epochs}"] = {**BASE, **NEW, "algorithm": algorithm, "new_client_finetune": epochs}
    return runs


def dp_runs(out: Path) -> dict[str, dict]:
    """FedAvg without DP, then at each target epsilon per DP level, the noise calibrated on the
    schedule of the run without DP (same seed: the same participants and local steps)."""
    plain = {**BASE, "algorithm": "fedavg"}
    runs = {"fedavg-nodp": plain}
    finished(out, "fedavg-nodp", plain)
    rows = pd.read_csv(out / "fedavg-nodp" / "metrics.csv").to_dict("records")
    n_train = pd.DataFrame(rows).groupby("client")["n_train"].first().sort_index().tolist()
    sampled = round(BASE["join_ratio"] * BASE["num_clients"])
    for level in ("client", "sample"):
        for eps in EPSILONS:
            def epsilon_at(z: float, level=level) -> float:
                budget = PrivacyBudget(level, z, DELTA, "rdp", None, lambda rnd: list(range(sampled)),
                                       BASE["num_clients"], n_train=n_train, batch_size=BASE["batch_size"],
                                       join_ratio=BASE["join_ratio"])
                return budget.epsilon_after(rows, BASE["rounds"])
            noise = round(noise_for_epsilon(epsilon_at, eps), 4)
            dp = ({"level": "client", "clip": 1.0, "noise_multiplier": noise} if level == "client" else
                  {"level": "sample", "sample_clip": 1.0, "sample_noise_multiplier": noise})
            runs[f"fedavg-dp-{level}-eps{eps:g}"] = {**plain, "dp": {**dp, "delta": DELTA}}
    return runs


def finished(out: Path, name: str, config: dict) -> dict:
    """The run's summary, running it first unless a finished one is there. A run whose training
    diverges (DP noise can blow the model up) is kept as {"diverged": "round R"}."""
    summary_file, diverged_file = out / name / "summary.json", out / name / "diverged.txt"
    if diverged_file.is_file():
        return {"diverged": diverged_file.read_text().strip()}
    if not summary_file.is_file():
        half_done = (out / name / "checkpoints" / "latest.pt").is_file()
        if not half_done:
            shutil.rmtree(out / name, ignore_errors=True)
        print(f"{'resuming' if half_done else 'running'} {name} ...", flush=True)
        try:
            if half_done:
                run(resume=out / name)
            else:
                run({**config, "out_dir": str(out), "name": name})
        except TrainingDiverged as err:
            diverged_file.write_text(f"round {err.round}\n")
            return {"diverged": f"round {err.round}"}
    return json.loads(summary_file.read_text())


def pct(value) -> str:
    return "-" if value is None else f"{100 * value:.2f}"


def main(data_dir: str, out: Path) -> None:
    warnings.simplefilter("ignore")
    BASE["data_dir"] = data_dir
    print("| method | finetune epochs | participants (last-5 %) | new clients (last-5 %) | new clients (best %) |")
    print("|---|---|---|---|---|")
    rows = []
    for name, config in new_client_runs().items():
        s = finished(out, name, config)
        rows.append(f"| {config['algorithm']} | {config['new_client_finetune']} | {pct(s['last5_acc'])} | "
                    f"{pct(s['new_clients_last5_acc'])} | {pct(s['new_clients_best_acc'])} |")
    print("\n".join(rows))
    print("\n| FedAvg | noise multiplier | epsilon (delta 1e-5) | last-5 acc % | best acc % |")
    print("|---|---|---|---|---|")
    for name, config in dp_runs(out).items():
        s = finished(out, name, config)
        dp = config.get("dp", {})
        noise = dp.get("noise_multiplier", dp.get("sample_noise_multiplier"))
        label = f"{dp['level']}-level DP" if dp else "no DP"
        noise_text = "-" if noise is None else f"{noise:.3f}"
        if "diverged" in s:
            print(f"| {label} | {noise_text} | (target {name.rsplit('eps', 1)[-1]}) | diverged in {s['diverged']} | - |")
            continue
        epsilon_text = "inf" if s.get("epsilon") is None else f"{s['epsilon']:.2f}"
        print(f"| {label} | {noise_text} | {epsilon_text} | {pct(s['last5_acc'])} | {pct(s['best_acc'])} |")


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2] if len(sys.argv) > 2 else "runs/new-clients-dp"))
