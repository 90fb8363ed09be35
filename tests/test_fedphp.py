"""FedPHP: momentum 0 and lam 0 is FedAvg evaluated right after local training; the HPM update
and both momentum schedules by hand; the transfer terms (both MMD kernels, KD) against written-out
formulas; the loss reads the HPM's outputs of the batch's own samples; the HPM is evaluated."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import TinyNet, final_state, tiny_params

import pfedkit
from pfedkit.algorithms.fedphp import (TEACHER, FedPHP, adaptive_kernel_mmd, expected_participations,
                                       fedphp_loss, fixed_kernel_mmd, participation_momentum, round_momentum,
                                       soft_target_cross_entropy)
from pfedkit.core.contract import ClientData, Forward, Setup
from pfedkit.core.model_ops import ModelOps

pytestmark = pytest.mark.usefixtures("one_torch_thread")

COLUMNS = ["round", "client", "correct", "accuracy", "loss", "train_loss"]


def algorithm(rounds: int = 10, **options) -> FedPHP:
    setup = Setup(4, 3, np.full((4, 3), 2), seed=0, local_epochs=1, ops=ModelOps(TinyNet), rounds=rounds)
    return FedPHP(FedPHP.Hyper(**options), setup)


def test_momentum_and_lam_zero_is_fedavg_evaluated_after_local_training(small_config):
    """m = 0: the HPM is the latest local model; lam = 0: that model is trained by CE alone from the
    global model. So the server is FedAvg's and each client is evaluated with FedAvg's model right
    after its local training (every client takes part in every round here)."""
    config = {**small_config, "rounds": 2}
    php = pfedkit.run({**config, "algorithm": "fedphp", "fedphp": {"momentum": 0.0, "lam": 0.0}})
    fedavg = pfedkit.run({**config, "algorithm": "fedavg", "eval_point": "after_local_training"})
    assert php.metrics[COLUMNS].equals(fedavg.metrics[COLUMNS])
    server, reference = final_state(php).server["params"], final_state(fedavg).server["params"]
    assert all(torch.equal(server[name], reference[name]) for name in reference)


def test_momentum_schedules_by_hand():
    assert expected_participations(participants=10, num_clients=100, rounds=1000) == 100  # int(0.1 * 1000)
    assert expected_participations(participants=1, num_clients=100, rounds=20) == 1  # at least one
    assert participation_momentum(0.9, 0, 100) == 0.0  # first participation: the HPM is the local model
    assert participation_momentum(0.9, 50, 100) == pytest.approx(0.45)
    assert participation_momentum(0.9, 150, 100) == 0.9  # capped at m
    assert round_momentum(0.9, 1, 20) == 0.0 and round_momentum(0.9, 11, 20) == pytest.approx(0.45)


@pytest.mark.parametrize("schedule, expected_mu", [("participations", 0.9 * 3 / 5), ("rounds", 0.9 * 6 / 10)])
def test_the_hpm_becomes_mu_hpm_plus_one_minus_mu_local_and_the_count_grows(schedule, expected_mu):
    algo = algorithm(schedule=schedule, lam=0.0)
    inherited, received, trained = tiny_params(0), tiny_params(1), tiny_params(2)
    data = ClientData(0, torch.zeros(6, 3), torch.zeros(6, dtype=torch.int64), torch.zeros(1, 3),
                      torch.zeros(1, dtype=torch.int64), np.array([6, 0, 0]))
    message = algo.broadcast(7, {"params": received}, [0, 1])[0]  # 2 of 4 clients, 10 rounds: K = 5
    assert message.get("expected") == (5 if schedule == "participations" else None)
    update = algo.client_update(7, 0, {"inherited": inherited, "participations": 3}, message, data)
    fit = next(update)
    assert fit.params is received and fit.context == {}
    with pytest.raises(StopIteration) as stop:
        update.send(trained)
    state, reply = stop.value.value
    assert state["participations"] == 4 and reply["params"] is trained and reply["weight"] == 6
    for name in trained:
        torch.testing.assert_close(state["inherited"][name],
                                   expected_mu * inherited[name] + (1 - expected_mu) * trained[name])
    assert algo.client_model(0, {}, state) is state["inherited"]


def written_out_mmd(source, target, kernel) -> float:
    """mean over the B x B pairs of k(s, s') + k(t, t') - k(s, t') - k(t, s'), with loops."""
    rows = len(source)
    total = 0.0
    for a in range(rows):
        for b in range(rows):
            total += (kernel(source[a], source[b]) + kernel(target[a], target[b])
                      - kernel(source[a], target[b]) - kernel(target[a], source[b]))
    return total / rows ** 2


def test_both_mmd_kernels_match_written_out_estimates():
    g = torch.Generator().manual_seed(0)
    source, target = torch.randn(4, 3, generator=g), torch.randn(4, 3, generator=g) + 1.0
    stacked = torch.cat([source, target])
    pairs = [float((p - q).square().sum()) for p in stacked for q in stacked]
    scale = sum(pairs) / (8 * 8 - 8)  # the mean over the 8 x 8 - 8 off-diagonal pairs

    def adaptive(p, q):
        d = float((p - q).square().sum())
        return sum(math.exp(-d / (scale / 4 * 2 ** i)) for i in range(5))

    def fixed(p, q):
        d = float((p - q).square().sum())
        return sum(math.exp(-0.5 * d / a) for a in (10, 15, 20, 50))

    assert float(adaptive_kernel_mmd(source, target)) == pytest.approx(written_out_mmd(source, target, adaptive), rel=1e-4)
    assert float(fixed_kernel_mmd(source, target)) == pytest.approx(written_out_mmd(source, target, fixed), rel=1e-4)
    assert float(adaptive_kernel_mmd(source, source)) == pytest.approx(0.0, abs=1e-6)


def test_kd_term_softens_the_teacher_only():
    logits, teacher = torch.tensor([[2.0, 0.0, -1.0]]), torch.tensor([[4.0, 0.0, 8.0]])
    targets = [math.exp(v / 4) for v in (4.0, 0.0, 8.0)]
    targets = [t / sum(targets) for t in targets]
    log_q = [v - math.log(sum(math.exp(u) for u in (2.0, 0.0, -1.0))) for v in (2.0, 0.0, -1.0)]
    expected = -sum(t * lq for t, lq in zip(targets, log_q))
    assert float(soft_target_cross_entropy(logits, teacher, 4.0)) == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("transfer", ["mmd", "kd"])
def test_loss_is_one_minus_lam_ce_plus_lam_transfer_from_the_batch_samples_hpm_outputs(transfer):
    g = torch.Generator().manual_seed(1)
    features, logits = torch.randn(3, 4, generator=g), torch.randn(3, 5, generator=g)
    y, index = torch.tensor([0, 4, 2]), torch.tensor([6, 1, 3])
    table = torch.randn(8, 4 if transfer == "mmd" else 5, generator=g)  # the HPM's outputs of 8 samples
    out = Forward(features, logits, index)
    got = fedphp_loss(out, y, {}, {TEACHER: table}, lam=0.3, transfer=transfer)
    ce = torch.nn.functional.cross_entropy(logits, y)
    transferred = (adaptive_kernel_mmd(features, table[index]) if transfer == "mmd"
                   else soft_target_cross_entropy(logits, table[index], 4.0))
    torch.testing.assert_close(got, 0.7 * ce + 0.3 * transferred)
    assert fedphp_loss(out, y, {}, {}, lam=0.0).item() == ce.item()


def test_context_holds_the_hpms_eval_mode_outputs_of_every_training_sample():
    algo = algorithm(transfer="kd")
    inherited = tiny_params(3)
    x = torch.randn(5, 3, generator=torch.Generator().manual_seed(2))
    data = ClientData(0, x, torch.zeros(5, dtype=torch.int64), x[:1], torch.zeros(1, dtype=torch.int64), None)
    context = algo.teacher_context(0, {"inherited": inherited}, data)
    expected = torch.func.functional_call(TinyNet().eval(), inherited, (x,))
    torch.testing.assert_close(context[TEACHER][:5], expected)
    assert context[TEACHER].shape[0] >= 5


def test_hpm_and_the_local_option_are_the_evaluated_models(small_config):
    state = final_state(pfedkit.run({**small_config, "algorithm": "fedphp", "fedphp": {"evaluate_with": "local"}}))
    assert all(set(client) == {"inherited", "participations", "local"} for client in state.clients)
    assert all(client["participations"] == small_config["rounds"] for client in state.clients)
    algo = algorithm(evaluate_with="local")
    client = {"inherited": tiny_params(0), "local": tiny_params(1), "participations": 1}
    assert algo.client_model(0, {}, client) is client["local"]


def test_end_to_end_on_digits_beats_chance(small_config):
    result = pfedkit.run({**small_config, "algorithm": "fedphp"})
    assert result.summary["final_acc"] > 0.3
