"""Factories: what a run is made of, built from its config. The model builders (`architectures`),
the algorithm (`build_algorithm`), the trainer settings, the run's thread count (`run_threads`,
passed to both of the next), the runtime (`make_runtime`, through `RUNTIMES`: one row per backend)
and the round loop (`simulation_for`). `pfedkit.runs` (the run
lifecycle), the Flower server and nodes, `pfedkit bench` and the experiments build through here.

Adding a runtime: its module in engine/runtimes/ (satisfying `pfedkit.engine.protocols.Runtime`),
its name in `pfedkit.core.backends.BACKENDS` (what the config and the command line accept) and its
row in `RUNTIMES` below; the two are checked against each other when this module is imported.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pfedkit.algorithms import algorithm_names, get_algorithm
from pfedkit.config import Config, per_client_model_options
from pfedkit.core.backends import BACKENDS
from pfedkit.core.contract import Setup
from pfedkit.core.errors import ConfigError
from pfedkit.core.model_ops import ModelOps
from pfedkit.core.seeds import SERVER, derive_seed
from pfedkit.data.datasets import default_model
from pfedkit.data.federated import FederatedData
from pfedkit.engine.allocator import retain_freed_memory
from pfedkit.engine.client_states import Placement
from pfedkit.engine.device import resolve_device
from pfedkit.engine.protocols import Clients, Runtime
from pfedkit.engine.runtimes.processes import ProcessRuntime
from pfedkit.engine.runtimes.sequential import SequentialRuntime
from pfedkit.engine.simulate import Simulation
from pfedkit.engine.trainer import TrainSettings
from pfedkit.models import build_model, model_info
from pfedkit.models.initial_weights import load_initial_weights, read_initial_weights
from pfedkit.privacy.dp_sgd import batchnorm_to_groupnorm
from pfedkit.privacy.setup import check_client_dp, check_sample_dp, client_dp_aggregation


def model_name(config: Config) -> str:
    return default_model(config.dataset) if config.model == "auto" else config.model


def model_builder(config: Config, input_shape, num_classes: int, head: str, channels_last: bool,
                  options: dict[str, Any] | None = None):
    """A builder of the run's model with `options` (default: `model_options`)."""
    name = model_name(config)
    options = dict(config.model_options if options is None else options)
    if "head" in options:  # the split is the run's, not one architecture's
        raise ConfigError("model_options.head: the body/head split is set by head_split (e.g. head_split=fc), "
                          "where the algorithm allows a choice")
    weights = read_initial_weights(config.init_weights) if config.init_weights else None

    def build():
        # Every instance starts from the same seeded weights; the global RNG is left untouched.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(derive_seed(config.seed, 0, SERVER, "model-init"))
            model = build_model(name, tuple(input_shape), num_classes, head=head, **options)
        if weights is not None:
            model = load_initial_weights(model, weights, config.init_weights)
        if config.dp.level == "sample" and config.dp.replace_batchnorm:  # DP-SGD: no BatchNorm (docs/privacy.md)
            model = batchnorm_to_groupnorm(model)
        return model.to(memory_format=torch.channels_last) if channels_last else model
    return build


def architecture_key(options: dict[str, Any]) -> tuple:
    """Identifies an architecture: its model options, sorted (values as YAML would write them)."""
    return tuple(sorted((name, json.dumps(value, sort_keys=True)) for name, value in options.items()))


@dataclass
class Architectures:
    """The run's model builders: `build` (the default, from `model_options`), and with
    `client_model_options` one builder per distinct architecture (`builds`) and each client's key."""
    build: Any
    builds: dict[tuple, Any] | None = None
    model_keys: list[tuple] | None = None

    def keywords(self) -> dict[str, Any]:
        """The runtimes' per-architecture arguments (`builds`, `model_keys`)."""
        return {"builds": self.builds, "model_keys": self.model_keys}


def architectures(config: Config, input_shape, num_classes: int, head: str, channels_last: bool) -> Architectures:
    build = model_builder(config, input_shape, num_classes, head, channels_last)
    per_client = per_client_model_options(config)
    if per_client is None:
        return Architectures(build)
    if config.init_weights:
        raise ConfigError("init_weights holds one architecture's weights; with client_model_options the clients "
                          "have several: leave one of the two out")
    builds = {architecture_key(config.model_options): build}
    keys = [architecture_key(options) for options in per_client]
    for key, options in zip(keys, per_client):
        if key not in builds:
            builds[key] = model_builder(config, input_shape, num_classes, head, channels_last, options)
    return Architectures(build, builds, keys)


def uses_channels_last(config: Config, input_shape) -> bool:
    return config.channels_last and len(input_shape) == 3


def check_precision(config: Config) -> None:
    """precision=bf16 trains in bf16 only where the hardware has it: a GPU or a CPU with native
    bf16 kernels (AVX512_BF16 / AMX). Elsewhere oneDNN falls back to slow reference kernels:
    FedAvgCNN trained 9x slower than fp32 on an AVX2 CPU here."""
    if config.precision != "bf16" or resolve_device(config.device, config.backend).type == "cuda":
        return
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        raise ConfigError(f"precision=bf16: this CPU ({torch.backends.cpu.get_cpu_capability()}) has no native bf16 "
                          "(AVX512_BF16 or AMX); bf16 would run ~9x slower than fp32 here. Use precision=fp32")


def simulation_for(config: Config, algorithm, data: FederatedData, runtime: Runtime | None, threads: int,
                   clients: Clients | None = None, placement: Placement = Placement()) -> Simulation:
    """The round loop with the config's schedule, computing with `threads` (`run_threads`: the
    runtime's count), aggregating through client-level DP's noised mean where the config asks for
    it (`dp.level=client`); `clients`: the clients' side (default: local, its states placed by
    `placement`)."""
    return Simulation(algorithm, data, runtime, threads=threads,
                      start_aggregation=client_dp_aggregation(config, algorithm), rounds=config.rounds,
                      seed=config.seed, join_ratio=config.join_ratio, eval_every=config.eval_every,
                      keep_optimizer_state=config.keep_optimizer_state, eval_point=config.eval_point,
                      participants=config.participants, clients=clients, placement=placement,
                      new_clients=config.new_clients, new_client_finetune=config.new_client_finetune)


def head_split(config: Config, algo_cls) -> str:
    """Which layers form the head: config `head_split` where the algorithm allows that split
    (`Algorithm.head_splits`) and the model has it, else the algorithm's own `head`."""
    if config.head_split is None or config.head_split == algo_cls.head:
        return algo_cls.head
    allowed = (algo_cls.head, *(algo_cls.head_splits or ()))
    if config.head_split not in allowed:
        choosers = [name for name in algorithm_names() if get_algorithm(name).head_splits]
        raise ConfigError(f"head_split={config.head_split}: algorithm {config.algorithm} works with "
                          f"{' or '.join(allowed)} only; head_split applies to {', '.join(choosers)}")
    heads = model_info(model_name(config)).heads
    if config.head_split not in heads:
        raise ConfigError(f"head_split={config.head_split}: model {model_name(config)} has the splits "
                          f"{', '.join(heads)}")
    return config.head_split


def build_algorithm(config: Config, input_shape, num_classes: int, train_counts: np.ndarray):
    """The run's algorithm (checked) and its Architectures, from the federation's shape and
    per-client class counts: what the simulation and every Flower node build alike."""
    algo_cls = get_algorithm(config.algorithm)
    channels_last = uses_channels_last(config, input_shape)
    head = head_split(config, algo_cls)
    archs = architectures(config, input_shape, num_classes, head, channels_last)
    try:
        ops_by_key = {key: ModelOps(build) for key, build in (archs.builds or {None: archs.build}).items()}
    except ConfigError:  # already says which option (init_weights)
        raise
    except ValueError as err:  # a model option the model does not have, or a bad value
        raise ConfigError(f"model_options / client_model_options: {err}") from None
    ops = ops_by_key[None] if archs.builds is None else ops_by_key[architecture_key(config.model_options)]
    if head != algo_cls.head and not any(name.startswith("body.") for name in ops.initial_params()):
        raise ConfigError(f"head_split={config.head_split}: model {model_name(config)} has no layers before its "
                          "fully connected ones, so its body would be empty; use a model with a body (e.g. cnn)")
    client_ops = None if archs.model_keys is None else tuple(ops_by_key[key] for key in archs.model_keys)
    setup = Setup(len(train_counts), num_classes, train_counts, config.seed, config.local_epochs, ops,
                  client_ops, rounds=config.rounds)
    algorithm = algo_cls(config.hyper(), setup)
    algorithm.check()
    check_client_dp(config, algorithm)  # dp.level=client: refused here unless the aggregate is a mean
    if config.dp.level == "sample":
        check_sample_dp(config, archs.build())
    return algorithm, archs


def train_settings(config: Config) -> TrainSettings:
    return TrainSettings(config.local_epochs, config.batch_size, config.lr, config.momentum,
                         config.weight_decay, config.grad_clip, config.drop_last, config.precision, config.seed,
                         config.keep_optimizer_state, config.compile,
                         dp_sample_clip=config.dp.sample_clip if config.dp.level == "sample" else None,
                         dp_sample_noise=config.dp.sample_noise_multiplier, local_steps=config.local_steps)


# ------------------------------------------------------------------ runtimes, one factory per backend
# Each takes (config, the run's Architectures, its TrainSettings, the data, the resolved device,
# the run's thread count from `run_threads`).

def sequential_runtime(config: Config, archs: Architectures, settings: TrainSettings, data: FederatedData,
                       device: torch.device, threads: int) -> Runtime:
    return SequentialRuntime(archs.build, settings, data, threads=threads, device=device, **archs.keywords())


def process_runtime(config: Config, archs: Architectures, settings: TrainSettings, data: FederatedData,
                    device: torch.device, threads: int) -> Runtime:
    return ProcessRuntime(archs.build, settings, data, workers=config.workers, threads=threads, device=device,
                          **archs.keywords())


def vectorized_runtime(config: Config, archs: Architectures, settings: TrainSettings, data: FederatedData,
                       device: torch.device, threads: int) -> Runtime:
    from pfedkit.engine.runtimes.vectorized import VectorizedRuntime  # torch.func: loaded when used
    return VectorizedRuntime(archs.build, settings, data, threads=threads, device=device, step=config.vectorized.step,
                             max_clients=config.vectorized.max_clients, **archs.keywords())


def ray_runtime(config: Config, archs: Architectures, settings: TrainSettings, data: FederatedData,
                device: torch.device, threads: int) -> Runtime:
    from pfedkit.engine.runtimes.ray import RayRuntime
    return RayRuntime(archs.build, settings, data, workers=config.workers, threads=threads,
                      address=config.ray.address, device=device, gpus_per_worker=config.ray.gpus_per_worker,
                      **archs.keywords())


RuntimeFactory = Callable[[Config, Architectures, TrainSettings, FederatedData, torch.device, int], Runtime]


@dataclass(frozen=True)
class Backend:
    """A row of the backend table: the function that builds its runtime, and whether its clients
    train in several processes side by side (each then computes with one thread unless the config's
    `threads` says otherwise: more would crowd the cores)."""
    make: RuntimeFactory
    side_by_side: bool


# config `backend` -> its row.
RUNTIMES: dict[str, Backend] = {
    "sequential": Backend(sequential_runtime, side_by_side=False),
    "processes": Backend(process_runtime, side_by_side=True),
    "vectorized": Backend(vectorized_runtime, side_by_side=False),
    "ray": Backend(ray_runtime, side_by_side=True),
}


def check_backends(runtimes: Mapping[str, Backend], names: Sequence[str]) -> None:
    """The config and the command line accept exactly the backends built here, in the same order.
    Run at import (a raise, not an assert: `python -O` keeps it)."""
    if tuple(runtimes) != tuple(names):
        raise ImportError(f"pfedkit.build.RUNTIMES {tuple(runtimes)} and pfedkit.core.backends.BACKENDS "
                          f"{tuple(names)} differ: a backend needs its name there and its row here")


check_backends(RUNTIMES, BACKENDS)


def backend_row(config: Config) -> Backend:
    """The configured backend's row of `RUNTIMES` (one line naming the allowed ones if none)."""
    row = RUNTIMES.get(config.backend)
    if row is None:
        raise ConfigError(f"backend: {config.backend!r} is not available; allowed: {', '.join(RUNTIMES)}")
    return row


def run_threads(config: Config, side_by_side: bool | None = None) -> int:
    """The ONE thread count the run computes with, decided here and passed to the runtime and to
    the round loop (docs/architecture.md, "One thread count per run"): the config's `threads`,
    else 1 where clients train in processes side by side (processes, ray; Flower nodes pass
    `side_by_side=True`), else this process's torch count (all cores: sequential, vectorized).
    `side_by_side`: None, the configured backend's."""
    if config.threads:
        return config.threads
    if side_by_side is None:
        side_by_side = backend_row(config).side_by_side
    return 1 if side_by_side else torch.get_num_threads()


def make_runtime(config: Config, archs: Architectures | Any, data: FederatedData, threads: int) -> Runtime:
    """The configured runtime, computing with `threads` (`run_threads`); `archs`: the run's
    Architectures (or one model builder)."""
    if not isinstance(archs, Architectures):
        archs = Architectures(archs)
    row = backend_row(config)
    retain_freed_memory()  # every runtime (forked workers inherit it): no page faults per step
    settings = train_settings(config)
    device = resolve_device(config.device, config.backend)
    return row.make(config, archs, settings, data, device, threads)
