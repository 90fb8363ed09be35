"""`pfedkit bench`: seconds per round, throughput, and the fraction of this machine's matmul peak.

Runs the issue's reference setting (FedAvg, MNIST, Dirichlet 0.1, FedAvgCNN, B=10, E=1,
lr 0.005) for a few rounds in memory (no run directory) and prints one JSON object as its last
line. The peak is measured on the spot (fp32 2048x2048 matmul with the threads the backend uses
in total), because the machine is shared and absolute times drift; compare ratios from one run.
"""
from __future__ import annotations

import json
import resource
import time

import torch
from torch.utils.flop_counter import FlopCounterMode

from pfedkit.config import load_config
from pfedkit.runs import prepare


def matmul_gflops(threads: int, size: int = 2048, repeats: int = 5) -> float:
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    torch.set_num_threads(previous)
    return 2 * size ** 3 / best / 1e9


def training_flops_per_sample(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Forward + backward FLOPs of one mini-batch, per sample (torch's FLOP counter)."""
    with FlopCounterMode(display=False) as counter:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
    return counter.get_total_flops() / len(y)


def peak_rss_mb() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return (own + children) / 1024  # ru_maxrss is in KiB on Linux


def bench_config(args) -> dict:
    return {"algorithm": args.algorithm, "dataset": args.dataset, "data_dir": args.data_dir,
            "num_clients": args.clients, "partition": {"scheme": "dirichlet", "alpha": args.alpha},
            "model": "auto", "batch_size": 10, "local_epochs": 1, "lr": 0.005, "rounds": args.rounds,
            "backend": args.backend, "workers": args.workers, "precision": args.precision, "seed": 0}


def run_bench(args, log=print) -> dict:
    config = load_config(bench_config(args), list(getattr(args, "overrides", []) or []))
    started = time.perf_counter()
    prepared = prepare(config)
    setup_seconds = time.perf_counter() - started
    sim, state, data = prepared.simulation, prepared.state, prepared.data
    total_threads = (args.workers or 2) if args.backend == "processes" else torch.get_num_threads()
    reports = []
    try:
        for _ in range(args.rounds):
            report = sim.run_round(state)
            reports.append(report)
            log(f"round {report.round}: train {report.train_seconds:.2f} s, eval {report.eval_seconds:.2f} s, "
                f"acc {report.acc_weighted:.4f}")
    finally:
        prepared.runtime.close()
    timed = reports[1:] if len(reports) > 1 else reports  # round 1 pays one-off warm-up costs
    train = sum(r.train_seconds for r in timed) / len(timed)
    evaluate = sum(r.eval_seconds for r in timed) / len(timed)
    samples = sum(r.train_samples for r in timed) / len(timed)
    client = data.clients[0]
    model = sim.algorithm.setup.ops.build()
    flops = training_flops_per_sample(model, client.x_train[:10], client.y_train[:10])
    peak = matmul_gflops(total_threads)
    achieved = samples / train * flops / 1e9
    return {"backend": args.backend, "clients": args.clients, "algorithm": config.algorithm,
            "channels_last": config.channels_last, "dataset": args.dataset, "rounds": args.rounds,
            "precision": args.precision, "setup_sec": round(setup_seconds, 2),
            "sec_per_round": round(train + evaluate, 3), "train_sec_per_round": round(train, 3),
            "eval_sec_per_round": round(evaluate, 3), "samples_per_sec": round(samples / train, 1),
            "train_gflops": round(achieved, 2), "matmul_gflops": round(peak, 1),
            "peak_fraction": round(achieved / peak, 3), "mflop_per_sample": round(flops / 1e6, 2),
            "final_acc": round(reports[-1].acc_weighted, 4), "peak_rss_mb": round(peak_rss_mb(), 1)}


def format_bench(result: dict) -> str:
    return "\n".join([
        f"seconds per round: {result['sec_per_round']} (training {result['train_sec_per_round']}, "
        f"evaluation {result['eval_sec_per_round']})",
        f"training throughput: {result['samples_per_sec']} samples/s = {result['train_gflops']} GFLOP/s "
        f"({result['mflop_per_sample']} MFLOP per sample)",
        f"matmul peak measured now: {result['matmul_gflops']} GFLOP/s -> training at "
        f"{100 * result['peak_fraction']:.1f}% of peak",
        f"peak memory (this process + workers): {result['peak_rss_mb']} MB",
        json.dumps(result),
    ])
