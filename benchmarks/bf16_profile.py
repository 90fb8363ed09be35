"""Where bf16 training time goes on a CPU: one FedAvgCNN client, B=10, one thread, MNIST-shaped
random data. Times a bare SGD loop at fp32, under bf16 autocast (what `precision=bf16` does) and
with the model's weights stored in bf16 (no per-step weight casts), then prints the profiler's
top operators of each. Usage: python benchmarks/bf16_profile.py [THREADS] [STEPS]"""
from __future__ import annotations

import contextlib
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from pfedkit.models import build_model


def train_steps(model, x, y, steps: int, autocast: bool) -> float:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.005, foreach=True)
    context = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if autocast else contextlib.nullcontext
    start = time.perf_counter()
    for step in range(steps):
        batch = slice((step * 10) % 990, (step * 10) % 990 + 10)
        optimizer.zero_grad(set_to_none=True)
        with context():
            loss = torch.nn.functional.cross_entropy(model(x[batch]).float(), y[batch])
        loss.backward()
        optimizer.step()
    return (time.perf_counter() - start) / steps


def variants():
    torch.manual_seed(0)
    x = torch.randn(1000, 1, 28, 28).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (1000,))
    fp32 = build_model("cnn", (1, 28, 28), 10).to(memory_format=torch.channels_last)
    yield "fp32", fp32, x, y, False
    yield "bf16 autocast", build_model("cnn", (1, 28, 28), 10).to(memory_format=torch.channels_last), x, y, True
    bf16 = build_model("cnn", (1, 28, 28), 10).to(dtype=torch.bfloat16, memory_format=torch.channels_last)
    yield "bf16 weights", bf16, x.to(torch.bfloat16), y, False


def main() -> None:
    threads = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 300
    torch.set_num_threads(threads)
    print(f"CPU {torch.backends.cpu.get_cpu_capability()}, native bf16 "
          f"{torch.ops.mkldnn._is_mkldnn_bf16_supported()}, {threads} thread(s), {steps} steps of B=10")
    timings = {}
    for name, model, x, y, autocast in variants():
        train_steps(model, x, y, 20, autocast)  # warm-up (oneDNN primitive creation)
        timings[name] = train_steps(model, x, y, steps, autocast)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            train_steps(model, x, y, 50, autocast)
        print(f"\n== {name}: {1e3 * timings[name]:.3f} ms/step")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=40))
    base = timings["fp32"]
    print("speed-up over fp32: " + ", ".join(f"{n} {base / t:.2f}x" for n, t in timings.items()))


if __name__ == "__main__":
    main()
