"""One thread count per run: every algorithm hook and every client computation runs with the run's
`threads`, whatever the backend (issue 22: oneDNN picks kernels by thread count, so a hook run
with a different count gave different numbers on AVX-512 machines only).

A probe algorithm records, inside each of its hooks, torch's thread count and the BLAS pools'
(threadpoolctl); its training loss reports the thread count the trainer ran with (the value is
the count, the gradient is cross-entropy's), so the metrics' train_loss carries what the workers
saw. The main process starts each run at 3 torch threads and its BLAS pools unlimited, so a hook
that escaped the run's count records something else on any CPU.
"""
from __future__ import annotations

import pandas as pd
import pytest
import torch
from threadpoolctl import ThreadpoolController, threadpool_limits

import pfedkit
from pfedkit import build, runs
from pfedkit.algorithms.registry import registry
from pfedkit.config import load_config
from pfedkit.core.backends import BACKENDS
from pfedkit.core.aggregation import fedavg_aggregate
from pfedkit.core.contract import Algorithm, Fit, cross_entropy
from pfedkit.core.params import clone

OUTSIDE_THREADS = 3  # this process's torch count around the runs: never a run's count below

# (hook, torch threads, BLAS threads) as seen inside the probe's hooks, in call order.
SEEN: list[tuple[str, int, int]] = []
# (round, client) -> strides of the trained parameters a client_update received: the memory
# format algorithm code sees must not depend on the backend either.
LAYOUTS: dict[tuple[int, int], tuple] = {}


def blas_threads() -> int:
    """The largest thread count of the BLAS libraries loaded here (0: none loaded)."""
    return max((pool["num_threads"] for pool in ThreadpoolController().select(user_api="blas").info()), default=0)


def seen(hook: str) -> None:
    SEEN.append((hook, torch.get_num_threads(), blas_threads()))


def thread_count_loss(out, y, params, context) -> torch.Tensor:
    """Cross-entropy's gradient, with the trainer's thread count as its value."""
    loss = cross_entropy(out, y, params, context)
    return loss - loss.detach() + torch.get_num_threads()


class ThreadProbe(Algorithm):
    """FedAvg's math (its mean aggregated in batch: `aggregate` is a hook here) with a report, an
    adaptation and a custom predict, recording threads in each hook."""
    name = "thread_probe"

    def init_server(self, params):
        seen("init_server")
        return {"params": clone(params)}

    def init_client(self, cid, params):
        seen("init_client")
        return None

    def client_report(self, rnd, cid, client, data):
        seen("client_report")
        return {"n": data.n_train}

    def collect(self, rnd, server, reports):
        seen("collect")
        return server

    def broadcast(self, rnd, server, cids):
        seen("broadcast")
        return {cid: {"params": server["params"]} for cid in cids}

    def client_update(self, rnd, cid, client, message, data):
        seen("client_update: before its Fit")
        params = yield Fit(message["params"], loss=thread_count_loss)
        seen("client_update: after its Fit")
        LAYOUTS[(rnd, cid)] = tuple((name, tuple(t.stride())) for name, t in sorted(params.items()))
        return client, {"params": params, "weight": data.n_train}

    def aggregate(self, rnd, server, replies):  # the batch aggregation, called once
        seen("aggregate")
        return {"params": fedavg_aggregate(replies)} if replies else server

    def client_model(self, cid, server, client):
        seen("client_model")
        return server["params"]

    def adapt(self, cid, server, client, params):
        seen("adapt")
        return Fit(params, loss=thread_count_loss, steps=1)

    def predict(self, cid, server, client, features):
        seen("predict")
        return self.setup.ops.head_logits(server["params"], features)


@pytest.fixture
def probe(monkeypatch):
    """The probe registered for one test, this process at OUTSIDE_THREADS torch threads and
    unlimited BLAS pools, and the records emptied."""
    monkeypatch.setitem(registry(), ThreadProbe.name, ThreadProbe)
    previous = torch.get_num_threads()
    torch.set_num_threads(OUTSIDE_THREADS)
    SEEN.clear()
    LAYOUTS.clear()
    yield
    torch.set_num_threads(previous)


def probe_run(config: dict, backend: str, out_dir, workers: int = 2) -> tuple[list, dict, pd.DataFrame]:
    SEEN.clear()
    LAYOUTS.clear()
    extra = {"workers": workers} if backend == "processes" else {}
    result = pfedkit.run({"join_ratio": 0.75, "rounds": 2, **config, "algorithm": "thread_probe", "backend": backend,
                          "out_dir": str(out_dir), **extra})
    return list(SEEN), dict(LAYOUTS), result.metrics


def expected_blas(threads: int) -> int:
    """What limiting the BLAS pools to `threads` gives on this machine (OpenBLAS caps it at its cores)."""
    with threadpool_limits(threads, user_api="blas"):
        return blas_threads()


def assert_all_at(records: list, metrics: pd.DataFrame, threads: int) -> None:
    hooks = {hook for hook, _, _ in records}
    assert hooks >= {"init_server", "init_client", "client_report", "collect", "broadcast", "aggregate",
                     "client_update: before its Fit", "client_update: after its Fit", "client_model",
                     "adapt", "predict"}
    wrong = sorted({(hook, torch_threads) for hook, torch_threads, _ in records if torch_threads != threads})
    assert not wrong, f"hooks that ran with another torch thread count than {threads}: {wrong}"
    blas = expected_blas(threads)
    wrong_blas = sorted({(hook, count) for hook, _, count in records if count != blas})
    assert not wrong_blas, f"hooks that ran with another BLAS thread count than {blas}: {wrong_blas}"
    trained = metrics[metrics["train_steps"] > 0]
    assert len(trained) > 0
    assert (trained["train_loss"] == threads).all(), trained[["round", "client", "train_loss"]]


@pytest.mark.parametrize("backend", ["sequential", "processes", "vectorized"])
def test_every_hook_and_fit_computes_with_the_runs_threads(backend, probe, small_config, tmp_path):
    """threads=1 (the count `processes` uses by default): broadcast, aggregation, each step of
    client_update, reports, adapt and predict in this process, and the Fits wherever the backend
    runs them, all at 1 torch thread and 1 BLAS thread."""
    config = {**small_config, "threads": None if backend == "processes" else 1}
    records, _, metrics = probe_run(config, backend, tmp_path)
    assert_all_at(records, metrics, 1)
    assert torch.get_num_threads() == OUTSIDE_THREADS  # and the caller's count is given back


def test_an_explicit_thread_count_holds_in_workers_and_in_this_process(probe, small_config, tmp_path):
    """threads=2 with processes: the worker trains with 2 threads and this process's hooks run
    with 2 (one worker and one round: two threads per process crowd a small shared machine)."""
    config = {**small_config, "threads": 2, "rounds": 1, "num_clients": 2, "join_ratio": 1.0}
    records, _, metrics = probe_run(config, "processes", tmp_path, workers=1)
    assert_all_at(records, metrics, 2)


def test_backends_show_algorithm_code_the_same_threads_and_memory_layout(probe, small_config, tmp_path):
    """The same hooks, in the same order, see the same thread counts and the same strides of the
    trained parameters in sequential (threads=1) and processes: what algorithm code sees does not
    depend on the backend."""
    sequential = probe_run({**small_config, "threads": 1}, "sequential", tmp_path / "s")
    processes = probe_run({**small_config, "threads": None}, "processes", tmp_path / "p")
    assert sequential[0] == processes[0]
    assert sequential[1] == processes[1] and len(sequential[1]) > 0
    pd.testing.assert_frame_equal(sequential[2], processes[2])


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_run_thread_count_is_the_configs_else_the_backends_default(backend, probe):
    """README's `threads` row: all cores (this process's torch count) for sequential and vectorized,
    1 per worker for processes and ray, and 1 on Flower nodes; an explicit `threads` wins everywhere."""
    config = load_config(None, [f"backend={backend}"])
    assert build.run_threads(config) == (1 if backend in ("processes", "ray") else OUTSIDE_THREADS)
    assert build.run_threads(config, side_by_side=True) == 1
    explicit = load_config(None, [f"backend={backend}", "threads=2"])
    assert build.run_threads(explicit) == build.run_threads(explicit, side_by_side=True) == 2


@pytest.mark.parametrize("backend", ["sequential", "processes", "vectorized"])
def test_a_run_computes_with_the_count_build_decided(backend, probe, small_config, tmp_path, monkeypatch):
    """The count `run_threads` returns is the one every hook and every Fit computes with: decided
    once (here replaced by 2, which no backend's default gives: processes 1, the others this
    process's 3) and passed to the runtime and the round loop, never read back from either."""
    decided = []

    def decide(config):
        decided.append(config.backend)
        return 2

    monkeypatch.setattr(runs, "run_threads", decide)
    config = {**small_config, "threads": None, "rounds": 1, "num_clients": 2, "join_ratio": 1.0}
    records, _, metrics = probe_run(config, backend, tmp_path, workers=1)
    assert decided == [backend]
    assert_all_at(records, metrics, 2)


class SmallOpProbe(ThreadProbe):
    """The probe declaring `small_op_threads`, as CReFF does for its thousands of tiny ops."""
    name = "small_op_probe"
    small_op_threads = 1


def test_small_op_threads_hold_for_the_algorithms_own_code_only(probe, small_config, tmp_path, monkeypatch):
    """threads=2 and `small_op_threads = 1`: each step of client_update and the aggregation run with
    1 torch thread; the Fits (their train_loss is the trainer's count), broadcast, client_model,
    adapt and predict with the run's 2; this process's count is given back after the run."""
    monkeypatch.setitem(registry(), SmallOpProbe.name, SmallOpProbe)
    SEEN.clear()
    result = pfedkit.run({**small_config, "join_ratio": 0.75, "rounds": 2, "threads": 2,
                          "algorithm": SmallOpProbe.name, "out_dir": str(tmp_path)})
    own = {"client_update: before its Fit", "client_update: after its Fit", "aggregate"}
    counts = {}
    for hook, torch_threads, _ in SEEN:
        counts.setdefault(hook, set()).add(torch_threads)
    assert {hook: counts[hook] for hook in own} == {hook: {1} for hook in own}
    others = {"broadcast", "client_model", "adapt", "predict", "client_report", "collect"}
    assert {hook: counts[hook] for hook in others} == {hook: {2} for hook in others}
    trained = result.metrics[result.metrics["train_steps"] > 0]
    assert len(trained) > 0 and (trained["train_loss"] == 2).all()
    assert torch.get_num_threads() == OUTSIDE_THREADS
