"""FedKD: with both distillation weights 0 and no compression the mentee is FedAvg's model and the
mentor Local's; two local steps against a hand computation of eq. 1-2 (the adaptive weight
1 / (CE_t + CE_s), the KL and hidden terms, W_h's update); the SVD compression keeps the stated
energy with the fewest singular values; the threshold schedule; the server's mean update."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import TinyNet as Tiny
from conftest import final_state, tiny_params
from test_fml import softmax_kl  # KL(softmax(target) || softmax(logits)), written out
from torch import nn
from torch.func import functional_call

import pfedkit
from pfedkit.algorithms.fedkd import (HIDDEN_MAP, MENTEE, FedKD, compress_update, energy_threshold,
                                      restore_update, svd_compress, svd_restore)
from pfedkit.core.contract import ClientData, Setup
from pfedkit.core.seeds import torch_generator
from pfedkit.engine.trainer import FitJob, LocalTrainer, TrainSettings, batch_schedule

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FEATURES = 4  # TinyNet's body output


def algorithm(rounds: int = 10, **options) -> FedKD:
    ops = SimpleNamespace(template=SimpleNamespace(feature_dim=FEATURES))
    return FedKD(FedKD.Hyper(**options), Setup(2, 3, np.ones((2, 3)), seed=0, local_epochs=1, ops=ops, rounds=rounds))


def forward(params, x):
    """(features h, logits z) of TinyNet at `params`."""
    h = torch.relu(x @ params["body.0.weight"].T + params["body.0.bias"])
    z = functional_call(Tiny(), params, (x,))
    return h, z


@pytest.mark.parametrize("options", [{}, {"distill_weight": 0.5, "hidden_weight": 2.0, "mentee_lr": 0.07}])
def test_two_steps_match_a_hand_computation(options):
    lr = 0.2
    algo = algorithm(**options)
    hyper = algo.hyper
    settings = TrainSettings(local_epochs=1, batch_size=4, lr=lr, seed=5)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 3, generator=g), torch.randint(0, 3, (8,), generator=g)
    data = ClientData(0, x, y, x[:2], y[:2], np.bincount(y.numpy(), minlength=3))
    mentor, mentee = tiny_params(0), tiny_params(1)
    start_map = torch.eye(FEATURES) + 0.1 * torch.randn(FEATURES, FEATURES, generator=g)
    update = algo.client_update(1, 0, {"mentor": mentor, "hidden_map": start_map}, {"mentee": mentee}, data)
    fit = next(update)
    assert set(fit.extra) == {MENTEE + name for name in mentee} | {HIDDEN_MAP}
    trained = LocalTrainer(Tiny, settings).fit(FitJob(1, 0, 0, fit, None), x, y).params
    with pytest.raises(StopIteration) as stop:
        update.send(trained)
    state, reply = stop.value.value

    d, gh = hyper.distill_weight, hyper.hidden_weight
    t, s, w = dict(mentor), dict(mentee), start_map.clone()
    schedule = batch_schedule(fit, settings, len(y), torch_generator(settings.seed, 1, 0, "fit-0"))
    assert len(schedule) == 2
    for batch in schedule:
        xb, yb = x[batch], y[batch]
        pt = {k: v.clone().requires_grad_(True) for k, v in t.items()}
        ps = {k: v.clone().requires_grad_(True) for k, v in s.items()}
        pw = w.clone().requires_grad_(True)
        (ht, zt), (hs, zs) = forward(pt, xb), forward(ps, xb)
        ce_t, ce_s = nn.functional.cross_entropy(zt, yb), nn.functional.cross_entropy(zs, yb)
        a = 1.0 / float((ce_t + ce_s).detach())  # the adaptive weight, a constant of the step
        # eq. 1 trains the mentor (the mentee's outputs constants), eq. 2 the mentee and W_h
        loss_t = ce_t + d * a * softmax_kl(zs.detach(), zt) + gh * a * nn.functional.mse_loss(ht, hs.detach() @ w.T)
        loss_s = ce_s + d * a * softmax_kl(zt.detach(), zs) + gh * a * nn.functional.mse_loss(ht.detach(), hs @ w.T)
        hidden_w = gh * a * nn.functional.mse_loss(ht.detach(), hs.detach() @ pw.T)
        grad_t = torch.autograd.grad(loss_t, list(pt.values()))
        grad_s = torch.autograd.grad(loss_s, list(ps.values()))
        (grad_w,) = torch.autograd.grad(hidden_w, [pw])
        t = {k: t[k] - lr * gk for k, gk in zip(t, grad_t)}
        s = {k: s[k] - (hyper.mentee_lr or lr) * gk for k, gk in zip(s, grad_s)}
        w = w - lr * grad_w
    for k in t:
        torch.testing.assert_close(state["mentor"][k], t[k])
    torch.testing.assert_close(state["hidden_map"], w)
    energy = energy_threshold(1, 10, hyper.t_start, hyper.t_end)
    sent = compress_update({k: s[k] - mentee[k] for k in s}, energy)
    for k, value in restore_update(sent, mentee).items():
        torch.testing.assert_close(svd_restore(reply["update"][k], mentee[k]), value)
    assert set(state) == {"mentor", "hidden_map"} and reply["weight"] == 8


def test_svd_compression_keeps_the_energy_with_the_fewest_singular_values():
    g = torch.Generator().manual_seed(0)
    for shape, energy in [((6, 5), 0.9), ((4, 3, 2, 2), 0.95), ((8, 8), 0.5), ((5, 7), 1.0)]:
        update = torch.randn(*shape, generator=g)
        sent = svd_compress(update, energy)
        s = torch.linalg.svdvals(update.reshape(shape[0], -1))
        kept = len(sent["s"])
        total = float((s * s).sum())
        assert float((s[:kept] ** 2).sum()) >= energy * total * (1 - 1e-6)  # keeps the energy
        assert float((s[:kept - 1] ** 2).sum()) < energy * total             # with the fewest values
        restored = svd_restore(sent, update)
        assert restored.shape == update.shape
        # the reconstruction's error is exactly the energy left out
        left_out = float((s[kept:] ** 2).sum())
        assert float(((restored - update) ** 2).sum()) == pytest.approx(left_out, abs=1e-4)
        assert sent["u"].shape == (shape[0], kept) and sent["v"].shape[0] == kept
    bias = torch.randn(5, generator=g)
    assert svd_compress(bias, 0.5) is bias and svd_restore(bias, bias) is bias
    zeros = torch.zeros(3, 3)
    assert svd_compress(zeros, 0.9) is zeros


def test_energy_threshold_rises_linearly_to_t_end():
    assert energy_threshold(1, 10, 0.95, 0.98) == pytest.approx(0.953)
    assert energy_threshold(5, 10, 0.95, 0.98) == pytest.approx(0.965)
    assert energy_threshold(10, 10, 0.95, 0.98) == pytest.approx(0.98)
    assert algorithm(rounds=4, t_start=0.8, t_end=1.0).energy(2) == pytest.approx(0.9)


@pytest.mark.parametrize("options", [{}, {"weighting": "samples", "compress_download": False}])
def test_server_adds_the_compressed_mean_of_the_restored_updates(options):
    algo = algorithm(rounds=4, t_start=0.5, t_end=0.7, **options)  # low: the compression shows
    g = torch.Generator().manual_seed(2)
    mentee = {"w": torch.randn(6, 5, generator=g), "b": torch.randn(6, generator=g)}
    raw = [{"w": torch.randn(6, 5, generator=g), "b": torch.randn(6, generator=g)} for _ in range(2)]
    energy = energy_threshold(3, 4, 0.5, 0.7)
    replies = {2: {"update": compress_update(raw[1], energy), "weight": 3},
               0: {"update": compress_update(raw[0], energy), "weight": 1}}
    restored = [restore_update(replies[c]["update"], mentee) for c in (0, 2)]
    shares = (0.25, 0.75) if algo.hyper.weighting == "samples" else (0.5, 0.5)
    mean = {k: shares[0] * restored[0][k] + shares[1] * restored[1][k] for k in mentee}
    if algo.hyper.compress_download:
        compressed = restore_update(compress_update(mean, energy), mentee)
        assert not torch.allclose(compressed["w"], mean["w"])
        mean = compressed
    new = algo.aggregate(3, {"mentee": mentee}, replies)["mentee"]
    for k in mentee:
        torch.testing.assert_close(new[k], mentee[k] + mean[k])


def test_no_distillation_and_no_compression_is_fedavg_for_the_mentee_and_local_for_the_mentor(small_config):
    """d = g = 0, T = 1, n_i weights: the server's mentee is FedAvg's model (up to U S V^T's float
    error) and every mentor is the model Local training gives (plain SGD: momentum 0)."""
    config = {**small_config, "rounds": 2, "momentum": 0.0}
    options = {"distill_weight": 0.0, "hidden_weight": 0.0, "t_start": 1.0, "t_end": 1.0, "weighting": "samples"}
    fedkd = final_state(pfedkit.run({**config, "algorithm": "fedkd", "fedkd": options}))
    fedavg = final_state(pfedkit.run({**config, "algorithm": "fedavg"}))
    local = final_state(pfedkit.run({**config, "algorithm": "local"}))
    for name, value in fedavg.server["params"].items():
        torch.testing.assert_close(fedkd.server["mentee"][name], value, rtol=1e-4, atol=1e-5)
    for mine, theirs in zip(fedkd.clients, local.clients):
        for name, value in theirs["params"].items():
            assert torch.equal(mine["mentor"][name], value)


def test_distillation_couples_the_models(small_config):
    """The same run with the distillation on: neither model is the one trained alone."""
    config = {**small_config, "rounds": 1, "momentum": 0.0}
    alone = final_state(pfedkit.run({**config, "algorithm": "fedkd",
                                     "fedkd": {"distill_weight": 0.0, "hidden_weight": 0.0}}))
    mutual = final_state(pfedkit.run({**config, "algorithm": "fedkd", "name": "mutual"}))
    name = next(iter(alone.server["mentee"]))
    assert not torch.equal(alone.server["mentee"][name], mutual.server["mentee"][name])
    assert not torch.equal(alone.clients[0]["mentor"][name], mutual.clients[0]["mentor"][name])


def test_evaluated_model_is_the_mentor_and_a_newcomer_gets_the_mentee():
    algo = algorithm()
    mentor, mentee = tiny_params(0), tiny_params(1)
    client = {"mentor": mentor, "hidden_map": torch.eye(FEATURES)}
    assert algo.client_model(0, {"mentee": mentee}, client) is mentor
    assert algo.joining_model(0, {"mentee": mentee}, client, None) is mentee
    torch.testing.assert_close(algo.init_client(0, mentor)["hidden_map"], torch.eye(FEATURES))


def test_end_to_end_on_digits_beats_chance_and_uploads_less_than_fedavg(small_config):
    fedkd = pfedkit.run({**small_config, "algorithm": "fedkd"})
    fedavg = pfedkit.run({**small_config, "algorithm": "fedavg", "name": "fedavg"})
    assert fedkd.summary["final_acc"] > 0.3
    assert fedkd.summary["bytes_up"] < fedavg.summary["bytes_up"] / 2
