"""The reference LocalTrainer answers a Fit request exactly as asked: epochs / steps / lr given in the
request win over the config's values, and 0 is a real value (no training, no update), not "unset"."""
from __future__ import annotations

import pytest
import torch

from pfedkit.core.contract import Fit, Forward, cross_entropy
from pfedkit.core.params import Params, clone
from pfedkit.engine.trainer import FitJob, LocalTrainer, TrainSettings
from pfedkit.models.mlp import MLP

NUM_SAMPLES, BATCH_SIZE, CONFIG_EPOCHS = 23, 5, 3
BATCHES_PER_EPOCH = 5  # ceil(23 / 5): the last batch holds 3 samples


def build_model() -> MLP:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return MLP((4,), num_classes=3)


@pytest.fixture(scope="module")
def client_data():
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(NUM_SAMPLES, 4, generator=generator)
    y = torch.randint(0, 3, (NUM_SAMPLES,), generator=generator)
    return x, y


def make_trainer(**overrides) -> LocalTrainer:
    settings = {"local_epochs": CONFIG_EPOCHS, "batch_size": BATCH_SIZE, "lr": 0.1, "seed": 0, **overrides}
    return LocalTrainer(build_model, TrainSettings(**settings))


def initial_params() -> Params:
    return clone(dict(build_model().named_parameters()))


class LossCalls:
    """A cross-entropy loss that records the sample positions of every mini-batch it is called on."""

    def __init__(self) -> None:
        self.batches: list[torch.Tensor] = []

    def __call__(self, out: Forward, y, params, context):
        self.batches.append(out.index.clone())
        return cross_entropy(out, y, params, context)


def fit(trainer: LocalTrainer, data, **request):
    x, y = data
    job = FitJob(rnd=1, cid=0, index=0, request=Fit(initial_params(), **request), buffers=None)
    return trainer.fit(job, x, y)


def assert_same_params(a: Params, b: Params) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name} changed"


def assert_params_changed(a: Params, b: Params) -> None:
    assert any(not torch.equal(a[name], b[name]) for name in a), "no parameter changed"


def test_zero_epochs_trains_nothing_and_returns_the_params_unchanged(client_data):
    calls = LossCalls()
    outcome = fit(make_trainer(), client_data, epochs=0, loss=calls)
    assert calls.batches == [] and outcome.steps == 0 and outcome.samples == 0
    assert_same_params(outcome.params, initial_params())


def test_zero_lr_takes_steps_but_leaves_the_params_unchanged(client_data):
    # momentum and weight decay would move the parameters too if the config's lr were used
    trainer = make_trainer(momentum=0.9, weight_decay=0.01)
    outcome = fit(trainer, client_data, lr=0.0, epochs=1)
    assert outcome.steps == BATCHES_PER_EPOCH
    assert_same_params(outcome.params, initial_params())


def test_config_lr_does_update_the_params(client_data):
    """Control for the lr=0 test: the same request with the config's lr moves the parameters."""
    outcome = fit(make_trainer(momentum=0.9, weight_decay=0.01), client_data, epochs=1)
    assert_params_changed(outcome.params, initial_params())


def test_request_lr_overrides_the_config_lr(client_data):
    small = fit(make_trainer(lr=0.5), client_data, lr=1e-3, steps=1).params
    reference = fit(make_trainer(lr=1e-3), client_data, steps=1).params
    for name in small:
        torch.testing.assert_close(small[name], reference[name], rtol=0, atol=0)


def epochs_of(batches: list[torch.Tensor]) -> list[list[int]]:
    """Consecutive batches grouped into epochs of BATCHES_PER_EPOCH, as sorted sample positions."""
    return [sorted(torch.cat(batches[i:i + BATCHES_PER_EPOCH]).tolist())
            for i in range(0, len(batches), BATCHES_PER_EPOCH)]


@pytest.mark.parametrize("epochs", [1, 2])
def test_epochs_runs_that_many_passes_over_the_data(client_data, epochs):
    calls = LossCalls()
    outcome = fit(make_trainer(), client_data, epochs=epochs, loss=calls)
    assert len(calls.batches) == outcome.steps == epochs * BATCHES_PER_EPOCH
    assert outcome.samples == epochs * NUM_SAMPLES
    assert epochs_of(calls.batches) == [list(range(NUM_SAMPLES))] * epochs, "each epoch sees every sample once"


def test_no_epochs_given_uses_the_config_local_epochs(client_data):
    calls = LossCalls()
    outcome = fit(make_trainer(), client_data, loss=calls)
    assert len(calls.batches) == outcome.steps == CONFIG_EPOCHS * BATCHES_PER_EPOCH


def test_config_local_steps_replace_the_epochs_of_a_request_that_names_neither(client_data):
    """local_steps = 7 (more than one pass of 5 batches): exactly 7 batches, the same batches as a
    request for steps=7; a request that names its epochs or steps keeps them."""
    calls, asked = LossCalls(), LossCalls()
    outcome = fit(make_trainer(local_steps=7), client_data, loss=calls)
    fit(make_trainer(), client_data, steps=7, loss=asked)
    assert len(calls.batches) == outcome.steps == 7
    assert all(torch.equal(a, b) for a, b in zip(calls.batches, asked.batches))
    assert epochs_of(calls.batches)[0] == list(range(NUM_SAMPLES))  # the first pass covers every sample
    assert fit(make_trainer(local_steps=7), client_data, epochs=1).steps == BATCHES_PER_EPOCH
    assert fit(make_trainer(local_steps=7), client_data, steps=2).steps == 2


def test_epochs_with_drop_last_skip_the_partial_batch(client_data):
    calls = LossCalls()
    outcome = fit(make_trainer(drop_last=True), client_data, epochs=2, loss=calls)
    assert outcome.steps == 2 * (NUM_SAMPLES // BATCH_SIZE)
    assert all(len(batch) == BATCH_SIZE for batch in calls.batches)


def test_a_request_overrides_the_configs_drop_last_either_way(client_data):
    keep, drop = LossCalls(), LossCalls()
    assert fit(make_trainer(drop_last=True), client_data, epochs=1, drop_last=False, loss=keep).steps == BATCHES_PER_EPOCH
    assert sorted(torch.cat(keep.batches).tolist()) == list(range(NUM_SAMPLES))  # the partial batch included
    assert fit(make_trainer(), client_data, epochs=1, drop_last=True, loss=drop).steps == NUM_SAMPLES // BATCH_SIZE
    assert all(len(batch) == BATCH_SIZE for batch in drop.batches)


@pytest.mark.parametrize("steps", [1, 4, 7, 12])
def test_steps_runs_exactly_that_many_batches(client_data, steps):
    calls = LossCalls()
    outcome = fit(make_trainer(), client_data, steps=steps, loss=calls)
    assert len(calls.batches) == outcome.steps == steps
    assert outcome.samples == sum(len(batch) for batch in calls.batches)
    # batches are drawn epoch by epoch: the first full epoch covers every sample once
    if steps >= BATCHES_PER_EPOCH:
        assert epochs_of(calls.batches)[0] == list(range(NUM_SAMPLES))


def test_zero_steps_trains_nothing(client_data):
    calls = LossCalls()
    outcome = fit(make_trainer(), client_data, steps=0, loss=calls)
    assert calls.batches == [] and outcome.steps == 0
    assert_same_params(outcome.params, initial_params())


def test_frozen_part_stays_unchanged(client_data):
    outcome = fit(make_trainer(), client_data, epochs=1, trainable="head")
    start = initial_params()
    assert_same_params({n: p for n, p in outcome.params.items() if n.startswith("body.")},
                       {n: p for n, p in start.items() if n.startswith("body.")})
    assert_params_changed({n: p for n, p in outcome.params.items() if n.startswith("head.")},
                          {n: p for n, p in start.items() if n.startswith("head.")})


def test_the_trainer_does_not_modify_the_request_params(client_data):
    x, y = client_data
    params = initial_params()
    before = clone(params)
    make_trainer().fit(FitJob(1, 0, 0, Fit(params, epochs=1), None), x, y)
    assert_same_params(params, before)


def test_samples_train_only_on_those_positions_as_if_they_were_the_whole_set(client_data):
    """Fit.samples: batches are drawn over the subset and the loss sees positions in the FULL set;
    the result equals training on the sub-dataset alone (same seeded batch order)."""
    x, y = client_data
    subset = torch.tensor([1, 4, 5, 9, 12, 13, 20])
    calls = LossCalls()
    on_subset = fit(make_trainer(), client_data, samples=subset, epochs=2, loss=calls)
    alone = fit(make_trainer(), (x[subset], y[subset]), epochs=2)
    assert_same_params(on_subset.params, alone.params)
    seen = torch.cat(calls.batches)
    assert set(seen.tolist()) == set(subset.tolist()) and len(seen) == 2 * len(subset)
    assert on_subset.samples == 2 * len(subset)


def test_samples_outside_the_training_set_are_refused(client_data):
    with pytest.raises(IndexError, match="position 23"):
        fit(make_trainer(), client_data, samples=torch.tensor([0, NUM_SAMPLES]))
    with pytest.raises(ValueError, match="non-negative"):
        Fit(initial_params(), samples=torch.tensor([-1]))
