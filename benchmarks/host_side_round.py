"""The host side of a `vectorized` round: one FedAvg round of N iid MNIST clients with the lock-step's
training computation replaced by nothing, profiled (cProfile, the functions with most own time).

What is left is everything around the batched steps: the clients' batch schedules, stacking, the
step plans, the host copies of each chunk's trained models, the server's running weighted sum of
the replies, and evaluation. Issue 49 measured the 10,000-client round at 22.7 s on an H200
(benchmarks/RESULTS.md); this shows, on any machine, which of its parts do not depend on the GPU.

    python benchmarks/host_side_round.py --clients 10000 [--data-dir ../shared/datasets] [--max-clients 2048] [--step eager]
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import tempfile
import time

from pfedkit.config import load_config
from pfedkit.engine.runtimes import lockstep, vectorized
from pfedkit.runs import prepare


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=10000)
    parser.add_argument("--data-dir", default="../shared/datasets")
    parser.add_argument("--max-clients", type=int, default=2048)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--step", default="bucketed", choices=["bucketed", "eager"],
                        help="bucketed: the CUDA graphs' path (kept chunks); eager: a CPU's default")
    args = parser.parse_args()
    lockstep.StepShapes.__call__ = lambda self, *buffers: None  # no training computation (bucketed)
    vectorized.train_members = lambda *arguments: None  # nor in the eager step
    with tempfile.TemporaryDirectory() as out:
        config = load_config({"dataset": "mnist", "data_dir": args.data_dir, "num_clients": args.clients,
                              "rounds": 2, "partition": {"scheme": "iid"}, "batch_size": 10, "lr": 0.005,
                              "backend": "vectorized", "out_dir": out,
                              "vectorized": {"step": args.step, "max_clients": args.max_clients}})
        prepared = prepare(config)
        simulation = prepared.simulation
        simulation.run_round(prepared.state)  # the first round's one-off costs
        profile = cProfile.Profile()
        started = time.perf_counter()
        profile.enable()
        report = simulation.run_round(prepared.state)
        profile.disable()
        print(f"round 2: {time.perf_counter() - started:.2f} s (training part {report.train_seconds:.2f} s, "
              f"evaluation {report.eval_seconds:.2f} s), no training computation")
        pstats.Stats(profile).sort_stats("tottime").print_stats(args.top)
        prepared.runtime.close()


if __name__ == "__main__":
    main()
