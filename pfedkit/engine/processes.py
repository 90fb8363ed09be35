"""`processes` backend: a round's client updates spread over a pool of worker processes.

Workers are forked once per run, so they inherit the in-memory client tensors (the data are
shared with them once, never copied per round). Each worker owns a `LocalTrainer` and a
`ModelEvaluator` with `threads` torch threads (1 by default: on a shared 2-core machine two
1-thread workers hold up far better than one 2-thread process). Jobs go out largest client first
and idle workers pull the next one, which balances the load by client size. Every job carries its
own seeds, so results are identical to the sequential backend run with the same thread count,
whatever the number of workers.
"""
from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Callable, Hashable, Mapping, Sequence

from torch import nn

from pfedkit.data.federated import FederatedData
from pfedkit.engine.runtime import (ByArchitecture, ClientWorker, EvalItem, ModelEvaluator, largest_first,
                                    split_custom_predict)
from pfedkit.engine.trainer import FitJob, FitOutcome, TrainSettings
from pfedkit.evaluation import ClientEval

# The worker process's ClientWorker, set once by `_init_worker` (inherited through fork, not pickled).
_WORKER: dict[str, ClientWorker] = {}


def _init_worker(*args) -> None:
    _WORKER["worker"] = ClientWorker(*args)


def _fit(job: FitJob) -> tuple[int, FitOutcome]:
    return _WORKER["worker"].fit(job)


def _evaluate(item: EvalItem) -> tuple[int, ClientEval]:
    return _WORKER["worker"].evaluate(item)


def default_workers() -> int:
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


class ProcessRuntime:
    name = "processes"

    def __init__(self, build: Callable[[], nn.Module], settings: TrainSettings, data: FederatedData,
                 workers: int | None = None, threads: int | None = None,
                 builds: Mapping[Hashable, Callable[[], nn.Module]] | None = None,
                 model_keys: Sequence[Hashable] | None = None) -> None:
        if "fork" not in mp.get_all_start_methods():
            raise RuntimeError("the processes backend needs the 'fork' start method (Linux); use backend=sequential")
        self.data = data
        self.workers = workers or default_workers()
        self.pool = mp.get_context("fork").Pool(self.workers, initializer=_init_worker,
                                                initargs=(build, settings, data, threads or 1, builds, model_keys))
        # Custom-predict evaluations (closures over algorithm state) stay in this process.
        self.local_evaluator = ByArchitecture(build, lambda b: ModelEvaluator(b, data.num_classes), builds, model_keys)

    def fit_many(self, jobs: list[FitJob]) -> dict[int, FitOutcome]:
        return dict(self.pool.imap_unordered(_fit, largest_first(jobs, self.data), chunksize=1))

    def evaluate_many(self, items: list[EvalItem]) -> dict[int, ClientEval]:
        return split_custom_predict(items, self.local_evaluator, self.data,
                                    lambda remote: dict(self.pool.imap_unordered(_evaluate, remote, chunksize=1)))

    def close(self) -> None:
        self.pool.close()
        self.pool.join()
