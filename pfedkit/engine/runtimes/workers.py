"""What the runtimes share: one object per model architecture (`ByArchitecture`), the evaluator
(`ModelEvaluator`), a parallel runtime's worker (`ClientWorker`: a forked process, a Ray actor),
and how jobs are handed out (`handed_out`, `dispatch_order`). The methods every runtime has are
the `Runtime` protocol (`pfedkit.engine.protocols`).
"""
from __future__ import annotations

import collections
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence

import torch
from torch import nn

from pfedkit.core.params import Params
from pfedkit.data.federated import FederatedData
from pfedkit.engine.allocator import retain_freed_memory
from pfedkit.engine.protocols import EvalItem, OnInputs
from pfedkit.engine.trainer import FitJob, FitOutcome, LocalTrainer, TrainSettings
from pfedkit.evaluation import ClientEval, evaluate_logits_fn


class ByArchitecture:
    """One object (a trainer, an evaluator) per model architecture, picked by client id.

    With heterogeneous models (`client_model_options`) clients use different architectures:
    `builds` maps an architecture key to its model builder and `model_keys[cid]` names the key of
    client `cid`. Without them every client uses `build`. Other architectures' objects are made on
    first use.
    """

    def __init__(self, build: Callable[[], nn.Module], make: Callable[[Callable[[], nn.Module]], object],
                 builds: Mapping[Hashable, Callable[[], nn.Module]] | None = None,
                 model_keys: Sequence[Hashable] | None = None) -> None:
        self.build, self.make = build, make
        self.builds = dict(builds or {})
        self.model_keys = model_keys
        self.default = make(build)  # the object for `build` (the default architecture)
        self.objects: dict[Hashable, object] = {}

    def __call__(self, cid: int):
        if self.model_keys is None:
            return self.default
        key = self.model_keys[cid]
        if key not in self.objects:
            build = self.builds[key]
            self.objects[key] = self.default if build is self.build else self.make(build)
        return self.objects[key]


class ModelEvaluator:
    """Evaluates parameter sets with one reusable module in eval mode."""

    def __init__(self, build: Callable[[], nn.Module], num_classes: int,
                 device: torch.device = torch.device("cpu")) -> None:
        self.model = build().to(device).eval()
        self.parameters = dict(self.model.named_parameters())
        self.buffers = dict(self.model.named_buffers())
        self.num_classes = num_classes

    @torch.no_grad()
    def evaluate(self, params: Params, buffers: Params | None, x: torch.Tensor, y: torch.Tensor,
                 predict: Callable[[torch.Tensor], torch.Tensor] | None = None) -> ClientEval:
        for name, tensor in self.parameters.items():
            tensor.copy_(params[name])
        for name, tensor in (buffers or {}).items():
            self.buffers[name].copy_(tensor)
        if predict is None:
            logits_fn = self.model
        elif isinstance(predict, OnInputs):  # the algorithm's prediction from the inputs themselves
            logits_fn = predict
        else:  # from the body features of the loaded model
            logits_fn = lambda xb: predict(self.model.body(xb))  # noqa: E731
        return evaluate_logits_fn(logits_fn, x, y, self.num_classes)


class ClientWorker:
    """What a worker of a parallel runtime (a forked process, a Ray actor) holds: one trainer and
    one evaluator per architecture with `threads` torch threads, and the federation's data."""

    def __init__(self, build: Callable[[], nn.Module], settings: TrainSettings, data: FederatedData, threads: int,
                 builds: Mapping[Hashable, Callable[[], nn.Module]] | None = None,
                 model_keys: Sequence[Hashable] | None = None) -> None:
        torch.set_num_threads(threads)
        retain_freed_memory()  # a Ray actor is a process of its own
        self.trainers = ByArchitecture(build, lambda b: LocalTrainer(b, settings), builds, model_keys)
        self.evaluators = ByArchitecture(build, lambda b: ModelEvaluator(b, data.num_classes), builds, model_keys)
        self.data = data

    def fit(self, job: FitJob) -> tuple[int, FitOutcome]:
        client = self.data.clients[job.cid]
        return job.cid, self.trainers(job.cid).fit(job, client.x_train, client.y_train)

    def evaluate(self, item: EvalItem) -> tuple[int, ClientEval]:
        cid, params, buffers, _ = item
        client = self.data.clients[cid]
        return cid, self.evaluators(cid).evaluate(params, buffers, client.x_test, client.y_test)


def split_custom_predict(items: list[EvalItem], evaluators: ByArchitecture, data: FederatedData,
                         remote: Callable[[list[EvalItem]], dict[int, ClientEval]]) -> dict[int, ClientEval]:
    """Evaluate `items` with `remote` (workers), except those with a custom predict (closures over
    algorithm state, which stay in this process) evaluated here with `evaluators`."""
    to_send = [item for item in items if item[3] is None]
    results = remote(to_send) if to_send else {}
    for cid, params, buffers, predict in items:
        if predict is not None:
            client = data.clients[cid]
            results[cid] = evaluators(cid).evaluate(params, buffers, client.x_test, client.y_test, predict)
    return results


def handed_out(items: list) -> Iterator:
    """The items of `items` one by one, each removed from the list (and from here) as it is
    handed out: nothing keeps a job's inputs alive after its result is taken."""
    queue = collections.deque(items)
    items.clear()
    while queue:
        yield queue.popleft()


# Up to this many jobs a parallel runtime sends the largest clients first; beyond, in client order.
LARGEST_FIRST_MAX_JOBS = 64


def dispatch_order(jobs: list[FitJob], data: FederatedData) -> list[FitJob]:
    """The order a parallel runtime hands jobs to idle workers. Few jobs: by decreasing client
    size, which balances the load (the last job to finish is a small one). Many jobs: by client
    id, the order in which the round loop folds results; results then arrive nearly in that order
    and few wait for their turn in memory, while the load is balanced by their number."""
    if len(jobs) > LARGEST_FIRST_MAX_JOBS:
        return sorted(jobs, key=lambda job: job.cid)
    return sorted(jobs, key=lambda job: (-data.clients[job.cid].n_train, job.cid))
