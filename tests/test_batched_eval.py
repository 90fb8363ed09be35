"""The vectorized runtime evaluates many clients in few forwards (engine/runtimes/batched_eval.py)
with the per-client evaluator's numbers: hits and counts exactly, loss sums within float
summation order; what it cannot batch goes to the per-client evaluator unchanged."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from conftest import BatchNormNet
from torch import nn

import pfedkit
from pfedkit.config import load_config
from pfedkit.engine.protocols import OnInputs
from pfedkit.engine.runtimes.batched_eval import BatchedEvaluator
from pfedkit.engine.runtimes.sequential import SequentialRuntime
from pfedkit.engine.runtimes.vectorized import VectorizedRuntime
from pfedkit.engine.trainer import TrainSettings
from pfedkit.runs import prepare

SETTINGS = TrainSettings(local_epochs=1, batch_size=16, lr=0.05, seed=5)
CLIENTS = 6


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def digits(one_torch_thread):
    """Digits over 6 clients of different test sizes, and the run's model operations."""
    prepared = prepare(load_config({"dataset": "digits", "num_clients": CLIENTS, "seed": 1, "threads": 1,
                                    "partition": {"scheme": "dirichlet", "alpha": 0.5}}))
    prepared.runtime.close()
    data = prepared.data
    assert len({client.n_test for client in data.clients}) == CLIENTS  # chunks pad the smaller clients
    return data, prepared.simulation.algorithm.setup.ops


def personalised(init: dict, cid: int) -> dict:
    """Client `cid`'s own model: the initial one moved far enough that predictions differ."""
    generator = torch.Generator().manual_seed(100 + cid)
    return {name: tensor + 0.3 * torch.randn(tensor.shape, generator=generator) for name, tensor in init.items()}


def assert_same_evals(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for cid, expected in want.items():
        result = got[cid]
        assert (result.correct, result.n_test) == (expected.correct, expected.n_test), cid
        assert isinstance(result.correct, int) and isinstance(result.loss_sum, float)
        assert result.class_correct.dtype == np.int64 and result.class_total.dtype == np.int64
        np.testing.assert_array_equal(result.class_correct, expected.class_correct)
        np.testing.assert_array_equal(result.class_total, expected.class_total)
        assert result.loss_sum == pytest.approx(expected.loss_sum, rel=1e-5, abs=1e-6), cid


def per_client(build, data):
    return SequentialRuntime(build, SETTINGS, data, threads=1)


def batched(build, data, sequential, **options) -> BatchedEvaluator:
    """Personalised models stacked under vmap on this CPU too (the GPU's path; off by default on a CPU)."""
    return BatchedEvaluator(build, data, torch.device("cpu"), sequential.evaluate_many,
                            **{"stack_personal": True, **options})


def evaluate(evaluator: BatchedEvaluator, items: list) -> dict:
    with torch.inference_mode():
        return evaluator.evaluate(items)


# rows=32 splits every client's test rows into slices with a partial last one; rows=400 puts
# clients of different sizes in one chunk (padded to the largest); stack_bytes=1: one per chunk.
LAYOUTS = [{}, {"rows": 32}, {"rows": 400}, {"rows": 400, "stack_bytes": 1}]


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_shared_model_matches_per_client_evaluation(layout, digits):
    """FedAvg's case: every client holds the very same tensors: one forward over their rows."""
    data, ops = digits
    init = ops.initial_params()
    trained = personalised(init, 0)  # a model that gets some right and some wrong
    sequential = per_client(ops.build, data)
    evaluator = batched(ops.build, data, sequential, **layout)
    items = [(cid, trained, None, None) for cid in reversed(range(CLIENTS))]  # owners not in pool order
    got = evaluate(evaluator, items)
    assert evaluator.items_batched == CLIENTS and evaluator.items_per_client == 0
    assert_same_evals(got, sequential.evaluate_many(items))
    assert 0 < sum(e.correct for e in got.values()) < sum(e.n_test for e in got.values())


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_personalised_models_match_per_client_evaluation(layout, digits):
    """Each client its own tensors: stacked, vmap over padded, masked rows."""
    data, ops = digits
    init = ops.initial_params()
    sequential = per_client(ops.build, data)
    evaluator = batched(ops.build, data, sequential, **layout)
    items = [(cid, personalised(init, cid), None, None) for cid in range(CLIENTS)]
    got = evaluate(evaluator, items)
    assert evaluator.items_batched == CLIENTS and evaluator.items_per_client == 0
    want = sequential.evaluate_many(items)
    assert_same_evals(got, want)
    assert len({e.correct for e in want.values()}) > 1  # the models differ, so swapped owners would show


def test_shared_body_personal_head_and_groups_mix(digits):
    """A mix: two groups sharing a model, clients with a shared body and their own head (FedPer:
    the body is passed once to vmap), and one fully personal client."""
    data, ops = digits
    init = ops.initial_params()
    group_a, group_b = personalised(init, 10), personalised(init, 11)
    body = personalised(init, 12)
    heads = {cid: {**body, **{n: t for n, t in personalised(init, cid).items() if n.startswith("head.")}}
             for cid in (2, 3)}
    models = {0: group_a, 1: group_b, 2: heads[2], 3: heads[3], 4: group_a, 5: group_b}
    items = [(cid, models[cid], None, None) for cid in range(CLIENTS)]
    items.append((6 % CLIENTS, personalised(init, 6), None, None))  # a second item for client 0: last wins
    sequential = per_client(ops.build, data)
    evaluator = batched(ops.build, data, sequential, rows=64)
    assert_same_evals(evaluate(evaluator, items), sequential.evaluate_many(items))


def test_items_with_predict_or_buffers_go_to_the_per_client_evaluator(digits):
    data, ops = digits
    init = ops.initial_params()
    calls = []

    def predict(features):  # FedProto-like: logits from body features, not the model's head
        calls.append(len(features))
        return -features[:, :10]

    inputs = OnInputs(lambda x: x[:, :10] * 0.1)
    items = [(0, init, None, predict), (1, init, None, inputs), (2, init, {}, None), (3, init, None, None),
             (4, personalised(init, 4), None, None)]
    sequential = per_client(ops.build, data)
    evaluator = batched(ops.build, data, sequential)
    got = evaluate(evaluator, items)
    assert evaluator.items_per_client == 2 and evaluator.items_batched == 3 and calls
    assert_same_evals(got, sequential.evaluate_many(items))


def test_batchnorm_model_is_evaluated_per_client_with_its_statistics(digits):
    data, _ = digits
    model = BatchNormNet()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    buffers["body.1.running_mean"] += 1.0  # statistics the evaluation must use
    runtime, reference = VectorizedRuntime(BatchNormNet, SETTINGS, data, threads=1), per_client(BatchNormNet, data)
    for client_buffers in (buffers, None):  # with or without the client's statistics: the model has buffers
        items = [(cid, params, client_buffers, None) for cid in range(3)]
        assert_same_evals(runtime.evaluate_many(items), reference.evaluate_many(items))
    assert runtime.batched_eval.items_batched == 0 and runtime.batched_eval.items_per_client == 6


def test_client_with_no_test_rows_gets_an_empty_eval(digits):
    data, ops = digits
    clients = list(data.clients)
    clients[2] = dataclasses.replace(clients[2], x_test=clients[2].x_test[:0], y_test=clients[2].y_test[:0])
    data = dataclasses.replace(data, clients=clients)
    init = ops.initial_params()
    sequential = per_client(ops.build, data)
    for models in ({cid: init for cid in range(CLIENTS)}, {cid: personalised(init, cid) for cid in range(CLIENTS)}):
        items = [(cid, params, None, None) for cid, params in models.items()]
        got = evaluate(batched(ops.build, data, sequential, rows=32), items)
        assert (got[2].correct, got[2].n_test, got[2].loss_sum) == (0, 0, 0.0)
        assert not got[2].class_correct.any() and not got[2].class_total.any()
        assert_same_evals(got, sequential.evaluate_many(items))


class WiderNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(1)
            self.body = nn.Sequential(nn.Linear(64, 48), nn.ReLU())
            self.head = nn.Sequential(nn.Linear(48, 10))

    def forward(self, x):
        return self.head(self.body(x))


def test_clients_of_another_architecture_are_evaluated_per_client(digits):
    data, ops = digits
    builds, keys = {"mlp": ops.build, "wide": WiderNet}, ["mlp", "wide"] * (CLIENTS // 2)
    wide = {n: p.detach().clone() for n, p in WiderNet().named_parameters()}
    init = ops.initial_params()
    items = [(cid, init if keys[cid] == "mlp" else wide, None, None) for cid in range(CLIENTS)]
    runtime = VectorizedRuntime(ops.build, SETTINGS, data, threads=1, builds=builds, model_keys=keys)
    got = runtime.evaluate_many(items)
    assert runtime.batched_eval.items_batched == CLIENTS // 2 == runtime.batched_eval.items_per_client
    reference = SequentialRuntime(ops.build, SETTINGS, data, threads=1, builds=builds, model_keys=keys)
    assert_same_evals(got, reference.evaluate_many(items))


class BranchingNet(nn.Module):
    """Data-dependent Python control flow in forward: fine for one model, impossible under vmap."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, 16), nn.ReLU())
        self.head = nn.Sequential(nn.Linear(16, 10))

    def forward(self, x):
        features = self.body(x)
        return self.head(features) * (2.0 if bool(features.sum() > 0) else 1.0)


def test_forward_that_vmap_cannot_run_is_evaluated_per_client_with_one_note(digits, capsys):
    data, _ = digits
    base = {n: p.detach().clone() for n, p in BranchingNet().named_parameters()}
    items = [(cid, personalised(base, cid), None, None) for cid in range(CLIENTS)]
    runtime = VectorizedRuntime(BranchingNet, SETTINGS, data, threads=1)
    runtime.batched_eval.stack_personal = True  # the GPU's path, which a CPU runtime leaves off
    got = runtime.evaluate_many(items)
    runtime.evaluate_many(items)
    assert capsys.readouterr().out.count("cannot run under torch.vmap") == 1
    assert runtime.batched_eval.items_per_client == 2 * CLIENTS
    assert_same_evals(got, per_client(BranchingNet, data).evaluate_many(items))
    shared = [(cid, base, None, None) for cid in range(CLIENTS)]  # one model: no vmap needed
    assert_same_evals(runtime.evaluate_many(shared), per_client(BranchingNet, data).evaluate_many(shared))


def run_config(tmp_path, algorithm: str, backend: str) -> dict:
    return {"algorithm": algorithm, "dataset": "digits", "num_clients": 5, "rounds": 2, "batch_size": 16,
            "lr": 0.05, "join_ratio": 0.8, "seed": 3, "threads": 1, "backend": backend,
            "out_dir": str(tmp_path / backend), "partition": {"scheme": "dirichlet", "alpha": 0.5}}


def test_a_cpu_runtime_evaluates_personal_models_one_client_at_a_time(digits):
    """On a CPU, vmap over personalised models is slower than one client at a time: the runtime's
    evaluator leaves them to the per-client path and batches shared models only."""
    data, ops = digits
    init = ops.initial_params()
    runtime = VectorizedRuntime(ops.build, SETTINGS, data, threads=1)
    items = [(cid, personalised(init, cid) if cid % 2 else init, None, None) for cid in range(CLIENTS)]
    assert_same_evals(runtime.evaluate_many(items), per_client(ops.build, data).evaluate_many(items))
    assert runtime.batched_eval.items_batched == CLIENTS // 2 == runtime.batched_eval.items_per_client


@pytest.mark.parametrize("algorithm", ["fedavg", "local", "fedper"])
def test_vectorized_run_evaluates_batched_with_the_sequential_metrics(algorithm, tmp_path, monkeypatch):
    """Whole runs: fedavg (one shared model), local (personal models), fedper (shared body)."""
    served = []
    batched_items = BatchedEvaluator._evaluate_batched
    monkeypatch.setattr(BatchedEvaluator, "_evaluate_batched",
                        lambda self, items: served.append(len(items)) or batched_items(self, items))
    sequential = pfedkit.run(run_config(tmp_path, algorithm, "sequential"))
    vectorized = pfedkit.run(run_config(tmp_path, algorithm, "vectorized"))
    assert sum(served) == len(vectorized.metrics.dropna(subset=["accuracy"]))
    for column in ("accuracy", "balanced_acc"):
        np.testing.assert_allclose(vectorized.metrics[column], sequential.metrics[column], atol=1e-6, rtol=0)
    np.testing.assert_allclose(vectorized.metrics["loss"], sequential.metrics["loss"], rtol=1e-4)
