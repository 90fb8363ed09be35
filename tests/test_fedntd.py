"""FedNTD: the not-true logits, the not-true KL by hand, its independence of the teacher's true-class
logit, the global logits read at the batch's positions, beta = 0 is FedAvg, and the Fit carrying the
received model's logits of every training sample."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import switched_off_is_fedavg

from pfedkit.algorithms.fedntd import not_true_distillation, not_true_logits, ntd_loss
from pfedkit.config import load_config
from pfedkit.core.contract import Forward
from pfedkit.runs import prepare

CONFIG = {"dataset": "digits", "num_clients": 4, "rounds": 3, "threads": 1, "batch_size": 20, "lr": 0.05,
          "seed": 3, "partition": {"scheme": "dirichlet", "alpha": 0.5}}


def softmax(values, tau):
    exps = [math.exp(v / tau) for v in values]
    return [e / sum(exps) for e in exps]


def test_not_true_logits_drop_the_true_class_and_keep_the_order():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]] * 3)
    picked = not_true_logits(logits, torch.tensor([0, 2, 3]))
    torch.testing.assert_close(picked, torch.tensor([[1.0, 2.0, 3.0], [0.0, 1.0, 3.0], [0.0, 1.0, 2.0]]))


def test_not_true_distillation_matches_a_hand_computation():
    tau = 2.0
    local = [[1.0, -1.0, 0.5], [0.0, 2.0, 1.0]]
    teacher = [[3.0, 0.0, 1.0], [-1.0, 0.5, 2.0]]
    y = [0, 2]
    by_hand = 0.0
    for row, t_row, label in zip(local, teacher, y):
        q = softmax([v for c, v in enumerate(row) if c != label], tau)
        g = softmax([v for c, v in enumerate(t_row) if c != label], tau)
        by_hand += tau ** 2 * sum(gc * math.log(gc / qc) for gc, qc in zip(g, q))
    local_logits, teacher_logits = torch.tensor(local, dtype=torch.float64), torch.tensor(teacher, dtype=torch.float64)
    value = not_true_distillation(local_logits, teacher_logits, torch.tensor(y), tau)
    assert value.item() == pytest.approx(by_hand / 2, rel=1e-12)
    # the direction matters: KL(teacher || local), not KL(local || teacher)
    swapped = not_true_distillation(teacher_logits, local_logits, torch.tensor(y), tau)
    assert swapped.item() != pytest.approx(value.item(), rel=1e-3)


def test_the_loss_does_not_depend_on_the_true_class_logit_of_the_teacher_or_its_own_in_the_kl():
    generator = torch.Generator().manual_seed(0)
    local, teacher = torch.randn(5, 4, generator=generator), torch.randn(5, 4, generator=generator)
    y = torch.tensor([0, 3, 1, 1, 2])
    moved = teacher.clone()
    moved[torch.arange(5), y] += torch.tensor([10.0, -7.0, 3.0, 100.0, -50.0])
    assert torch.equal(not_true_distillation(local, moved, y, 1.5), not_true_distillation(local, teacher, y, 1.5))
    own = local.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(not_true_distillation(own, teacher, y, 1.5), own)
    assert grad[torch.arange(5), y].abs().max() == 0.0
    assert not_true_distillation(teacher, teacher, y, 1.5).item() == pytest.approx(0.0, abs=1e-7)


def test_ntd_loss_reads_the_global_logits_at_the_batch_positions():
    generator = torch.Generator().manual_seed(1)
    context = {"global_logits": torch.randn(10, 3, generator=generator)}
    index = torch.tensor([7, 2, 9])
    out = Forward(None, torch.randn(3, 3, generator=generator), index)
    y = torch.tensor([0, 2, 1])
    loss = ntd_loss(out, y, {}, context, beta=2.0, tau=1.0)
    expected = F.cross_entropy(out.logits, y) + 2.0 * not_true_distillation(
        out.logits, context["global_logits"][index], y, 1.0)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    first_rows = F.cross_entropy(out.logits, y) + 2.0 * not_true_distillation(
        out.logits, context["global_logits"][:3], y, 1.0)
    assert loss.item() != pytest.approx(first_rows.item(), rel=1e-3)
    plain = F.cross_entropy(out.logits, y).item()
    assert ntd_loss(out, y, {}, context, beta=0.0, tau=1.0).item() == pytest.approx(plain)


def test_the_fit_gets_the_received_models_logits_of_every_training_sample(tmp_path):
    prepared = prepare(load_config({"algorithm": "fedntd", "dataset": "digits", "num_clients": 3, "rounds": 1,
                                    "threads": 1, "seed": 3, "out_dir": str(tmp_path), "fedntd": {"beta": 3.0}}))
    algo, data = prepared.simulation.algorithm, prepared.data.clients[1]
    received = {name: value - 0.02 for name, value in algo.setup.ops.initial_params().items()}
    update = algo.client_update(1, 1, None, {"params": received}, data)
    fit = next(update)
    assert fit.params is received and fit.loss.keywords == {"beta": 3.0, "tau": 1.0}
    torch.testing.assert_close(fit.context["global_logits"], algo.setup.ops.logits(received, data.x_train))
    assert fit.context["global_logits"].shape == (data.n_train, 10)
    with pytest.raises(StopIteration) as stop:
        update.send(received)
    assert stop.value.value[1]["weight"] == data.n_train


def test_beta_zero_gives_fedavg_metrics_exactly_and_the_default_learns(tmp_path):
    fedavg, fedntd = switched_off_is_fedavg(CONFIG, "fedntd", {"beta": 0.0}, tmp_path)
    assert not fedntd.metrics["accuracy"].equals(fedavg.metrics["accuracy"])
