"""`ray` backend: a round's Fit requests as tasks on Ray actors, on this machine or a cluster.

The same division of work as the `processes` backend, on Ray instead of a fork pool: `workers`
actors (default: the cluster's CPUs), each a `ClientWorker` with `threads` torch threads (1 by
default), get the federation's data once through Ray's object store; a round's jobs go out
in `dispatch_order` and an idle actor takes the next one. Every job carries its own seeds, so
results are identical to `processes` (and to `sequential` with the same thread count), whatever
the number of actors or machines.

On a GPU run (`device` cuda) each actor asks Ray for `ray.gpus_per_worker` GPUs (default 1;
0.5 puts two actors on a GPU) besides its CPU, and trains there as a `DeviceWorker`: Ray sets the
actor's CUDA_VISIBLE_DEVICES to the GPU it gives it, which the actor sees as cuda:0. `workers`
defaults to as many actors as the cluster's GPUs hold (`actor_plan`); asking for more GPUs than
the cluster has is refused (Ray would wait for them forever). The driver's own `device` check
(`resolve_device`) needs torch to see a GPU on the driver's machine too.

`ray.address` joins an existing cluster (`ray start --head` on one machine, `ray start
--address=HEAD:6379` on the others); pfedkit must be installed on every machine. None starts a
local Ray for the run and stops it after.
"""
from __future__ import annotations

import math
import os
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence

import torch
from torch import nn

from pfedkit.core.errors import ConfigError
from pfedkit.data.federated import FederatedData
from pfedkit.engine.device import describe_device
from pfedkit.engine.protocols import EvalItem
from pfedkit.engine.runtimes.processes import DeviceWorker, default_workers
from pfedkit.engine.runtimes.workers import (ByArchitecture, ClientWorker, ModelEvaluator, dispatch_order, handed_out,
                                             split_custom_predict)
from pfedkit.engine.trainer import FitJob, FitOutcome, TrainSettings
from pfedkit.evaluation import ClientEval


def import_ray():
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")  # CPU runs: leave device variables alone
    try:
        import ray
    except ImportError:
        raise ConfigError("backend=ray needs Ray: pip install -e '.[ray]' (or '.[flower]', which includes it)") from None
    return ray


def gpus_per_actor(device: torch.device, gpus_per_worker: float | None) -> float:
    """The `num_gpus` each actor asks for: 0 on the CPU whatever the config says, else
    `ray.gpus_per_worker` (default 1); ConfigError (one line) for a share Ray cannot give."""
    if device.type != "cuda":
        return 0.0
    gpus = 1.0 if gpus_per_worker is None else float(gpus_per_worker)
    if gpus <= 0:
        raise ConfigError(f"ray.gpus_per_worker={gpus_per_worker} with device={device}: actors would hold no GPU; "
                          "give a share (1, or 0.5 for two actors per GPU) or set device=cpu")
    if gpus > 1 and not gpus.is_integer():
        raise ConfigError(f"ray.gpus_per_worker={gpus_per_worker}: Ray gives a fraction of one GPU or whole GPUs; "
                          "use a value up to 1 or a whole number")
    return gpus


def actor_plan(device: torch.device, workers: int | None, gpus_per_worker: float | None,
               cluster: Mapping[str, float]) -> tuple[int, dict[str, float]]:
    """(how many actors, the options of each: num_cpus, num_gpus) for `cluster`'s resources
    (`ray.cluster_resources()`). CPU: `workers`, default the cluster's CPUs. GPU: `workers`,
    default as many as the cluster's GPUs hold at `gpus_per_worker` each."""
    gpus = gpus_per_actor(device, gpus_per_worker)
    options = {"num_cpus": 1, "num_gpus": gpus}
    if gpus == 0:
        return workers or max(1, int(cluster.get("CPU", 1))), options
    have = float(cluster.get("GPU", 0))
    fits = math.floor(have / gpus + 1e-9)
    if workers is None and fits < 1:
        raise ConfigError(f"device={device}: the Ray cluster has {have:g} GPU(s); an actor asks for {gpus:g} "
                          "(ray.gpus_per_worker); set device=cpu or join a cluster with GPUs (ray.address)")
    count = workers or fits
    if count * gpus > have + 1e-9:
        raise ConfigError(f"workers={count} x ray.gpus_per_worker={gpus:g} asks for {count * gpus:g} GPUs; the Ray "
                          f"cluster has {have:g} (lower workers, or share GPUs with a smaller ray.gpus_per_worker)")
    return count, options


class RayRuntime:
    name = "ray"

    def __init__(self, build: Callable[[], nn.Module], settings: TrainSettings, data: FederatedData,
                 workers: int | None = None, threads: int = 1,
                 builds: Mapping[Hashable, Callable[[], nn.Module]] | None = None,
                 model_keys: Sequence[Hashable] | None = None, address: str | None = None,
                 device: torch.device = torch.device("cpu"), gpus_per_worker: float | None = None) -> None:
        ray = import_ray()
        from ray.util import ActorPool

        gpus_per_actor(device, gpus_per_worker)  # a refused share before Ray starts
        self.ray, self.data, self.device = ray, data, device
        self.started_ray = not ray.is_initialized()
        if self.started_ray:
            ray.init(address=address, num_cpus=None if address else (workers or default_workers()),
                     include_dashboard=False, log_to_driver=False, configure_logging=False)
        try:
            count, options = actor_plan(device, workers, gpus_per_worker, ray.cluster_resources())
        except ConfigError:
            self.close_ray()
            raise
        shared = ray.put(data)  # once per run: every actor reads the same copy
        self.threads = threads  # each actor's; the round loop runs this process's work with it too
        if options["num_gpus"]:  # Ray makes the actor's GPU its cuda:0
            actor = ray.remote(**options)(DeviceWorker)
            args = (build, settings, shared, self.threads, builds, model_keys, torch.device("cuda", 0))
        else:
            actor = ray.remote(**options)(ClientWorker)
            args = (build, settings, shared, self.threads, builds, model_keys)
        self.actors = [actor.remote(*args) for _ in range(count)]
        self.pool = ActorPool(self.actors)
        self.local_evaluator = ByArchitecture(build, lambda b: ModelEvaluator(b, data.num_classes), builds, model_keys)

    def fit_stream(self, jobs: list[FitJob]) -> Iterator[tuple[int, FitOutcome]]:
        ordered = dispatch_order(jobs, self.data)
        jobs.clear()  # the caller's list: emptied as the other runtimes do
        yield from self.pool.map_unordered(lambda worker, job: worker.fit.remote(job), handed_out(ordered))

    def fit_many(self, jobs: list[FitJob]) -> dict[int, FitOutcome]:
        return dict(self.fit_stream(jobs))

    def evaluate_many(self, items: list[EvalItem]) -> dict[int, ClientEval]:
        return split_custom_predict(items, self.local_evaluator, self.data, lambda remote: dict(
            self.pool.map_unordered(lambda worker, item: worker.evaluate.remote(item), remote)))

    def describe_devices(self) -> str:
        return describe_device(self.device)

    def close(self) -> None:
        for actor in self.actors:
            self.ray.kill(actor)
        self.actors = []
        self.close_ray()

    def close_ray(self) -> None:
        if self.started_ray:
            self.ray.shutdown()
            self.started_ray = False
