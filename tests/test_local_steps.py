"""Contract extensions for Baselines I: custom local steps (Fit.step), extra trained tensors
(Fit.extra), and their runs on every runtime."""
from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.nn.functional as F

from conftest import TinyNet as Tiny
from conftest import tiny_params

from pfedkit.core.contract import Fit
from pfedkit.engine.trainer import FitJob, LocalTrainer, TrainSettings


def job(cid: int, request: Fit) -> FitJob:
    return FitJob(1, cid, 0, request, None)


def data(n: int = 23):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 3, generator=g), torch.randint(0, 2, (n,), generator=g)


def sgd_step(tools, batches) -> float:
    """Plain SGD written as a custom step: must equal the trainer's default step."""
    (batch,) = batches
    loss, grads = tools.loss_and_grad(batch)
    with torch.no_grad():
        for name, grad in grads.items():
            tools.params[name].sub_(tools.lr * grad)
    return float(loss)


def count_batches(tools, batches, *, seen) -> float:
    seen.append([len(b.y) for b in batches])
    return 0.0


def test_custom_sgd_step_equals_the_default_step():
    settings = TrainSettings(local_epochs=2, batch_size=5, lr=0.1, seed=4)
    trainer = LocalTrainer(Tiny, settings)
    x, y = data()
    plain = trainer.fit(job(0, Fit(tiny_params())), x, y)
    custom = trainer.fit(job(0, Fit(tiny_params(), step=sgd_step)), x, y)
    assert plain.steps == custom.steps == 10 and plain.samples == custom.samples
    for name in plain.params:
        torch.testing.assert_close(custom.params[name], plain.params[name])
    assert custom.mean_loss == pytest.approx(plain.mean_loss, rel=1e-6)


def test_custom_step_gets_consecutive_groups_and_drops_an_incomplete_one():
    seen: list = []
    trainer = LocalTrainer(Tiny, TrainSettings(local_epochs=1, batch_size=5, lr=0.1))
    x, y = data(23)  # batches of 5, 5, 5, 5, 3
    outcome = trainer.fit(job(0, Fit(tiny_params(), step=partial(count_batches, seen=seen),
                                              batches_per_step=2)), x, y)
    assert seen == [[5, 5], [5, 5]] and outcome.steps == 2 and outcome.samples == 20


def scaled_loss(out, y, params, context):
    return F.cross_entropy(out.logits * params["scale"], y)


def test_extra_tensors_are_trained_by_the_default_step_and_returned():
    settings = TrainSettings(local_epochs=1, batch_size=100, lr=0.5)
    x, y = data(8)
    params = tiny_params()
    scale = torch.tensor(1.5)
    out = LocalTrainer(Tiny, settings).fit(job(0, Fit(params, loss=scaled_loss, extra={"scale": scale},
                                                                trainable="head")), x, y)
    model = Tiny()
    model.load_state_dict(params)
    s = scale.clone().requires_grad_(True)
    loss = F.cross_entropy(model(x) * s, y)
    grad_s, grad_w = torch.autograd.grad(loss, [s, model.head.weight])
    torch.testing.assert_close(out.params["scale"], scale - 0.5 * grad_s)
    torch.testing.assert_close(out.params["head.weight"], params["head.weight"] - 0.5 * grad_w)
    assert torch.equal(out.params["body.0.weight"], params["body.0.weight"])  # trainable="head"
    assert scale.item() == 1.5  # the request's tensor is not modified


def test_extra_names_must_not_look_like_model_parameters():
    with pytest.raises(ValueError, match="Fit.extra"):
        Fit(tiny_params(), extra={"head.weight": torch.zeros(1)})


def test_vectorized_runs_custom_steps_sequentially_with_one_message(capsys):
    from pfedkit.engine.runtimes.vectorized import VectorizedRuntime

    x, y = data(20)
    settings = TrainSettings(local_epochs=1, batch_size=5, lr=0.1, seed=2)
    fake = _FakeData([(x, y), (x[:10], y[:10])])
    runtime = VectorizedRuntime(Tiny, settings, fake)
    jobs = [job(c, Fit(tiny_params(), step=sgd_step)) for c in (0, 1)]
    out = runtime.fit_many(jobs)
    reference = LocalTrainer(Tiny, settings)
    for request, (xc, yc) in zip(jobs, fake.pairs):
        expected = reference.fit(request, xc, yc).params
        assert all(torch.equal(out[request.cid].params[k], expected[k]) for k in expected)
    runtime.fit_many(jobs)
    assert capsys.readouterr().out.count("custom local step") == 1


class _FakeData:
    """The two fields of FederatedData the runtimes read: clients' training tensors, class count."""

    def __init__(self, pairs):
        from types import SimpleNamespace

        self.pairs = pairs
        self.clients = [SimpleNamespace(x_train=x, y_train=y, n_train=len(y)) for x, y in pairs]
        self.num_classes = 2
        self.num_clients = len(pairs)
