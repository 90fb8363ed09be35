"""`pfedkit bench`: seconds per round, throughput, the fraction of this machine's matmul peak,
memory, and (`--parity`) bf16's accuracy beside fp32's.

Runs the issue's reference setting (FedAvg, MNIST, Dirichlet 0.1, FedAvgCNN, B=10, E=1,
lr 0.005) for a few rounds in memory (no run directory) and prints one JSON object as its last
line. The peak is measured on the spot (fp32 2048x2048 matmul with the threads the backend uses
in total), because the machine is shared and absolute times drift; compare ratios from one run.

Fractions of the peak: `peak_fraction` counts training FLOPs over training time;
`peak_fraction_round` counts the whole round (training FLOPs + the evaluation's forward FLOPs
over training + evaluation time). Memory: `peak_rss_mb` adds this process's peak RSS to the
largest worker's (as before; pages shared between them, such as the data the workers inherit,
count twice); `peak_pss_mb` is the peak of the summed proportional set sizes of this process and
its workers, sampled every 0.2 s: the physical memory the run really holds.
"""
from __future__ import annotations

import os
import resource
import threading
import time
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

from pfedkit.atomic import strict_json
from pfedkit.build import RUNTIMES
from pfedkit.config import load_config
from pfedkit.engine.device import describe_device, resolve_device
from pfedkit.engine.runtimes.processes import default_workers
from pfedkit.runs import prepare

PARITY_ROUNDS = 10
PARITY_TOLERANCE = 0.005  # bf16 within half a point of fp32 after PARITY_ROUNDS rounds


def matmul_gflops(threads: int, size: int = 2048, repeats: int = 5,
                  device: torch.device = torch.device("cpu")) -> float:
    if device.type == "cuda":
        return cuda_matmul_gflops(device)
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


def cuda_matmul_gflops(device: torch.device, size: int = 8192, repeats: int = 10) -> float:
    """The GPU's fp32 matmul rate (TF32 off, as in training: see engine/device.py), timed with events."""
    a, b = torch.randn(size, size, device=device), torch.randn(size, size, device=device)
    for _ in range(3):
        a @ b  # warm-up
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        a @ b
    end.record()
    torch.cuda.synchronize(device)
    return 2 * size ** 3 * repeats / (start.elapsed_time(end) / 1e3) / 1e9


def flops_per_sample(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """(training = forward + backward, evaluation = forward) FLOPs of one mini-batch, per sample."""
    with FlopCounterMode(display=False) as counter:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        forward = counter.get_total_flops()
        loss.backward()
    return counter.get_total_flops() / len(y), forward / len(y)


def peak_rss_mb() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return (own + children) / 1024  # ru_maxrss is in KiB on Linux


def minor_faults() -> int:
    """Minor page faults so far of this process and its live descendants (the workers)."""
    total = 0
    for pid in _process_tree(os.getpid()):
        try:
            # /proc/PID/stat: the 10th field is minflt; the name (2nd) may hold spaces, so split after it
            total += int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[7])
        except (OSError, IndexError, ValueError):
            continue
    return total


class PssSampler:
    """Samples the summed PSS (KiB) of this process and its descendants; keeps the peak."""

    def __init__(self, interval: float = 0.2) -> None:
        self.interval, self.peak_kib = interval, 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "PssSampler":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.sample()
        self.stop.set()
        self.thread.join()

    def _run(self) -> None:
        while not self.stop.wait(self.interval):
            self.sample()

    def sample(self) -> None:
        self.peak_kib = max(self.peak_kib, sum(_pss_kib(pid) for pid in _process_tree(os.getpid())))


def _process_tree(root: int) -> list[int]:
    pids, frontier = [root], [root]
    while frontier:
        pid = frontier.pop()
        try:
            children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        except OSError:
            continue
        pids.extend(int(c) for c in children)
        frontier.extend(int(c) for c in children)
    return pids


def _pss_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def cpu_capability() -> dict:
    """What the CPU offers torch: its vector ISA and whether oneDNN has native bf16 kernels."""
    native = bool(getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)())
    return {"cpu_capability": torch.backends.cpu.get_cpu_capability(), "native_bf16": native}


def bench_config(args, precision: str | None = None, rounds: int | None = None) -> dict:
    return {"algorithm": args.algorithm, "dataset": args.dataset, "data_dir": args.data_dir,
            "num_clients": args.clients, "partition": {"scheme": "dirichlet", "alpha": args.alpha},
            "model": "auto", "batch_size": 10, "local_epochs": 1, "lr": 0.005, "rounds": rounds or args.rounds,
            "backend": args.backend, "workers": args.workers, "precision": precision or args.precision,
            "compile": bool(getattr(args, "compile", False)), "seed": 0}


def run_rounds(config, log) -> tuple[list, object, object, float, int]:
    """(round reports, simulation, data, setup seconds, page faults in the timed rounds) of
    `config.rounds` rounds in memory; the timed rounds are all but the first (when there are two
    or more)."""
    started = time.perf_counter()
    prepared = prepare(config)
    setup_seconds = time.perf_counter() - started
    reports, faults = [], 0
    try:
        for index in range(config.rounds):
            before = minor_faults()
            report = prepared.simulation.run_round(prepared.state)
            faults += minor_faults() - before if index > 0 or config.rounds == 1 else 0
            reports.append(report)
            log(f"round {report.round}: train {report.train_seconds:.2f} s, eval {report.eval_seconds:.2f} s, "
                f"acc {report.acc_weighted:.4f}")
    finally:
        prepared.runtime.close()
    return reports, prepared.simulation, prepared.data, setup_seconds, faults


def run_bench(args, log=print) -> dict:
    overrides = list(getattr(args, "overrides", []) or [])
    config = load_config(bench_config(args), overrides)
    with PssSampler() as pss:
        reports, sim, data, setup_seconds, faults = run_rounds(config, log)
    timed = reports[1:] if len(reports) > 1 else reports  # round 1 pays one-off warm-up costs
    train = sum(r.train_seconds for r in timed) / len(timed)
    evaluate = sum(r.eval_seconds for r in timed) / len(timed)
    samples = sum(r.train_samples for r in timed) / len(timed)
    steps = sum(r.train_samples for r in timed) / config.batch_size
    client = data.clients[0]
    train_flops, eval_flops = flops_per_sample(sim.algorithm.setup.ops.build(), client.x_train[:10],
                                               client.y_train[:10])
    eval_samples = sum(c.n_test for c in data.clients)
    # The threads the run computed with: each worker's one (side by side) or the run's count.
    total_threads = (config.workers or default_workers()) if RUNTIMES[config.backend].side_by_side else sim.threads
    device = resolve_device(config.device, config.backend)
    peak = matmul_gflops(total_threads, device=device)
    achieved = samples / train * train_flops / 1e9
    round_flops = samples * train_flops + eval_samples * eval_flops
    result = {"backend": config.backend, "clients": args.clients, "algorithm": config.algorithm,
              "channels_last": config.channels_last, "dataset": args.dataset, "rounds": args.rounds,
              "precision": config.precision, "compile": config.compile, **cpu_capability(),
              "device": describe_device(device),
              "setup_sec": round(setup_seconds, 2),
              "sec_per_round": round(train + evaluate, 3), "train_sec_per_round": round(train, 3),
              "eval_sec_per_round": round(evaluate, 3), "samples_per_sec": round(samples / train, 1),
              "train_gflops": round(achieved, 2), "matmul_gflops": round(peak, 1),
              "peak_fraction": round(achieved / peak, 3),
              "peak_fraction_round": round(round_flops / (train + evaluate) / 1e9 / peak, 3),
              "mflop_per_sample": round(train_flops / 1e6, 2), "eval_mflop_per_sample": round(eval_flops / 1e6, 2),
              "final_acc": round(reports[-1].acc_weighted, 4), "peak_rss_mb": round(peak_rss_mb(), 1),
              "peak_pss_mb": round(pss.peak_kib / 1024, 1),
              "minor_faults_per_step": round(faults / max(steps, 1), 1)}
    if device.type == "cuda":  # the GPU's peak since the process started (data, stacked clients, graphs)
        result["peak_gpu_mb"] = round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
    if getattr(args, "parity", False):
        result.update(parity(args, overrides, log))
    return result


def parity(args, overrides: list[str], log) -> dict:
    """bf16 against fp32: final accuracy after PARITY_ROUNDS rounds of the same setting."""
    accuracy = {}
    for precision in ("fp32", "bf16"):
        config = load_config(bench_config(args, precision, PARITY_ROUNDS), overrides)
        log(f"parity: {PARITY_ROUNDS} rounds at {precision}")
        accuracy[precision] = run_rounds(config, log)[0][-1].acc_weighted
    gap = accuracy["bf16"] - accuracy["fp32"]
    return {"parity_rounds": PARITY_ROUNDS, "parity_fp32_acc": round(accuracy["fp32"], 4),
            "parity_bf16_acc": round(accuracy["bf16"], 4), "parity_gap": round(gap, 4),
            "parity_ok": abs(gap) <= PARITY_TOLERANCE}


def format_bench(result: dict) -> str:
    lines = [
        f"seconds per round: {result['sec_per_round']} (training {result['train_sec_per_round']}, "
        f"evaluation {result['eval_sec_per_round']})",
        f"training throughput: {result['samples_per_sec']} samples/s = {result['train_gflops']} GFLOP/s "
        f"({result['mflop_per_sample']} MFLOP per sample)",
        f"matmul peak measured now: {result['matmul_gflops']} GFLOP/s -> training at "
        f"{100 * result['peak_fraction']:.1f}% of peak, the whole round at {100 * result['peak_fraction_round']:.1f}%",
        f"device: {result['device']}; CPU: {result['cpu_capability']}, native bf16: {result['native_bf16']}",
        f"peak memory: RSS (this process + largest worker) {result['peak_rss_mb']} MB, "
        f"PSS (all processes) {result['peak_pss_mb']} MB; {result['minor_faults_per_step']} page faults per step"
        + (f"; GPU {result['peak_gpu_mb']} MB" if "peak_gpu_mb" in result else ""),
    ]
    if "parity_gap" in result:
        lines.append(f"bf16 parity after {result['parity_rounds']} rounds: fp32 {result['parity_fp32_acc']}, "
                     f"bf16 {result['parity_bf16_acc']} (gap {result['parity_gap']:+.4f}, "
                     f"{'within' if result['parity_ok'] else 'OUTSIDE'} {PARITY_TOLERANCE})")
    return "\n".join([*lines, strict_json(result, indent=None)])  # a machine-read line: NaN as null
