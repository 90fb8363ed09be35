"""Which device a run trains and evaluates on (`device` config key), and moving things there.

`device` is `cpu`, `cuda`, `cuda:N` or `auto` (a GPU when torch sees one, else the CPU). Where
things live, per backend:

  * sequential, vectorized: one process on one GPU (`cuda` and `auto` mean cuda:0).
  * processes: on a GPU the workers are *spawned*, not forked (a process forked after CUDA was
    used cannot use it: a test of forked GPU workers hung on an H100). `cuda` and `auto` spread
    the workers over every GPU, one worker per GPU by default (`workers=N` may ask more; worker i
    uses cuda:(i mod GPUs), `worker_devices`); `cuda:N` pins every worker to GPU N. The model
    builder and the federation's data are shipped to each worker once, at its start; each
    worker keeps its clients' tensors on its GPU. On the CPU the workers are forked (they
    inherit the data).
  * ray: each actor asks Ray for `ray.gpus_per_worker` GPUs (default 1 on a GPU run; 0.5 puts
    two actors on a GPU) and trains on the one Ray gives it (Ray sets CUDA_VISIBLE_DEVICES, so
    it is cuda:0 in the actor's view). `cuda:N` is refused: Ray, not the run, places actors.
  * Flower nodes: each node resolves `device` on its own machine (`auto`: its GPU if it has one).

A resolved `torch.device("cuda")` without an index (processes, ray) means "the GPUs the workers
are given"; with an index, that GPU.

What lives where on a GPU (every backend alike):
  * each client's training and test tensors are copied to the device once, on first use, and
    kept there for the run (data are small next to what the device holds);
  * client states, server state and every message stay on the host (or on disk): a client's
    parameters are copied in when it trains or is evaluated and the results copied back. So
    memory on the device does not grow with the number of clients beyond their data;
  * algorithm code (broadcast, aggregate, custom `predict`) runs on the host, as on a CPU run.

Numerics on a GPU: fp32 means fp32 (TF32 is switched off for matmuls and convolutions, whose
cuDNN default is TF32), and cuDNN is asked for deterministic kernels, so a GPU run repeats
itself bit for bit; it does not equal a CPU run bit for bit (other kernels), only within float
rounding. Every worker (spawned process, Ray actor) sets the same switches on its own device.
"""
from __future__ import annotations

import os
import re
from typing import Any

import torch
from torch.utils._pytree import tree_map

from pfedkit.core.errors import ConfigError

DEVICE_PATTERN = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")
# Backends whose `cuda` means "the GPUs the workers are given" (no index) rather than cuda:0.
SPREAD_BACKENDS = ("processes", "ray")


def resolve_device(spec: str, backend: str) -> torch.device:
    """The torch device of `spec` for `backend`; ConfigError (one line) when it cannot be used.

    processes and ray: `cuda` / `auto` on a GPU give `torch.device("cuda")` (no index: the
    workers' GPUs, see the module doc); processes with `cuda:N`: that GPU for every worker."""
    if not DEVICE_PATTERN.match(spec):
        raise ConfigError(f"device: {spec!r} is not a device; use cpu, cuda, cuda:N or auto")
    if spec == "cpu" or (spec == "auto" and not cuda_available()):
        return torch.device("cpu")
    device = torch.device("cuda" if spec == "auto" else spec)
    if backend == "ray" and device.index is not None:
        raise ConfigError(f"device={spec}: backend=ray places each actor on the GPU Ray gives it; use device=cuda "
                          "(and ray.gpus_per_worker to share a GPU), or backend=processes to pin a GPU")
    if not cuda_available():
        raise ConfigError(f"device={spec}: torch sees no CUDA device here (torch {torch.__version__}, CUDA build: "
                          f"{torch.version.cuda or 'no'}); use device=cpu or device=auto")
    count = torch.cuda.device_count()
    index = 0 if device.index is None else device.index
    if index >= count:
        raise ConfigError(f"device={spec}: there are {count} CUDA device(s) (cuda:0 .. cuda:{count - 1})")
    if backend in SPREAD_BACKENDS and device.index is None:
        device = torch.device("cuda")
    else:
        device = torch.device("cuda", index)
    make_deterministic(device)
    return device


def worker_devices(device: torch.device, workers: int | None, device_count: int,
                   cpu_workers: int = 1) -> list[torch.device]:
    """The device of each worker of a parallel backend, in worker order.

    CPU: `workers` (default `cpu_workers`) CPU workers. `cuda` without an index: one worker per
    GPU by default, worker i on cuda:(i mod device_count). `cuda:N`: every worker on GPU N (one
    by default)."""
    if device.type != "cuda":
        return [torch.device("cpu")] * (workers or cpu_workers)
    if device.index is not None:
        return [torch.device("cuda", device.index)] * (workers or 1)
    if device_count < 1:
        raise ConfigError(f"device={device}: torch sees no CUDA device here; use device=cpu")
    return [torch.device("cuda", i % device_count) for i in range(workers or device_count)]


def cuda_available() -> bool:
    """Whether torch sees a GPU, asked through NVML (torch.cuda.device_count) rather than the CUDA
    runtime: asking initialises nothing in this process (a CPU run of the processes backend
    still forks its workers after it)."""
    return torch.cuda.device_count() > 0


def make_deterministic(device: torch.device) -> None:
    """fp32 without TF32 and deterministic cuDNN kernels on `device` (see the module doc)."""
    if device.type != "cuda":
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS reductions
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def describe_device(device: torch.device) -> str:
    """`cuda:0 (NVIDIA H100 80GB HBM3)`, `cuda (2 x NVIDIA H100 80GB HBM3)` (the workers' GPUs,
    as this machine sees them), or `cpu (AVX2)`: what a summary records."""
    if device.type == "cuda" and device.index is None:
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        return f"cuda ({len(names)} x {' / '.join(sorted(set(names)))})" if names else "cuda"
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return f"cpu ({torch.backends.cpu.get_cpu_capability()})"


def to_device(tree: Any, device: torch.device) -> Any:
    """Every tensor of a pytree (dicts, lists, tuples, dataclass-free containers) on `device`."""
    if device.type == "cpu":
        return tree
    return tree_map(lambda leaf: leaf.to(device) if isinstance(leaf, torch.Tensor) else leaf, tree)


def pooled_rows(xs: list[torch.Tensor], ys: list[torch.Tensor], device: torch.device
                ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Every client's rows of one split concatenated on `device` once (x, y), with the offset at
    which client c's rows start: the rows of many clients are then one gather (a batched step's
    batches, a batched evaluation's slices) instead of one indexing per client."""
    offsets = [0]
    for y in ys:
        offsets.append(offsets[-1] + len(y))
    x = torch.cat(xs) if xs else torch.empty(0)
    y = torch.cat(ys) if ys else torch.empty(0, dtype=torch.long)
    return x.to(device), y.to(device), offsets


class DeviceData:
    """Clients' tensors copied to the device once, on first use (the identity on the CPU)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cache: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}

    def get(self, cid: int, split: str, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.device.type == "cpu":
            return x, y
        key = (cid, split)
        if key not in self.cache:
            self.cache[key] = (x.to(self.device), y.to(self.device))
        return self.cache[key]

    def clear(self) -> None:
        self.cache.clear()


def seed_device_generator(device: torch.device, seed: int) -> None:
    """Seed `device`'s default generator (dropout masks on a GPU draw from it)."""
    if device.type == "cuda":
        torch.cuda.default_generators[device.index or 0].manual_seed(seed)
