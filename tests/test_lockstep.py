"""The vectorized runtime's lock-step in fixed shapes (engine/runtimes/lockstep.py): members padded
to powers of two with sink rows, one static-buffer step per (members, batch size) shape, chunks of
at most `max_clients` clients, the stacked tensors reused across rounds. On a CPU the `bucketed`
step is the CUDA graphs' twin (the same shapes, buffers and reuse, run eagerly); it must give the
sequential trainer's results within the tolerance of tests/test_vectorized.py."""
from __future__ import annotations

import weakref
from functools import partial

import numpy as np
import pytest
import torch
from conftest import assert_outcomes_close, fit_reference

import pfedkit
from pfedkit.algorithms.fedprox import proximal_loss
from pfedkit.config import load_config
from pfedkit.core.contract import Fit
from pfedkit.core.errors import ConfigError
from pfedkit.engine.runtimes.lockstep import chunk_capacity, member_bucket, step_plan
from pfedkit.engine.runtimes.vectorized import VectorizedRuntime, default_max_clients, host_copy, step_kind
from pfedkit.engine.trainer import FitJob, TrainSettings
from pfedkit.runs import prepare

BATCH = 16
SETTINGS = TrainSettings(local_epochs=2, batch_size=BATCH, lr=0.05, momentum=0.9, weight_decay=1e-3,
                         grad_clip=1.0, seed=5)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def digits(one_torch_thread):
    prepared = prepare(load_config({"dataset": "digits", "num_clients": 7, "seed": 1, "threads": 1}))
    prepared.runtime.close()
    return prepared.data, prepared.simulation.algorithm.setup.ops


def anchored_jobs(ops, rnd: int, cids, trainable: str, shift: float):
    """Per-client anchors and starting points (DA-PFL-like), different epochs and steps per client."""
    init = ops.initial_params()
    anchors = {cid: {n: t + shift * (cid + 1) for n, t in init.items()} for cid in cids}
    loss = partial(proximal_loss, mu=0.1)
    return [FitJob(rnd, cid, 0, Fit(anchors[cid], loss=loss, trainable=trainable, steps=7 if cid == 3 else None,
                                    epochs=1 if cid == 0 else None, context={"anchor": anchors[cid]}), None)
            for cid in cids]


def test_member_buckets_are_powers_of_two_then_multiples_of_256_up_to_the_capacity():
    assert [member_bucket(k, 32) for k in (1, 2, 3, 4, 5, 17, 32)] == [1, 2, 4, 4, 8, 32, 32]
    assert member_bucket(9, 12) == 12 and member_bucket(3, 3) == 3
    assert [member_bucket(k, 2048) for k in (200, 256, 257, 1100, 2000)] == [256, 256, 512, 1280, 2048]
    # a chunk's rows: a power of two, so a run's last, smaller chunk reuses the tensors and graphs
    assert [chunk_capacity(k, 2048) for k in (5, 1100, 1808, 2048)] == [8, 2048, 2048, 2048]


def test_a_padded_plan_trains_each_batch_once_and_sends_sinks_to_pool_row_zero():
    """Every client's batches appear once, in order, at its pool offset; padding members are the
    sink (row `capacity`) reading pool row 0; shapes are (power of two, batch size)."""
    g = torch.Generator().manual_seed(0)
    schedules = [[torch.randperm(20, generator=g)[:size] for size in sizes]
                 for sizes in ([4, 4, 3], [4, 2], [4, 4, 4, 1], [3])]
    offsets, capacity = [0, 20, 40, 60], 4
    plan = step_plan(schedules, offsets, torch.device("cpu"), lambda k: member_bucket(k, capacity), capacity)
    seen = {k: [] for k in range(4)}
    for members, pool_rows, rows in plan:
        assert isinstance(members, torch.Tensor) and pool_rows.shape == rows.shape
        assert len(members) == member_bucket(int((members != capacity).sum()), capacity)
        for member, pool_row, row in zip(members.tolist(), pool_rows, rows):
            if member == capacity:
                assert (pool_row == 0).all()
                continue
            assert torch.equal(pool_row, row + offsets[member])
            seen[member].append(row)
    for k, schedule in enumerate(schedules):
        assert len(seen[k]) == len(schedule) and all(torch.equal(a, b) for a, b in zip(seen[k], schedule))
    exact = step_plan(schedules, offsets, torch.device("cpu"), None, capacity)
    assert sum(isinstance(m, slice) for m, _, _ in exact) > 0  # contiguous members: views
    assert sum(r.numel() for _, r, _ in exact) == sum(len(b) for s in schedules for b in s)


@pytest.mark.parametrize("trainable", ["all", "head"])
def test_bucketed_steps_match_the_sequential_trainer_round_after_round(trainable, digits):
    """Padded members, static buffers, and the stacked tensors refilled in a second round with
    other anchors, fewer clients and other starting points: each round equals LocalTrainer."""
    data, ops = digits
    runtime = VectorizedRuntime(ops.build, SETTINGS, data, threads=1, device="cpu", step="bucketed")
    first = anchored_jobs(ops, 1, range(7), trainable, 0.01)
    assert_outcomes_close(runtime.fit_many(first), fit_reference(ops.build, SETTINGS, data, first))
    (kind, (chunk, shapes)), = runtime.workspaces
    assert kind[1] == chunk.layout()  # the layout found before stacking is the stacked chunk's
    assert chunk.capacity == 8 and any(k > 1 and k & (k - 1) == 0 for k, _ in shapes.shapes)
    prepared = len(shapes.shapes)
    addresses = chunk_addresses(chunk, shapes)
    second = anchored_jobs(ops, 2, [0, 2, 3, 4, 6], trainable, -0.02)
    assert_outcomes_close(runtime.fit_many(second), fit_reference(ops.build, SETTINGS, data, second))
    assert runtime.workspaces[0][1][1] is shapes and runtime.jobs_vectorized == 12
    assert len(shapes.shapes) >= prepared and shapes.captured == 0  # no graphs on a CPU
    # What a CUDA graph would read stayed where it was captured: refilled in place, never rebound.
    assert {key: address for key, address in chunk_addresses(chunk, shapes).items() if key in addresses} == addresses


def chunk_addresses(chunk, shapes) -> dict:
    """The data addresses of every tensor a graphed step reads or writes: the chunk's stacked and
    shared tensors, its loss sums, and each shape's static buffers."""
    tensors = {("totals",): chunk.totals}
    for part, named in (("params", chunk.params), ("momentum", chunk.momentum),
                        ("frozen", {**chunk.frozen.batched, **chunk.frozen.shared}),
                        ("context", {**chunk.context.batched, **chunk.context.shared})):
        tensors.update({(part, key): tensor for key, tensor in named.items()})
    for shape, (index, pool_rows, rows, _) in shapes.shapes.items():
        tensors.update({("shape", shape, i): t for i, t in enumerate((index, pool_rows, rows))})
    return {key: tensor.data_ptr() for key, tensor in tensors.items()}


def test_chunks_of_max_clients_are_handed_on_before_the_next_trains(digits):
    data, ops = digits
    runtime = VectorizedRuntime(ops.build, SETTINGS, data, threads=1, device="cpu", step="bucketed", max_clients=2)
    jobs = anchored_jobs(ops, 1, range(5), "all", 0.01)
    stream = runtime.fit_stream(list(jobs))
    got = dict([next(stream), next(stream)])
    assert sorted(got) == [0, 1] and runtime.jobs_vectorized == 2  # the first chunk only, so far
    got.update(stream)
    assert runtime.jobs_vectorized == 5
    assert_outcomes_close(got, fit_reference(ops.build, SETTINGS, data, jobs))


@pytest.mark.parametrize("step", ["eager", "bucketed", pytest.param("graphs", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA graphs need a GPU"))])
def test_a_chunks_trained_models_are_let_go_before_the_next_chunk_trains(step, tmp_path, monkeypatch):
    """Host memory flat in the clients: in a FedAvg round of 3 chunks, when a chunk starts training
    nothing (runtime, round loop, aggregation) still holds the trained tensors of the chunk before."""
    device = {"device": "cuda"} if step == "graphs" else {}
    prepared = prepare(load_config({"dataset": "digits", "num_clients": 6, "rounds": 1, "threads": 1,
                                    "backend": "vectorized", "out_dir": str(tmp_path), **device,
                                    "vectorized": {"step": step, "max_clients": 2}}))
    runtime, chunks = prepared.runtime, []
    fit_all = runtime._fit_all

    def watched(jobs):
        chunks.append([ref() is not None for ref in getattr(watched, "refs", [])])
        outcomes = fit_all(jobs)
        trained = [t for outcome in outcomes.values() for t in outcome.params.values()]
        assert all(t.is_pinned() for t in trained) == (step == "graphs")  # a GPU's copies are page-locked
        watched.refs = [weakref.ref(t) for t in trained]
        return outcomes

    monkeypatch.setattr(runtime, "_fit_all", watched)
    prepared.simulation.run_round(prepared.state)
    runtime.close()
    assert len(chunks) == 3 and chunks[0] == [] and all(len(alive) > 0 and not any(alive) for alive in chunks[1:])


@pytest.mark.parametrize("algorithm", ["fedavg", "ditto", "local"])
def test_bucketed_runs_give_the_sequential_metrics(algorithm, tmp_path, capsys):
    config = {"algorithm": algorithm, "dataset": "digits", "num_clients": 6, "rounds": 3, "batch_size": BATCH,
              "lr": 0.05, "momentum": 0.9, "join_ratio": 0.7, "seed": 3, "threads": 1,
              "partition": {"scheme": "dirichlet", "alpha": 0.5}}
    sequential = pfedkit.run({**config, "out_dir": str(tmp_path / "s")})
    bucketed = pfedkit.run({**config, "out_dir": str(tmp_path / "b"), "backend": "vectorized",
                            "vectorized": {"step": "bucketed", "max_clients": 4}})
    np.testing.assert_allclose(bucketed.metrics["train_loss"], sequential.metrics["train_loss"], atol=1e-5)
    np.testing.assert_allclose(bucketed.metrics["accuracy"], sequential.metrics["accuracy"], atol=1e-4)
    out = capsys.readouterr().out
    assert "at most 4 clients train together" in out and "falling back" not in out


def test_host_copies_are_page_locked_where_granted_and_plain_otherwise():
    rows = torch.arange(12.0).reshape(3, 4)
    plain, why = host_copy(rows, pinned=False)
    assert why is None and not plain.is_pinned()
    locked, why = host_copy(rows, pinned=True)
    for copy in (plain, locked):
        assert torch.equal(copy, rows) and copy.data_ptr() != rows.data_ptr()
    if torch.cuda.is_available():
        assert why is None and locked.is_pinned()
    else:  # no accelerator: page-locking is refused, and the reason is given
        assert "pin" in why and not locked.is_pinned()


def test_step_kinds_and_their_refusals():
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert step_kind("auto", cpu, "fp32", []) == "eager"
    assert step_kind("auto", gpu, "fp32", []) == "graphs"
    assert step_kind("auto", gpu, "bf16", []) == "eager" and step_kind("auto", gpu, "fp32", ["drop"]) == "eager"
    assert step_kind("bucketed", cpu, "fp32", []) == "bucketed"
    with pytest.raises(ValueError, match="needs a CUDA device"):
        step_kind("graphs", cpu, "fp32", [])
    with pytest.raises(ConfigError):
        load_config({"backend": "vectorized", "vectorized": {"step": "compiled"}})
    with pytest.raises(ConfigError):
        load_config({"backend": "vectorized", "vectorized": {"max_clients": 0}})


def test_default_chunk_is_a_power_of_two_that_shrinks_with_the_model():
    small, large = torch.nn.Linear(10, 10), torch.nn.Linear(2000, 2000)
    a, b = default_max_clients(small, torch.device("cpu")), default_max_clients(large, torch.device("cpu"))
    assert a & (a - 1) == 0 and b & (b - 1) == 0 and 1 <= b < a <= 4096


def test_reused_chunks_never_write_into_the_callers_tensors(digits):
    """Shared tensors (the same global body for every client, the same anchor) are copied into a
    reused chunk's buffers; the next round's refill must not land in the previous round's inputs."""
    data, ops = digits
    runtime = VectorizedRuntime(ops.build, SETTINGS, data, threads=1, device="cpu", step="bucketed")
    loss = partial(proximal_loss, mu=0.1)
    rounds = [{n: t + shift for n, t in ops.initial_params().items()} for shift in (0.0, 0.05)]
    kept = [{n: t.clone() for n, t in params.items()} for params in rounds]
    for rnd, params in enumerate(rounds, start=1):
        jobs = [FitJob(rnd, cid, 0, Fit(params, loss=loss, trainable="head", context={"anchor": params}), None)
                for cid in range(4)]
        assert_outcomes_close(runtime.fit_many(jobs), fit_reference(ops.build, SETTINGS, data, jobs))
    assert len(runtime.workspaces) == 1  # the second round reused the first round's chunk
    for params, copy in zip(rounds, kept):
        assert all(torch.equal(params[n], copy[n]) for n in params)
