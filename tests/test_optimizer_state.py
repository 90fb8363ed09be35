"""`keep_optimizer_state`: one optimizer per client for the whole run (SGD momentum carried across
rounds and across a method's Fit phases), kept in the client state, checkpointed, never sent."""
from __future__ import annotations

import pandas as pd
import pytest
import torch
from torch import nn

import pfedkit
from pfedkit.core.contract import Fit
from pfedkit.engine.trainer import FitJob, LocalTrainer, TrainSettings

from conftest import interrupt_and_resume

LR, MOMENTUM = 0.1, 0.9


class TinyNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(4, 6)
        self.head = nn.Linear(6, 3)


def initial_params() -> dict[str, torch.Tensor]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return {k: v.detach().clone() for k, v in TinyNet().named_parameters()}


def toy_data():
    generator = torch.Generator().manual_seed(1)
    return torch.randn(30, 4, generator=generator), torch.randint(0, 3, (30,), generator=generator)


def settings(keep: bool) -> TrainSettings:
    return TrainSettings(1, 10, LR, momentum=MOMENTUM, seed=2, keep_optimizer_state=keep)


def test_saved_momentum_enters_the_first_step_exactly():
    """w2(kept) - w2(fresh) = -lr * m * buf1: the second request's first step uses the first one's buffer."""
    x, y = toy_data()
    trainer = LocalTrainer(TinyNet, settings(keep=True))
    first = trainer.fit(FitJob(1, 0, 0, Fit(initial_params(), steps=1), None), x, y)
    assert set(first.optimizer_state) == set(first.params)
    second = FitJob(2, 0, 0, Fit(first.params, steps=1), None)
    kept = trainer.fit(FitJob(2, 0, 0, second.request, None, first.optimizer_state), x, y)
    fresh = trainer.fit(second, x, y)
    for name in first.params:
        expected = -LR * MOMENTUM * first.optimizer_state[name]
        torch.testing.assert_close(kept.params[name] - fresh.params[name], expected, rtol=1e-4, atol=1e-6)
        assert not torch.equal(kept.params[name], fresh.params[name])


def test_frozen_part_keeps_its_saved_buffers():
    """A head-only request must not touch the body's momentum (one optimizer over the whole model)."""
    x, y = toy_data()
    trainer = LocalTrainer(TinyNet, settings(keep=True))
    first = trainer.fit(FitJob(1, 0, 0, Fit(initial_params(), steps=2), None), x, y)
    head_only = trainer.fit(FitJob(2, 0, 0, Fit(first.params, trainable="head", steps=2), None,
                                   first.optimizer_state), x, y)
    for name, buffer in head_only.optimizer_state.items():
        if name.startswith("body."):
            assert torch.equal(buffer, first.optimizer_state[name])
        else:
            assert not torch.equal(buffer, first.optimizer_state[name])


def test_without_the_option_no_state_is_returned():
    x, y = toy_data()
    outcome = LocalTrainer(TinyNet, settings(keep=False)).fit(FitJob(1, 0, 0, Fit(initial_params(), steps=1), None), x, y)
    assert outcome.optimizer_state is None


@pytest.fixture
def momentum_config(small_config):
    return {**small_config, "algorithm": "local", "momentum": MOMENTUM, "rounds": 3}


def client_accuracy(result, rnd: int) -> pd.Series:
    return result.metrics.query("round == @rnd").set_index("client")["accuracy"]


def test_kept_momentum_changes_training_from_round_two_only(momentum_config, tmp_path):
    fresh = pfedkit.run({**momentum_config, "out_dir": str(tmp_path / "fresh")})
    kept = pfedkit.run({**momentum_config, "keep_optimizer_state": True, "out_dir": str(tmp_path / "kept")})
    pd.testing.assert_series_equal(client_accuracy(fresh, 1), client_accuracy(kept, 1))
    train_loss = lambda r, rnd: r.metrics.query("round == @rnd")["train_loss"].to_numpy()  # noqa: E731
    assert (train_loss(fresh, 2) != train_loss(kept, 2)).all()
    assert kept.summary["bytes_up"] == fresh.summary["bytes_up"] == 0  # never sent


def test_processes_equal_sequential_with_kept_state(momentum_config, tmp_path):
    config = {**momentum_config, "algorithm": "fedavg", "keep_optimizer_state": True, "join_ratio": 0.5}
    sequential = pfedkit.run({**config, "threads": 1, "out_dir": str(tmp_path / "s")})
    processes = pfedkit.run({**config, "backend": "processes", "workers": 2, "out_dir": str(tmp_path / "p")})
    assert (sequential.run_dir / "metrics.csv").read_bytes() == (processes.run_dir / "metrics.csv").read_bytes()


def test_vectorized_carries_the_same_momentum(momentum_config, tmp_path):
    config = {**momentum_config, "keep_optimizer_state": True}
    sequential = pfedkit.run({**config, "threads": 1, "out_dir": str(tmp_path / "s")})
    vectorized = pfedkit.run({**config, "backend": "vectorized", "out_dir": str(tmp_path / "v")})
    a, b = sequential.metrics["train_loss"].to_numpy(), vectorized.metrics["train_loss"].to_numpy()
    assert abs(a - b).max() < 1e-4


def test_resume_keeps_the_optimizer_state(momentum_config, tmp_path, monkeypatch):
    config = {**momentum_config, "keep_optimizer_state": True, "rounds": 4}
    reference, run_dir, _, _ = interrupt_and_resume(config, tmp_path, monkeypatch)
    assert (run_dir / "metrics.csv").read_bytes() == (reference.run_dir / "metrics.csv").read_bytes()
