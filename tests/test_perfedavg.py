"""Per-FedAvg: the FO and HF meta steps against hand-computed values, alpha = 0 against FedAvg,
and the one-step evaluation that is measured but never written back."""
from __future__ import annotations

import torch
from conftest import TinyNet, final_state
from conftest import tiny_params as shared_tiny_params
from torch import nn
from torch.func import functional_call

import pfedkit
from pfedkit.algorithms.perfedavg import PerFedAvg
from pfedkit.core.contract import Algorithm
from pfedkit.core.seeds import torch_generator
from pfedkit.engine.trainer import FitJob, LocalTrainer, TrainSettings, batch_schedule


def Tiny():  # noqa: N802 (a model builder, used like a class)
    """A smooth (tanh) TinyNet, so finite differences of its gradient are accurate."""
    return TinyNet(nn.Tanh)


def tiny_params(dtype=torch.float32) -> dict:
    return shared_tiny_params(0, dtype, nn.Tanh)


def data(n: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 3, generator=g).to(dtype), torch.randint(0, 3, (n,), generator=g)


def grad_at(params, x, y, create_graph=False):
    """grad of the mean cross-entropy of Tiny at `params` on (x, y)."""
    point = {k: v if create_graph else v.detach().requires_grad_(True) for k, v in params.items()}
    loss = nn.functional.cross_entropy(functional_call(Tiny(), point, (x,)), y)
    return dict(zip(point, torch.autograd.grad(loss, list(point.values()), create_graph=create_graph)))


def train(fit, settings, x, y):
    """Run a Fit request on Tiny; also return the batch schedule the trainer used."""
    trainer = LocalTrainer(lambda: Tiny().to(x.dtype), settings)
    schedule = batch_schedule(fit, settings, len(y), torch_generator(settings.seed, 1, 0, "fit-0"))
    return trainer.fit(FitJob(1, 0, 0, fit, None), x, y).params, schedule


def hyper(**options):
    return PerFedAvg.Hyper(**options)


def test_first_order_meta_step_matches_hand_computation():
    alpha, beta = 0.4, 0.3
    settings = TrainSettings(local_epochs=1, batch_size=4, lr=0.05, seed=5)
    x, y = data(12)  # 3 batches: one meta step on the first two, the third is dropped
    w = tiny_params()
    fit = PerFedAvg(hyper(alpha=alpha, beta=beta), None).local_fit({"params": w})
    out, (d, d_prime, _) = train(fit, settings, x, y)
    inner = grad_at(w, x[d], y[d])
    adapted = {k: w[k] - alpha * inner[k] for k in w}
    outer = grad_at(adapted, x[d_prime], y[d_prime])
    for k in w:
        torch.testing.assert_close(out[k], w[k] - beta * outer[k])
    plain = grad_at(w, x[d_prime], y[d_prime])  # the gradient at w instead of w~ would be wrong
    assert max((outer[k] - plain[k]).abs().max() for k in w) > 1e-3


def test_hessian_free_step_matches_the_exact_hessian_vector_product():
    alpha, beta = 0.5, 0.5
    settings = TrainSettings(local_epochs=1, batch_size=4, lr=0.05, seed=6)
    x, y = data(12, torch.float64)  # float64: the finite difference (delta = 1e-3) is accurate to ~1e-6 per entry of H g
    w = tiny_params(torch.float64)
    fit = PerFedAvg(hyper(variant="hf", alpha=alpha, beta=beta), None).local_fit({"params": w})
    assert fit.batches_per_step == 3
    out, (d, d_prime, d_second) = train(fit, settings, x, y)
    inner = grad_at(w, x[d], y[d])
    g = grad_at({k: w[k] - alpha * inner[k] for k in w}, x[d_prime], y[d_prime])
    point = {k: v.detach().requires_grad_(True) for k, v in w.items()}
    grads = grad_at(point, x[d_second], y[d_second], create_graph=True)
    hvp = torch.autograd.grad(sum((grads[k] * g[k]).sum() for k in w), list(point.values()))
    hvp = dict(zip(w, hvp))
    for k in w:
        torch.testing.assert_close(out[k], w[k] - beta * (g[k] - alpha * hvp[k]), rtol=0, atol=1e-5)
    assert max((beta * alpha * hvp[k]).abs().max() for k in w) > 1e-3  # the Hessian term matters here


def test_hessian_free_with_alpha_zero_equals_first_order():
    settings = dict(batch_size=100, lr=0.05, seed=2)
    x, y = data(20)  # one batch per epoch: FO uses epochs 1-2, HF epochs 1-3; D' is epoch 2 in both
    fo = PerFedAvg(hyper(alpha=0.0, beta=0.2), None).local_fit({"params": tiny_params()})
    hf = PerFedAvg(hyper(variant="hf", alpha=0.0, beta=0.2), None).local_fit({"params": tiny_params()})
    out_fo, _ = train(fo, TrainSettings(local_epochs=2, **settings), x, y)
    out_hf, _ = train(hf, TrainSettings(local_epochs=3, **settings), x, y)
    assert all(torch.equal(out_fo[k], out_hf[k]) for k in out_fo)
    assert any(not torch.equal(out_fo[k], tiny_params()[k]) for k in out_fo)


def test_alpha_zero_full_batch_round_equals_fedavg_with_lr_beta(small_config):
    """alpha = 0 makes w~ = w: one meta step on full batches is one SGD step with lr beta."""
    config = {**small_config, "rounds": 1, "threads": 1, "batch_size": 1000}
    meta = pfedkit.run({**config, "algorithm": "perfedavg", "local_epochs": 2,
                        "perfedavg": {"alpha": 0.0, "beta": 0.3}})
    fedavg = pfedkit.run({**config, "algorithm": "fedavg", "local_epochs": 1, "lr": 0.3})
    assert (meta.metrics["train_steps"] == 1).all() and (fedavg.metrics["train_steps"] == 1).all()
    meta_params, fedavg_params = final_state(meta).server["params"], final_state(fedavg).server["params"]
    for k in fedavg_params:
        torch.testing.assert_close(meta_params[k], fedavg_params[k])


def test_evaluation_step_is_measured_but_never_written_back(small_config, monkeypatch):
    config = {**small_config, "algorithm": "perfedavg", "threads": 1, "perfedavg": {"beta": 0.05}}
    adapted = pfedkit.run(config)
    rarely = pfedkit.run({**config, "eval_every": 3})  # evaluates (adapts) only after the last round
    monkeypatch.setattr(PerFedAvg, "adapt", Algorithm.adapt)  # evaluate the global model as is
    plain = pfedkit.run(config)
    servers = [final_state(r).server["params"] for r in (adapted, rarely, plain)]
    for other in servers[1:]:
        assert all(torch.equal(servers[0][k], other[k]) for k in other)
    assert (adapted.metrics["train_loss"] == plain.metrics["train_loss"]).all()
    assert (adapted.metrics["accuracy"] != plain.metrics["accuracy"]).any()


def test_adaptation_is_the_unclipped_inner_step_with_lr_alpha_from_the_evaluated_model():
    """The evaluated model is w - alpha grad F(w; D), the meta objective's inner step: the config's
    clipping, weight decay and momentum (which would shrink or bend this step) do not apply."""
    alpha = 0.5
    settings = TrainSettings(local_epochs=1, batch_size=4, lr=0.05, momentum=0.9, weight_decay=0.1,
                             grad_clip=1e-3, seed=5)
    x, y = data(12)
    w = tiny_params()
    fit = PerFedAvg(hyper(alpha=alpha), None).adapt(0, {"params": w}, None, w)
    assert fit.params is w and fit.steps == 1
    out, (d,) = train(fit, settings, x, y)
    grad = grad_at(w, x[d], y[d])
    assert torch.sqrt(sum((g ** 2).sum() for g in grad.values())) > 100 * settings.grad_clip  # clipping would bite
    for k in w:
        torch.testing.assert_close(out[k], w[k] - alpha * grad[k])
    assert PerFedAvg(hyper(), None).adapt(0, {"params": w}, None, w).lr is None  # alpha = the config's lr


def test_eval_epochs_adapts_with_inner_steps_over_whole_epochs():
    """eval_epochs = k (FL-bench's test-path fine-tune): k epochs of inner steps w <- w - alpha g on
    consecutive batches of the schedule, still unclipped and without momentum."""
    alpha = 0.5
    settings = TrainSettings(local_epochs=3, batch_size=4, lr=0.05, momentum=0.9, grad_clip=1e-3, seed=5)
    x, y = data(10)
    w = tiny_params()
    fit = PerFedAvg(hyper(alpha=alpha, eval_epochs=2), None).adapt(0, {"params": w}, None, w)
    out, schedule = train(fit, settings, x, y)
    assert len(schedule) == 2 * 3  # two epochs of 10 samples in batches of 4 (the last one kept)
    expected = dict(w)
    for batch in schedule:
        grad = grad_at(expected, x[batch], y[batch])
        expected = {k: expected[k] - alpha * grad[k] for k in expected}
    for k in w:
        torch.testing.assert_close(out[k], expected[k])


def test_end_to_end_on_digits_beats_chance(small_config):
    """beta = alpha (PFLlib's choice): the default beta = 1e-3 barely moves in 3 rounds."""
    result = pfedkit.run({**small_config, "algorithm": "perfedavg", "threads": 1, "perfedavg": {"beta": 0.05}})
    assert result.summary["final_acc"] > 0.3
