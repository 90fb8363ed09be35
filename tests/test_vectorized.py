"""The vectorized runtime trains a step's clients together (torch.func.vmap) with the results of
the sequential trainer, and falls back to it, saying why once, where it cannot."""
from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import BatchNormNet, assert_outcomes_close, fit_reference
from torch import nn

import pfedkit
from pfedkit.algorithms.fedprox import proximal_loss
from pfedkit.config import load_config
from pfedkit.core.contract import Fit, Forward
from pfedkit.core.seeds import torch_generator
from pfedkit.engine.runtimes.vectorized import VectorizedRuntime
from pfedkit.engine.state import read_checkpoint
from pfedkit.engine.trainer import FitJob, TrainSettings
from pfedkit.engine.trainer import batch_schedule
from pfedkit.runs import CHECKPOINT, prepare

BATCH = 16
SETTINGS = TrainSettings(local_epochs=2, batch_size=BATCH, lr=0.05, momentum=0.9, weight_decay=1e-3,
                         grad_clip=1.0, seed=5)


def run_config(tmp_path, algorithm: str, backend: str) -> dict:
    return {"algorithm": algorithm, "dataset": "digits", "num_clients": 5, "rounds": 2, "batch_size": BATCH,
            "lr": 0.05, "momentum": 0.9, "grad_clip": 1.0, "join_ratio": 0.8, "seed": 3, "threads": 1,
            "backend": backend, "out_dir": str(tmp_path / backend),
            "partition": {"scheme": "dirichlet", "alpha": 0.5}, "fedprox": {"mu": 0.1}}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def digits(one_torch_thread):
    """Digits over 5 clients of different sizes, and the run's model builder."""
    prepared = prepare(load_config({"dataset": "digits", "num_clients": 5, "seed": 1, "threads": 1}))
    prepared.runtime.close()
    return prepared.data, prepared.simulation.algorithm.setup.ops


# Every algorithm runs on every backend in tests/test_backends.py; here, methods whose whole state
# is one model (the server's, or each client's for Local) have their final tensors compared too.
@pytest.mark.parametrize("algorithm", ["fedavg", "fedprox", "local"])
def test_vectorized_run_matches_sequential(algorithm, tmp_path, capsys):
    sequential = pfedkit.run(run_config(tmp_path, algorithm, "sequential"))
    vectorized = pfedkit.run(run_config(tmp_path, algorithm, "vectorized"))
    sizes = sequential.metrics.groupby("client")["n_train"].first().to_numpy()
    assert len(set(sizes)) == len(sizes) and len(set(sizes % BATCH) - {0}) > 1  # partial last batches
    assert sequential.metrics["participated"].min() == 0  # join_ratio < 1
    np.testing.assert_allclose(vectorized.metrics["accuracy"], sequential.metrics["accuracy"], atol=1e-4)
    np.testing.assert_allclose(vectorized.metrics["train_loss"], sequential.metrics["train_loss"], atol=1e-5)
    seq_state = read_checkpoint(sequential.run_dir / CHECKPOINT).state
    vec_state = read_checkpoint(vectorized.run_dir / CHECKPOINT).state
    if algorithm == "local":
        pairs = [(v["params"], s["params"]) for v, s in zip(vec_state.clients, seq_state.clients)]
    else:
        pairs = [(vec_state.server["params"], seq_state.server["params"])]
    for got, want in pairs:
        for name in want:
            torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=0)
    out = capsys.readouterr().out
    assert "vectorized runtime: training on cpu" in out and "falling back" not in out


def test_local_steps_train_exactly_that_many_batches_on_both_runtimes(tmp_path):
    """local_steps = 3: every participant of every round makes 3 steps (fewer than one pass over
    any client's data here), whichever runtime; the two agree as for epochs."""
    config = {**run_config(tmp_path, "fedavg", "sequential"), "local_steps": 3}
    sequential = pfedkit.run(config)
    vectorized = pfedkit.run({**config, "backend": "vectorized", "out_dir": str(tmp_path / "v")})
    trained = sequential.metrics[sequential.metrics["participated"] == 1]
    assert (trained["train_steps"] == 3).all() and (trained["n_train"] > 3 * BATCH).all()
    assert sequential.summary["train_steps_mean"] == 3
    np.testing.assert_allclose(vectorized.metrics["train_loss"], sequential.metrics["train_loss"], atol=1e-5)
    np.testing.assert_allclose(vectorized.metrics["accuracy"], sequential.metrics["accuracy"], atol=1e-4)


@pytest.mark.parametrize("trainable", ["all", "head"])
def test_fit_many_matches_local_trainer_per_client(trainable, digits):
    """Per-client anchors (DA-PFL-like), different steps/epochs per client, last batches of
    different sizes: each client's parameters, loss, steps and samples as LocalTrainer's."""
    data, ops = digits
    init = ops.initial_params()
    anchors = [{n: t + 0.01 * (cid + 1) for n, t in init.items()} for cid in range(5)]
    loss = partial(proximal_loss, mu=0.1)
    jobs = [FitJob(2, cid, 1, Fit(anchors[cid], loss=loss, trainable=trainable, steps=7 if cid == 3 else None,
                                  epochs=1 if cid == 0 else None, context={"anchor": anchors[cid]}), None)
            for cid in range(5)]
    runtime = VectorizedRuntime(ops.build, SETTINGS, data, threads=1, device="cpu")
    got = runtime.fit_many(jobs)
    runtime.close()
    assert runtime.jobs_vectorized == 5 and runtime.jobs_sequential == 0
    assert_outcomes_close(got, fit_reference(ops.build, SETTINGS, data, jobs))


def test_each_requests_own_lr_is_used_as_the_sequential_trainer_uses_it(digits):
    """Fit(lr=...) per client (FedPAC's head_lr, PFedCS's finetune_lr): clients with different lrs
    never share one stacked step's lr, and lr=None means the config's."""
    data, ops = digits
    init = ops.initial_params()
    lrs = [0.01, 0.3, None, 0.05, 0.3]
    jobs = [FitJob(1, cid, 0, Fit(init, lr=lr, trainable="head" if cid == 3 else "all"), None)
            for cid, lr in enumerate(lrs)]
    runtime = VectorizedRuntime(ops.build, SETTINGS, data, threads=1, device="cpu")
    got = runtime.fit_many(jobs)
    runtime.close()
    assert runtime.jobs_vectorized == 5
    want = fit_reference(ops.build, SETTINGS, data, jobs)
    assert_outcomes_close(got, want)
    config_lr = fit_reference(ops.build, SETTINGS, data, [FitJob(1, 0, 0, Fit(init), None)])
    assert not torch.equal(want[0].params["head.fc.weight"], config_lr[0].params["head.fc.weight"])  # lr acts


def test_head_training_leaves_body_unchanged(digits):
    data, ops = digits
    init = ops.initial_params()
    jobs = [FitJob(1, cid, 0, Fit(init, trainable="head"), None) for cid in (0, 2)]
    runtime = VectorizedRuntime(ops.build, SETTINGS, data, device="cpu")  # weight decay 1e-3 too
    got = runtime.fit_many(jobs)
    for outcome in got.values():
        for name, tensor in init.items():
            changed = not torch.equal(outcome.params[name], tensor)
            assert changed == name.startswith("head."), name


def test_batch_schedule_covers_epochs_and_exact_steps():
    """The one schedule both runtimes use: epochs of a seeded permutation, or exactly `steps`."""
    settings = TrainSettings(local_epochs=3, batch_size=64, lr=0.1, drop_last=True)
    epochs = batch_schedule(Fit({}), settings, 150, torch_generator(0, 1, 2, "fit-0"))
    assert len(epochs) == 3 * 2 and all(len(b) == 64 for b in epochs)  # drop_last drops 22 per epoch
    first_epoch = torch.cat(epochs[:2])
    assert len(set(first_epoch.tolist())) == 128  # no sample twice within an epoch
    assert len(batch_schedule(Fit({}, steps=9), settings, 150, torch_generator(0, 1, 2, "fit-0"))) == 9
    again = batch_schedule(Fit({}), settings, 150, torch_generator(0, 1, 2, "fit-0"))
    assert all(torch.equal(a, b) for a, b in zip(epochs, again))
    assert batch_schedule(Fit({}, steps=3), settings, 20, torch_generator(0, 1, 2, "x")) == []


def test_batchnorm_model_falls_back_with_one_message(digits, capsys):
    data, _ = digits
    model = BatchNormNet()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    jobs = [FitJob(1, cid, 0, Fit(params), buffers) for cid in range(3)]
    runtime = VectorizedRuntime(BatchNormNet, SETTINGS, data, device="cpu")
    first = runtime.fit_many(jobs)
    runtime.fit_many(jobs)
    out = capsys.readouterr().out
    assert out.count("falling back to the sequential trainer") == 1 and "BatchNorm" in out
    assert runtime.jobs_sequential == 6 and runtime.jobs_vectorized == 0
    want = fit_reference(BatchNormNet, SETTINGS, data, jobs)
    for cid, outcome in want.items():
        assert all(torch.equal(first[cid].params[n], outcome.params[n]) for n in outcome.params)
        assert all(torch.equal(first[cid].buffers[n], outcome.buffers[n]) for n in outcome.buffers)


class DropoutNet(nn.Module):
    def __init__(self, p: float = 0.0) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.body = nn.Sequential(nn.Linear(64, 16), nn.ReLU(), nn.Dropout(p))
            self.head = nn.Sequential(nn.Linear(16, 10))

    def forward(self, x):
        return self.head(self.body(x))


def test_dropout_model_is_vectorized_with_one_note(digits, capsys):
    """Dropout masks cannot match the sequential trainer's (global RNG); with p=0 the rest must."""
    data, _ = digits
    params = {n: p.detach().clone() for n, p in DropoutNet().named_parameters()}
    jobs = [FitJob(1, cid, 0, Fit(params), None) for cid in range(3)]
    runtime = VectorizedRuntime(DropoutNet, SETTINGS, data, device="cpu")
    got = runtime.fit_many(jobs)
    runtime.fit_many(jobs)
    out = capsys.readouterr().out
    assert out.count("uses dropout") == 1 and "falling back" not in out and runtime.jobs_vectorized == 6
    assert_outcomes_close(got, fit_reference(DropoutNet, SETTINGS, data, jobs))
    noisy = VectorizedRuntime(partial(DropoutNet, 0.5), SETTINGS, data, device="cpu").fit_many(jobs)
    assert all(np.isfinite(outcome.mean_loss) for outcome in noisy.values())


def branching_loss(out: Forward, y: torch.Tensor, params, context: Mapping[str, Any]) -> torch.Tensor:
    """Data-dependent Python control flow: fine sequentially, impossible under vmap."""
    loss = F.cross_entropy(out.logits, y)
    return loss * 2 if bool((y == 0).any()) else loss


def test_loss_that_vmap_cannot_run_falls_back_and_others_stay_vectorized(digits, capsys):
    data, ops = digits
    init = ops.initial_params()
    prox = partial(proximal_loss, mu=0.1)
    jobs = [FitJob(1, cid, 0, Fit(init, loss=branching_loss, context={}) if cid < 2
                   else Fit(init, loss=prox, context={"anchor": init}), None) for cid in range(4)]
    runtime = VectorizedRuntime(ops.build, SETTINGS, data, device="cpu")
    got = runtime.fit_many(jobs)
    out = capsys.readouterr().out
    assert out.count("falling back") == 1 and "branching_loss cannot run under torch.vmap" in out
    assert runtime.jobs_sequential == 2 and runtime.jobs_vectorized == 2
    assert_outcomes_close(got, fit_reference(ops.build, SETTINGS, data, jobs))


def test_bf16_runs_vectorized_close_to_sequential(digits):
    data, ops = digits
    settings = TrainSettings(local_epochs=1, batch_size=BATCH, lr=0.05, precision="bf16")
    init = ops.initial_params()
    jobs = [FitJob(1, cid, 0, Fit(init, steps=5), None) for cid in range(3)]
    runtime = VectorizedRuntime(ops.build, settings, data, device="cpu")
    got = runtime.fit_many(jobs)
    assert runtime.jobs_vectorized == 3
    assert_outcomes_close(got, fit_reference(ops.build, settings, data, jobs), atol=2e-2)


# Requests the batched trainer must run itself, never through its fallback: several Fits per round,
# head/body phases, context tensors (a regression here would only show as a slower run).
BATCHED_METHODS = ["pfedcs", "fedrema"]


@pytest.mark.parametrize("algorithm", BATCHED_METHODS)
def test_multi_phase_methods_stay_batched_and_match_sequential(algorithm, tmp_path, capsys):
    sequential = pfedkit.run(run_config(tmp_path, algorithm, "sequential"))
    vectorized = pfedkit.run(run_config(tmp_path, algorithm, "vectorized"))
    np.testing.assert_allclose(vectorized.metrics["accuracy"], sequential.metrics["accuracy"], atol=1e-4)
    assert "falling back" not in capsys.readouterr().out
