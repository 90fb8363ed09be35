"""Which device a run trains and evaluates on (`device` config key), and moving things there.

`device` is `cpu`, `cuda`, `cuda:N` or `auto`. `auto` picks the first CUDA device for the
sequential and vectorized backends when torch sees one, else the CPU. The processes and ray
backends train on CPUs (`auto` gives them the CPU; `cuda` is refused with a one-line message):
their workers are forked, and a process forked after CUDA was used cannot use it (a test of
forked GPU workers hung on an H100; spawned workers would need the data shipped to each).

What lives where on a GPU (sequential and vectorized alike):
  * each client's training and test tensors are copied to the device once, on first use, and
    kept there for the run (data are small next to what the device holds);
  * client states, server state and every message stay on the host (or on disk): a client's
    parameters are copied in when it trains or is evaluated and the results copied back. So
    memory on the device does not grow with the number of clients beyond their data;
  * algorithm code (broadcast, aggregate, custom `predict`) runs on the host, as on a CPU run.

Numerics on a GPU: fp32 means fp32 (TF32 is switched off for matmuls and convolutions, whose
cuDNN default is TF32), and cuDNN is asked for deterministic kernels, so a GPU run repeats
itself bit for bit; it does not equal a CPU run bit for bit (other kernels), only within float
rounding.
"""
from __future__ import annotations

import os
import re
from typing import Any

import torch
from torch.utils._pytree import tree_map

from pfedkit.config import ConfigError

DEVICE_PATTERN = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")
GPU_BACKENDS = ("sequential", "vectorized")


def resolve_device(spec: str, backend: str) -> torch.device:
    """The torch device of `spec` for `backend`; ConfigError (one line) when it cannot be used."""
    if not DEVICE_PATTERN.match(spec):
        raise ConfigError(f"device: {spec!r} is not a device; use cpu, cuda, cuda:N or auto")
    if spec == "cpu" or (spec == "auto" and (backend not in GPU_BACKENDS or not cuda_available())):
        return torch.device("cpu")
    device = torch.device("cuda" if spec == "auto" else spec)
    if backend not in GPU_BACKENDS:
        raise ConfigError(f"device={spec}: backend={backend} trains in CPU worker processes; on a GPU use "
                          "backend=sequential or backend=vectorized, or set device=cpu")
    if not cuda_available():
        raise ConfigError(f"device={spec}: torch sees no CUDA device here (torch {torch.__version__}, CUDA build: "
                          f"{torch.version.cuda or 'no'}); use device=cpu or device=auto")
    index = 0 if device.index is None else device.index
    if index >= torch.cuda.device_count():
        raise ConfigError(f"device={spec}: there are {torch.cuda.device_count()} CUDA device(s) (cuda:0 .. "
                          f"cuda:{torch.cuda.device_count() - 1})")
    device = torch.device("cuda", index)
    make_deterministic(device)
    return device


def cuda_available() -> bool:
    """Whether torch sees a GPU, asked through NVML (torch.cuda.device_count) rather than the CUDA
    runtime: nothing initialises CUDA in this process, so the processes backend can still fork
    workers that use it."""
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
    """`cuda:0 (NVIDIA H100 80GB HBM3)`, or `cpu (AVX2)`: what a summary records."""
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return f"cpu ({torch.backends.cpu.get_cpu_capability()})"


def to_device(tree: Any, device: torch.device) -> Any:
    """Every tensor of a pytree (dicts, lists, tuples, dataclass-free containers) on `device`."""
    if device.type == "cpu":
        return tree
    return tree_map(lambda leaf: leaf.to(device) if isinstance(leaf, torch.Tensor) else leaf, tree)


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
