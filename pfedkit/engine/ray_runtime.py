"""`ray` backend: a round's Fit requests as tasks on Ray actors, on this machine or a cluster.

The same division of work as the `processes` backend, on Ray instead of a fork pool: `workers`
actors (default: the cluster's CPUs), each a `ClientWorker` with `threads` torch threads (1 by
default), get the federation's data once through Ray's object store; a round's jobs go out
in `dispatch_order` and an idle actor takes the next one. Every job carries its own seeds, so
results are identical to `processes` (and to `sequential` with the same thread count), whatever
the number of actors or machines.

`ray.address` joins an existing cluster (`ray start --head` on one machine, `ray start
--address=HEAD:6379` on the others); pfedkit must be installed on every machine. None starts a
local Ray for the run and stops it after.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence

from torch import nn

from pfedkit.config import ConfigError
from pfedkit.data.federated import FederatedData
from pfedkit.engine.processes import default_workers
from pfedkit.engine.runtime import (ByArchitecture, ClientWorker, EvalItem, ModelEvaluator, dispatch_order, handed_out,
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


class RayRuntime:
    name = "ray"

    def __init__(self, build: Callable[[], nn.Module], settings: TrainSettings, data: FederatedData,
                 workers: int | None = None, threads: int | None = None,
                 builds: Mapping[Hashable, Callable[[], nn.Module]] | None = None,
                 model_keys: Sequence[Hashable] | None = None, address: str | None = None) -> None:
        ray = import_ray()
        from ray.util import ActorPool

        self.ray, self.data = ray, data
        self.started_ray = not ray.is_initialized()
        if self.started_ray:
            ray.init(address=address, num_cpus=None if address else (workers or default_workers()),
                     include_dashboard=False, log_to_driver=False, configure_logging=False)
        count = workers or max(1, int(ray.cluster_resources().get("CPU", 1)))
        actor = ray.remote(num_cpus=1)(ClientWorker)
        shared = ray.put(data)  # once per run: every actor reads the same copy
        self.threads = threads or 1  # each actor's; the round loop runs this process's work with it too
        self.actors = [actor.remote(build, settings, shared, self.threads, builds, model_keys) for _ in range(count)]
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

    def close(self) -> None:
        for actor in self.actors:
            self.ray.kill(actor)
        self.actors = []
        if self.started_ray:
            self.ray.shutdown()
