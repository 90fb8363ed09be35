"""A custom local step (Fit.step) and the config's SGD settings: they reach a step only through
`StepTools.sgd_step` (Per-FedAvg's `trainer_optimizer`), which updates as plain training does;
every step that updates the params itself (APFL, FedSAM, pFedMe, Per-FedAvg by default) is as before."""
from __future__ import annotations

import pytest
import torch
from test_perfedavg import data, tiny_params, train

from pfedkit.algorithms.perfedavg import PerFedAvg
from pfedkit.engine.trainer import LocalTrainer, TrainSettings, _Tools


def meta_fit(**options):
    return PerFedAvg(PerFedAvg.Hyper(alpha=0.4, beta=0.3, **options), None).local_fit({"params": tiny_params()})


def test_sgd_step_is_torch_sgd_after_clip_grad_norm():
    """Two steps of sgd_step == torch's clip_grad_norm_ then SGD(momentum, weight_decay) step, and
    the momentum buffers come back as the state to keep."""
    settings = TrainSettings(local_epochs=1, batch_size=4, lr=0.05, momentum=0.9, weight_decay=0.01,
                             grad_clip=0.5, keep_optimizer_state=True)
    from test_perfedavg import Tiny

    trainer = LocalTrainer(Tiny, settings)
    live = {name: value.detach().clone() for name, value in tiny_params().items()}
    tools = _Tools(trainer, meta_fit(), live, list(live))
    reference = {name: value.detach().clone().requires_grad_(True) for name, value in tiny_params().items()}
    optimizer = torch.optim.SGD(list(reference.values()), lr=0.3, momentum=0.9, weight_decay=0.01)
    generator = torch.Generator().manual_seed(0)
    for _ in range(2):
        grads = {name: 3 * torch.randn(value.shape, generator=generator) for name, value in live.items()}
        tools.sgd_step(grads, 0.3)
        for name, tensor in reference.items():
            tensor.grad = grads[name].clone()
        torch.nn.utils.clip_grad_norm_(list(reference.values()), 0.5)
        optimizer.step()
    for name in live:
        torch.testing.assert_close(live[name], reference[name].detach())
    kept = tools.optimizer_state_out(None)
    for name, tensor in reference.items():
        torch.testing.assert_close(kept[name], optimizer.state[tensor]["momentum_buffer"])


def test_a_step_that_updates_params_itself_gets_none_of_the_settings():
    """Per-FedAvg by default (and so APFL, FedSAM, pFedMe, which never call sgd_step): momentum,
    weight decay and clipping change nothing, and no optimizer state is kept."""
    x, y = data(16)
    plain = TrainSettings(local_epochs=2, batch_size=4, lr=0.05, seed=5)
    loaded = TrainSettings(local_epochs=2, batch_size=4, lr=0.05, seed=5, momentum=0.9, weight_decay=0.1,
                           grad_clip=1e-3, keep_optimizer_state=True)
    out_plain, _ = train(meta_fit(), plain, x, y)
    out_loaded, _ = train(meta_fit(), loaded, x, y)
    for name in out_plain:
        assert torch.equal(out_plain[name], out_loaded[name])


def test_perfedavg_trainer_optimizer_takes_the_configs_momentum_and_clipping():
    x, y = data(16)
    plain = TrainSettings(local_epochs=2, batch_size=4, lr=0.05, seed=5)
    loaded = TrainSettings(local_epochs=2, batch_size=4, lr=0.05, seed=5, momentum=0.9, grad_clip=1e-3,
                           keep_optimizer_state=True)
    default, _ = train(meta_fit(), loaded, x, y)
    with_settings, _ = train(meta_fit(trainer_optimizer=True), loaded, x, y)
    assert max((default[k] - with_settings[k]).abs().max() for k in default) > 1e-4
    # the tiny clip bounds each of the 4 meta steps to beta * clip, momentum to a growing sum of them
    start = tiny_params()
    moved = torch.sqrt(sum(((with_settings[k] - start[k]) ** 2).sum() for k in start))
    assert moved <= 0.3 * 1e-3 * (1 + 1.9 + 2.71 + 3.439) + 1e-7
    # with no momentum, decay or clipping in the config, the option is the plain meta step
    same, _ = train(meta_fit(trainer_optimizer=True), plain, x, y)
    unchanged, _ = train(meta_fit(), plain, x, y)
    for name in same:
        torch.testing.assert_close(same[name], unchanged[name])


def test_the_kept_momentum_of_the_meta_step_comes_back():
    from test_perfedavg import Tiny

    from pfedkit.engine.trainer import FitJob

    x, y = data(16)
    settings = TrainSettings(local_epochs=1, batch_size=4, lr=0.05, seed=5, momentum=0.9, keep_optimizer_state=True)
    trainer = LocalTrainer(Tiny, settings)
    first = trainer.fit(FitJob(1, 0, 0, meta_fit(trainer_optimizer=True), None), x, y)
    assert first.optimizer_state is not None and set(first.optimizer_state) == set(tiny_params())
    assert trainer.fit(FitJob(1, 0, 0, meta_fit(), None), x, y).optimizer_state is None
    resumed = trainer.fit(FitJob(2, 0, 0, meta_fit(trainer_optimizer=True), None, first.optimizer_state), x, y)
    fresh = trainer.fit(FitJob(2, 0, 0, meta_fit(trainer_optimizer=True), None, None), x, y)
    assert max((resumed.params[k] - fresh.params[k]).abs().max() for k in fresh.params) > 0
    with pytest.raises(AssertionError):
        torch.testing.assert_close(resumed.optimizer_state, fresh.optimizer_state)
