"""`sequential` backend, the reference: one client after another in this process. Every runtime
has the same methods (the `Runtime` protocol, `pfedkit.engine.protocols`), so the round loop
never knows which runs:

    fit_stream(jobs) -> iterator of (cid, FitOutcome), in any order, as they are done (the list is
                        emptied as jobs are handed out, so their inputs can be freed early)
    fit_many(jobs) -> {cid: FitOutcome}          # all of them at once
    evaluate_many(items) -> {cid: ClientEval}    # (cid, params, buffers, predict) per client

The round loop consumes `fit_stream`, so a result can be folded into the aggregate and dropped
before the next one arrives: memory stays flat in the number of clients.
"""
from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence

import torch
from torch import nn

from pfedkit.core.threads import thread_count
from pfedkit.data.federated import FederatedData
from pfedkit.engine.device import DeviceData, describe_device
from pfedkit.engine.protocols import EvalItem
from pfedkit.engine.runtimes.workers import ByArchitecture, ModelEvaluator, handed_out
from pfedkit.engine.trainer import FitJob, FitOutcome, LocalTrainer, TrainSettings
from pfedkit.evaluation import ClientEval


class SequentialRuntime:
    """One client after another in this process, with `threads` torch threads, on `device`
    (clients' data copied there once; an algorithm's custom `predict` evaluates on the host)."""
    name = "sequential"

    def __init__(self, build: Callable[[], nn.Module], settings: TrainSettings, data: FederatedData,
                 threads: int | None = None, builds: Mapping[Hashable, Callable[[], nn.Module]] | None = None,
                 model_keys: Sequence[Hashable] | None = None, device: torch.device = torch.device("cpu")) -> None:
        self.threads = threads
        self.device = device
        self.trainers = ByArchitecture(build, lambda b: LocalTrainer(b, settings, device), builds, model_keys)
        self.evaluators = ByArchitecture(build, lambda b: ModelEvaluator(b, data.num_classes), builds, model_keys)
        self.device_evaluators = self.evaluators if device.type == "cpu" else \
            ByArchitecture(build, lambda b: ModelEvaluator(b, data.num_classes, device), builds, model_keys)
        self.trainer, self.evaluator = self.trainers.default, self.evaluators.default  # default architecture
        self.data = data
        self.device_data = DeviceData(device)

    def fit_stream(self, jobs: list[FitJob]) -> Iterator[tuple[int, FitOutcome]]:
        queue = handed_out(jobs)
        for job in queue:
            client = self.data.clients[job.cid]
            x, y = self.device_data.get(job.cid, "train", client.x_train, client.y_train)
            with thread_count(self.threads):
                outcome = self.trainers(job.cid).fit(job, x, y)
            yield job.cid, outcome

    def fit_many(self, jobs: list[FitJob]) -> dict[int, FitOutcome]:
        return dict(self.fit_stream(jobs))

    def evaluate_many(self, items: list[EvalItem]) -> dict[int, ClientEval]:
        out = {}
        with thread_count(self.threads):
            for cid, params, buffers, predict in items:
                client = self.data.clients[cid]
                if predict is not None:  # a closure over host tensors of the algorithm
                    out[cid] = self.evaluators(cid).evaluate(params, buffers, client.x_test, client.y_test, predict)
                    continue
                x, y = self.device_data.get(cid, "test", client.x_test, client.y_test)
                out[cid] = self.device_evaluators(cid).evaluate(params, buffers, x, y)
        return out

    def describe_devices(self) -> str:
        return describe_device(self.device)

    def close(self) -> None:
        self.device_data.clear()
