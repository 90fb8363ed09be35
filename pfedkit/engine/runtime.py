"""Runtimes answer a round's training requests and evaluate clients; the sequential one is the
reference. Every runtime has the same methods, so the round loop never knows which runs:

    fit_stream(jobs) -> iterator of (cid, FitOutcome), in any order, as they are done (the list is
                        emptied as jobs are handed out, so their inputs can be freed early)
    fit_many(jobs) -> {cid: FitOutcome}          # all of them at once
    evaluate_many(items) -> {cid: ClientEval}    # (cid, params, buffers) per client

The round loop consumes `fit_stream`, so a result can be folded into the aggregate and dropped
before the next one arrives: memory stays flat in the number of clients.
"""
from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence

import torch
from torch import nn

from pfedkit.algorithms.params import Params
from pfedkit.data.federated import FederatedData
from pfedkit.engine.allocator import retain_freed_memory
from pfedkit.engine.device import DeviceData
from pfedkit.engine.trainer import FitJob, FitOutcome, LocalTrainer, TrainSettings
from pfedkit.evaluation import ClientEval, evaluate_logits_fn

# (cid, params, buffers, predict): predict maps body features to logits when the algorithm does
# not use the model's head for prediction, else None.
EvalItem = tuple[int, Params, Params | None, Callable[[torch.Tensor], torch.Tensor] | None]


@contextlib.contextmanager
def thread_count(threads: int | None):
    """torch's thread count is process-wide: set it for one runtime call only (None: unchanged).

    A runtime that sets it inside `fit_stream` restores it before each `yield`: the caller's
    code between results (client updates, aggregation) runs at the run's count (`compute_threads`)."""
    previous = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def resolved_threads(threads: int | None) -> int:
    """A runtime's `threads` as a number: None means this process's torch count now (all cores
    unless someone changed it)."""
    return int(threads) if threads else torch.get_num_threads()


class _NativePools:
    """threadpoolctl's view of the BLAS and OpenMP libraries loaded in this process.

    Scanning the loaded libraries costs ~3 ms, so the scan is kept and redone only when modules
    were imported since (a new BLAS, e.g. scipy's, arrives with an import)."""

    def __init__(self) -> None:
        self.controller = None
        self.modules_seen = -1

    def limit(self, threads: int):
        import sys

        from threadpoolctl import ThreadpoolController

        if self.controller is None or len(sys.modules) != self.modules_seen:
            self.controller, self.modules_seen = ThreadpoolController(), len(sys.modules)
        return self.controller.limit(limits=threads)


_NATIVE_POOLS = _NativePools()


@contextlib.contextmanager
def compute_threads(threads: int):
    """Run the enclosed computation with `threads` threads everywhere this process computes:
    torch's intra-op pool and the BLAS/OpenMP pools torch's setting does not reach (numpy's and
    scipy's OpenBLAS: FedPAC's eigh and NNLS, CFL's clustering), through threadpoolctl.

    The round loop runs every piece of algorithm code (server and client side) and the runtimes'
    work in this process under the run's count, so kernels (oneDNN, MKL, OpenBLAS pick their
    blocking by thread count) and hence numbers do not depend on the backend."""
    with thread_count(threads), _NATIVE_POOLS.limit(threads):
        yield


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
        logits_fn = self.model if predict is None else (lambda xb: predict(self.model.body(xb)))
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

    def close(self) -> None:
        self.device_data.clear()
