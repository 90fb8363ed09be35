"""FML: with both KL weights 0 the meme model is FedAvg's and the local model Local's; two local
steps against a hand computation of eq. 1-2 (both models from the same point, the peer's
distribution a constant, or PFLlib's cross gradients); the KL and its PFLlib reduction against
torch's; the server's mean of the memes; the local model is the one kept and evaluated."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import TinyNet as Tiny
from conftest import final_state, tiny_params
from torch import nn
from torch.func import functional_call

import pfedkit
from pfedkit.algorithms.fml import FML, MEME, kl_divergence, mean_of
from pfedkit.core.contract import ClientData, Setup
from pfedkit.core.seeds import torch_generator
from pfedkit.engine.trainer import FitJob, LocalTrainer, TrainSettings, batch_schedule

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def algorithm(**options) -> FML:
    return FML(FML.Hyper(**options), Setup(2, 3, np.ones((2, 3)), seed=0, local_epochs=1, ops=None))


def softmax_kl(target: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """KL(softmax(target) || softmax(logits)), batch mean, written out."""
    p, q = target.softmax(dim=1), logits.softmax(dim=1)
    return (p * (p.log() - q.log())).sum(dim=1).mean()


def test_kl_batchmean_by_hand_and_pfllib_reduction_is_torchs_kldivloss_default():
    g = torch.Generator().manual_seed(0)
    target, logits = torch.randn(5, 4, generator=g), torch.randn(5, 4, generator=g)
    torch.testing.assert_close(kl_divergence(target, logits), softmax_kl(target, logits))
    pfllib = nn.KLDivLoss()(torch.log_softmax(logits, dim=1), torch.softmax(target, dim=1))
    torch.testing.assert_close(kl_divergence(target, logits, "pfllib"), pfllib)
    assert float(kl_divergence(logits, logits)) == pytest.approx(0.0, abs=1e-7)


@pytest.mark.parametrize("options", [{"alpha": 0.3, "beta": 0.6},
                                     {"alpha": 0.3, "beta": 0.6, "meme_lr": 0.07, "kl_reduction": "pfllib"},
                                     {"alpha": 0.3, "beta": 0.6, "cross_gradients": True}])
def test_two_steps_match_a_hand_computation(options):
    lr = 0.2
    algo = algorithm(**options)
    hyper = algo.hyper
    settings = TrainSettings(local_epochs=1, batch_size=4, lr=lr, seed=5)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 3, generator=g), torch.randint(0, 3, (8,), generator=g)
    data = ClientData(0, x, y, x[:2], y[:2], np.bincount(y.numpy(), minlength=3))
    local, meme = tiny_params(0), tiny_params(1)
    update = algo.client_update(1, 0, {"local": local}, {"params": meme}, data)
    fit = next(update)
    assert set(fit.extra) == {MEME + name for name in meme}
    trained = LocalTrainer(Tiny, settings).fit(FitJob(1, 0, 0, fit, None), x, y).params
    with pytest.raises(StopIteration) as stop:
        update.send(trained)
    state, reply = stop.value.value

    reduction = {"batchmean": softmax_kl, "pfllib": lambda t, z: softmax_kl(t, z) / 3}[hyper.kl_reduction]
    cross = 1.0 if hyper.cross_gradients else 0.0
    w, m = dict(local), dict(meme)
    schedule = batch_schedule(fit, settings, len(y), torch_generator(settings.seed, 1, 0, "fit-0"))
    assert len(schedule) == 2
    for batch in schedule:
        xb, yb = x[batch], y[batch]
        pw = {k: v.clone().requires_grad_(True) for k, v in w.items()}
        pm = {k: v.clone().requires_grad_(True) for k, v in m.items()}
        zw, zm = functional_call(Tiny(), pw, (xb,)), functional_call(Tiny(), pm, (xb,))
        # eq. 1 trains the local model, the meme's distribution a constant (and the reverse for eq. 2)
        loss_w = hyper.alpha * nn.functional.cross_entropy(zw, yb) + (1 - hyper.alpha) * reduction(zm.detach(), zw)
        loss_m = hyper.beta * nn.functional.cross_entropy(zm, yb) + (1 - hyper.beta) * reduction(zw.detach(), zm)
        # PFLlib: the local loss also reaches the meme model and the meme loss the local model
        loss_w = loss_w + cross * (1 - hyper.beta) * reduction(zw, zm.detach())
        loss_m = loss_m + cross * (1 - hyper.alpha) * reduction(zm, zw.detach())
        grad_w = torch.autograd.grad(loss_w, list(pw.values()))
        grad_m = torch.autograd.grad(loss_m, list(pm.values()))
        w = {k: w[k] - lr * gk for k, gk in zip(w, grad_w)}
        m = {k: m[k] - (hyper.meme_lr or lr) * gk for k, gk in zip(m, grad_m)}
    for k in w:
        torch.testing.assert_close(state["local"][k], w[k])
        torch.testing.assert_close(reply["params"][k], m[k])
    assert set(state) == {"local"} and set(state["local"]) == set(local) and reply["weight"] == 8


def test_kl_weights_zero_train_the_meme_as_fedavg_and_the_local_model_as_local(small_config):
    """alpha = beta = 1: the server's meme is FedAvg's global model and each local model is the
    one Local training gives (plain SGD: momentum 0)."""
    config = {**small_config, "rounds": 2, "momentum": 0.0}
    fml = final_state(pfedkit.run({**config, "algorithm": "fml", "fml": {"alpha": 1.0, "beta": 1.0}}))
    fedavg = final_state(pfedkit.run({**config, "algorithm": "fedavg"}))
    local = final_state(pfedkit.run({**config, "algorithm": "local"}))
    for name, value in fedavg.server["params"].items():
        torch.testing.assert_close(fml.server["params"][name], value)
    for mine, theirs in zip(fml.clients, local.clients):
        for name, value in theirs["params"].items():
            torch.testing.assert_close(mine["local"][name], value)


def test_mutual_learning_changes_both_models(small_config):
    """The same run with the KL terms on: neither model is the one trained alone."""
    config = {**small_config, "rounds": 1, "momentum": 0.0}
    alone = final_state(pfedkit.run({**config, "algorithm": "fml", "fml": {"alpha": 1.0, "beta": 1.0}}))
    mutual = final_state(pfedkit.run({**config, "algorithm": "fml", "name": "mutual"}))
    name = next(iter(alone.server["params"]))
    assert not torch.equal(alone.server["params"][name], mutual.server["params"][name])
    assert not torch.equal(alone.clients[0]["local"][name], mutual.clients[0]["local"][name])


def test_server_mean_of_memes_by_samples_or_uniform():
    replies = {0: {"params": {"w": torch.tensor([1.0])}, "weight": 1},
               2: {"params": {"w": torch.tensor([4.0])}, "weight": 3}}
    assert float(mean_of(replies, "params", "samples")["w"]) == pytest.approx(3.25)
    assert float(mean_of(replies, "params", "uniform")["w"]) == pytest.approx(2.5)
    server = algorithm(weighting="uniform").aggregate(1, {"params": {}}, replies)
    assert float(server["params"]["w"]) == pytest.approx(2.5)


def test_evaluated_model_is_the_local_model_and_a_newcomer_gets_the_meme():
    algo = algorithm()
    local, meme = tiny_params(0), tiny_params(1)
    assert algo.client_model(0, {"params": meme}, {"local": local}) is local
    assert algo.joining_model(0, {"params": meme}, {"local": local}, None) is meme
    assert algo.trained_model(0, {"local": local}, {**local, **{MEME + k: v for k, v in meme.items()}}) is local


def test_end_to_end_on_digits_beats_chance(small_config):
    result = pfedkit.run({**small_config, "algorithm": "fml"})
    assert result.summary["final_acc"] > 0.3
