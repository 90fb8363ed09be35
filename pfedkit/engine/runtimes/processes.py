"""`processes` backend: a round's client updates spread over a pool of worker processes.

Workers are forked once per run, so they inherit the in-memory client tensors (the data are
shared with them once, never copied per round). Each worker owns a `LocalTrainer` and a
`ModelEvaluator` with `threads` torch threads (1 by default: on a shared 2-core machine two
1-thread workers hold up far better than one 2-thread process); the algorithm's code in this
process (client updates, broadcast, aggregation, custom predict) runs with the same count. Idle
workers pull the next job (`dispatch_order`: largest client first for a few jobs, client order
for many). Every job carries its own seeds, so results are identical to the sequential backend
run with the same thread count, whatever the number of workers.

Jobs and results travel through `transport` (`Channels`): the tensors that several jobs carry
(the broadcast model) are written once per wave into a shared arena mapped by every worker, a
job's own tensors go through an inbox slot ring and results through an outbox ring; only
references go through the pool's pipes. Results stream back as they are done (`fit_stream`).

On a GPU (`device` cuda) the workers are *spawned* (`start_method`): a process forked after CUDA
was used in its parent cannot use CUDA, and a test of forked GPU workers hung on an H100. A
spawned worker shares nothing with this process, so at its start it receives, once, the model
builder (cloudpickled: it is a closure) and the federation's data (raw tensor bytes), builds a
`DeviceWorker` (a `SequentialRuntime` on its GPU: `make_deterministic`, clients' tensors kept on
the GPU after first use) and takes its device from `worker_devices` in the order workers start.
Jobs and results then travel pickled through the pool's pipes (`PipeChannels`): the shared
mappings and locks of `Channels` are inherited through fork only, and on a GPU a client's
training takes far longer than a few ms of pipe. Results are the same as with forked workers on
the same device (the spawned path runs on the CPU too; tests compare it with the forked one).
"""
from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence

import torch
from torch import nn

from pfedkit.core.contract import message_bytes
from pfedkit.data.federated import FederatedData
from pfedkit.engine.allocator import retain_freed_memory
from pfedkit.engine.device import describe_device, make_deterministic, worker_devices
from pfedkit.engine.protocols import EvalItem
from pfedkit.engine.runtimes import transport
from pfedkit.engine.runtimes.sequential import SequentialRuntime
from pfedkit.engine.runtimes.workers import (ByArchitecture, ClientWorker, ModelEvaluator, dispatch_order, handed_out,
                                             split_custom_predict)
from pfedkit.core.threads import thread_count
from pfedkit.engine.trainer import FitJob, FitOutcome, TrainSettings
from pfedkit.evaluation import ClientEval

# The worker process's worker and channels, set once by `_init_worker` (inherited through fork,
# not pickled) or `_init_spawned_worker`.
_WORKER: dict[str, object] = {}


class Channels:
    """The shared buffers between a runtime and its workers (see `pfedkit.engine.runtimes.transport`):
    the wave arena, an inbox ring for each job's own tensors, an outbox ring for results."""

    def __init__(self, model_bytes: int, workers: int) -> None:
        tag = f"pfedkit-{os.getpid()}-{id(self)}"
        slot = 4 * model_bytes + (1 << 20)  # a model, its extras, buffers and optimizer state
        self.wave = transport.WaveArena(f"{tag}-wave", 4 * model_bytes + (16 << 20))
        self.inbox = transport.SlotRing(f"{tag}-inbox", workers + 2, slot)
        self.outbox = transport.SlotRing(f"{tag}-outbox", workers + 1, slot)
        self.abandoned = False  # set when a stream stops early: writers stop waiting for slots
        transport.register(self.wave, self.inbox, self.outbox)

    def close(self) -> None:
        transport.unregister(self.wave, self.inbox, self.outbox)

    def publish(self, tensors: list[torch.Tensor]) -> dict:
        """(main) write a wave's shared tensors into the arena; their references."""
        return self.wave.publish(tensors)

    def job(self, item, wave_refs: dict, own: list[torch.Tensor]) -> bytes:
        """(main) `item` pickled, with `own` tensors (those not in the wave) in an inbox slot."""
        slot, refs = None, {}
        if own:
            slot = self.inbox.acquire(lambda: self.abandoned)
            refs = self.inbox.write_slot(slot, own, copy=False)
        return transport.dumps((slot, item), {**wave_refs, **refs})

    def serve(self, payload: bytes, handle) -> bytes:
        """(worker) run `handle` on the job; its result's tensors go out through an outbox slot."""
        slot, item = transport.loads(payload)
        try:
            result = handle(item)
            tensors = list(transport.tensors_in(result))
            out_slot = self.outbox.acquire() if tensors else None
            refs = self.outbox.write_slot(out_slot, tensors, copy=True) if tensors else {}
            return transport.dumps((out_slot, result), refs)
        finally:  # the result is written: the job's inputs may be overwritten now
            if slot is not None:
                self.inbox.release(slot)

    def result(self, payload: bytes):
        """(main) the result, copied out of its outbox slot, which is freed."""
        slot, result = transport.loads(payload)
        if slot is not None:
            self.outbox.release(slot)
        return result


class PipeChannels:
    """Spawned workers' channels: each job and result pickled whole through the pool's pipes
    (tensors as raw bytes, layouts kept, so results are bit-identical to `Channels`)."""
    abandoned = False

    def publish(self, tensors: list[torch.Tensor]) -> dict:
        return {}

    def job(self, item, wave_refs: dict, own: list[torch.Tensor]) -> bytes:
        return transport.dumps(item)

    def serve(self, payload: bytes, handle) -> bytes:
        return transport.dumps(handle(transport.loads(payload)))

    def result(self, payload: bytes):
        return transport.loads(payload)

    def close(self) -> None:
        pass


class DeviceWorker:
    """A worker that trains on `device` (a spawned process, a Ray actor on a GPU): a
    `SequentialRuntime` there, answering one job at a time, with `threads` torch threads."""

    def __init__(self, build: Callable[[], nn.Module], settings: TrainSettings, data: FederatedData, threads: int,
                 builds: Mapping[Hashable, Callable[[], nn.Module]] | None = None,
                 model_keys: Sequence[Hashable] | None = None, device: torch.device = torch.device("cpu")) -> None:
        torch.set_num_threads(threads)
        retain_freed_memory()  # a process of its own
        if device.type == "cuda":
            torch.cuda.set_device(device)
            make_deterministic(device)  # this process's switches (the parent's are not inherited)
        self.device = device
        self.runtime = SequentialRuntime(build, settings, data, threads=threads, builds=builds,
                                         model_keys=model_keys, device=device)

    def fit(self, job: FitJob) -> tuple[int, FitOutcome]:
        return next(self.runtime.fit_stream([job]))

    def evaluate(self, item: EvalItem) -> tuple[int, ClientEval]:
        return item[0], self.runtime.evaluate_many([item])[item[0]]


PR_SET_PDEATHSIG = 1  # linux/prctl.h: the signal this process gets when its parent ends


def die_with_parent(parent: int | None) -> None:
    """(worker) End this process when `parent`, the main process, ends, however it ends.

    A run stopped by SIGTERM (a scheduler's time limit) or SIGKILL runs no cleanup, and a pool's
    workers would live on under PID 1, each holding the federation's data and a core. On Linux
    the kernel sends SIGKILL to this process when its parent dies (`prctl(PR_SET_PDEATHSIG)`);
    elsewhere a daemon thread watches the parent's pid. None: not a pool's worker (a test calling
    an initializer in its own process), nothing to do."""
    if parent is None:
        return
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0:
            if os.getppid() != parent:  # the parent ended before the request took effect
                os._exit(1)
            return
    threading.Thread(target=_exit_when_orphaned, args=(parent,), daemon=True, name="die-with-parent").start()


def _exit_when_orphaned(parent: int, period: float = 0.5) -> None:
    while os.getppid() == parent:
        time.sleep(period)
    os._exit(1)


def _init_worker(channels: Channels, parent: int | None, *args) -> None:
    die_with_parent(parent)
    _WORKER["channels"] = channels
    _WORKER["worker"] = ClientWorker(*args)


def pack_builders(build, builds, model_keys) -> bytes:
    """The model builders for spawned workers: cloudpickled (the run's builder is a closure)."""
    try:
        import cloudpickle as pickler
    except ImportError:  # plain pickle: enough for builders defined at module level
        import pickle as pickler
    try:
        return pickler.dumps((build, builds, model_keys))
    except Exception as err:  # noqa: BLE001 - pickle raises several types for unpicklable objects
        raise RuntimeError(f"processes backend on a GPU: the model builder cannot be sent to spawned workers "
                           f"({type(err).__name__}: {err}); pip install cloudpickle") from None


def _init_spawned_worker(parent: int | None, started, devices: list[str], builders: bytes, settings: TrainSettings,
                         data: bytes, threads: int) -> None:
    """(spawned worker) take the next worker number's device, unpack builders and data once."""
    import pickle

    die_with_parent(parent)
    with started.get_lock():
        number = started.value
        started.value += 1
    _WORKER["channels"] = PipeChannels()
    try:
        build, builds, model_keys = pickle.loads(builders)  # cloudpickle's output loads with pickle
        _WORKER["worker"] = DeviceWorker(build, settings, transport.loads(data), threads, builds, model_keys,
                                         torch.device(devices[number % len(devices)]))
    except Exception as err:  # noqa: BLE001 - a pool restarts a worker whose initializer raises, forever:
        # keep the error and raise it with the first job instead, so the run stops with it
        _WORKER["error"] = f"a spawned worker could not start: {type(err).__name__}: {err}"


def _worker():
    if "error" in _WORKER:
        raise RuntimeError(_WORKER["error"])
    return _WORKER["worker"]


def _fit(payload: bytes) -> bytes:
    return _WORKER["channels"].serve(payload, _worker().fit)


def _evaluate(payload: bytes) -> bytes:
    return _WORKER["channels"].serve(payload, _worker().evaluate)


OMP_PAUSE_SOFT = 1  # omp_pause_resource_t's omp_pause_soft (OpenMP 5.0)


def release_openmp_threads() -> bool:
    """Free this process's OpenMP thread pools before forking workers; False where one could not be.

    GNU OpenMP (torch's libgomp) is not fork-safe: a child forked after the parent ran a parallel
    region with two or more threads hangs in its first such region of its own (its pool lists the
    parent's threads, which the child does not have), so `threads=2` workers hung whenever this
    process had computed with two threads before. `omp_pause_resource_all` empties the pools; this
    process's next parallel region starts fresh threads."""
    from threadpoolctl import threadpool_info

    released = True
    for pool in threadpool_info():
        if pool["user_api"] != "openmp":
            continue
        try:
            released &= ctypes.CDLL(pool["filepath"]).omp_pause_resource_all(OMP_PAUSE_SOFT) == 0
        except (OSError, AttributeError):  # a runtime older than OpenMP 5.0
            released = False
    return released


def model_bytes(build: Callable[[], nn.Module]) -> int:
    return message_bytes(build().state_dict())


def default_workers() -> int:
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


class ProcessRuntime:
    name = "processes"

    def __init__(self, build: Callable[[], nn.Module], settings: TrainSettings, data: FederatedData,
                 workers: int | None = None, threads: int = 1,
                 builds: Mapping[Hashable, Callable[[], nn.Module]] | None = None,
                 model_keys: Sequence[Hashable] | None = None, device: torch.device = torch.device("cpu"),
                 start_method: str | None = None) -> None:
        """`device`: cpu, cuda:N (every worker there) or cuda (workers spread over the GPUs).
        `start_method` (internal; default: spawn on a GPU, fork on the CPU) lets a CPU test run
        the spawned path."""
        self.start_method = start_method or ("spawn" if device.type == "cuda" else "fork")
        if self.start_method not in ("fork", "spawn"):
            raise ValueError(f"start_method: {self.start_method!r}; use fork or spawn")
        if self.start_method == "fork" and device.type == "cuda":
            raise ValueError("processes backend: CUDA workers must be spawned (a forked process cannot use CUDA)")
        if self.start_method not in mp.get_all_start_methods():
            raise RuntimeError(f"the processes backend needs the {self.start_method!r} start method; "
                               "use backend=sequential")
        self.data = data
        self.device = device
        self.devices = worker_devices(device, workers, torch.cuda.device_count() if device.type == "cuda" else 0,
                                      cpu_workers=default_workers())
        self.workers = len(self.devices)
        self.threads = threads  # each worker's; the round loop runs this process's work with it too
        if self.start_method == "spawn":
            self.channels = PipeChannels()
            context = mp.get_context("spawn")
            self.pool = context.Pool(self.workers, initializer=_init_spawned_worker,
                                     initargs=(os.getpid(), context.Value("i", 0), [str(d) for d in self.devices],
                                               pack_builders(build, builds, model_keys), settings,
                                               transport.dumps(data), self.threads))
        else:
            largest = max(model_bytes(b) for b in [build, *(builds or {}).values()])
            self.channels = Channels(largest, self.workers)
            if not release_openmp_threads() and self.threads > 1:
                warnings.warn("processes backend: this OpenMP runtime cannot release its threads before the fork; "
                              f"workers with threads={self.threads} may hang (use threads=1)", RuntimeWarning,
                              stacklevel=2)
            self.pool = mp.get_context("fork").Pool(self.workers, initializer=_init_worker,
                                                    initargs=(self.channels, os.getpid(), build, settings, data, self.threads,
                                                              builds, model_keys))
        self.broken = False  # a stream was abandoned: workers may wait on slots forever
        # Custom-predict evaluations (closures over algorithm state) stay in this process.
        self.local_evaluator = ByArchitecture(build, lambda b: ModelEvaluator(b, data.num_classes), builds, model_keys)

    def fit_stream(self, jobs: list[FitJob]) -> Iterator[tuple[int, FitOutcome]]:
        """Results as workers finish them; consume them all before the next call (the arena is
        rewritten by it)."""
        ordered = dispatch_order(jobs, self.data)
        jobs.clear()  # `_stream` hands them out one by one; nothing else keeps them
        yield from self._stream(_fit, ordered,
                                lambda job: (job.request.params, job.request.extra, job.request.context, job.buffers))

    def fit_many(self, jobs: list[FitJob]) -> dict[int, FitOutcome]:
        return dict(self.fit_stream(jobs))

    def evaluate_many(self, items: list[EvalItem]) -> dict[int, ClientEval]:
        return split_custom_predict(items, self.local_evaluator, self.data,
                                    lambda remote: dict(self._stream(_evaluate, remote, lambda item: item[1:3])))

    def _stream(self, task, items: list, carried) -> Iterator:
        """Publish what two or more items carry (`carried(item)`) in the wave arena, then send the
        items lazily: the pool's feeder thread writes each one's own tensors into an inbox slot
        when one is free, so a client's model is copied only when a worker is about to take it."""
        channels = self.channels
        wave = channels.publish(transport.shared_tensors(carried(item) for item in items))
        payloads = (channels.job(item, wave, [t for t in transport.tensors_in(carried(item)) if id(t) not in wave])
                    for item in handed_out(items))
        finished = False
        results = self.pool.imap_unordered(task, payloads, chunksize=1)
        try:
            while True:
                # While the workers train, this process waits and copies results out on one torch
                # thread: a second one spins between operations and takes the core a worker needs
                # (FedAvg at 1,000 clients: 18 s of this process's CPU a round). The count is
                # restored before each yield: the caller's code (client updates, the aggregation)
                # runs at the run's count, as in every backend.
                with thread_count(1):
                    payload = next(results, None)
                    if payload is None:
                        break
                    result = channels.result(payload)
                yield result
            finished = True
        finally:
            if not finished:
                channels.abandoned = self.broken = True

    def describe_devices(self) -> str:
        return describe_device(self.device)

    def close(self) -> None:
        if self.broken:
            self.pool.terminate()  # workers may be waiting for slots nobody will free
        else:
            self.pool.close()
        self.pool.join()
        self.channels.close()
