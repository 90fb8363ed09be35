"""FedDistill (baselines.md "FedDistill"): lam = 0 is Local training, the distillation term by hand,
the server's per-label mean over owners (and the exclude-self download), masked samples, bytes."""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn

import pfedkit
from pfedkit.algorithms.feddistill import distillation_term, feddistill_loss
from pfedkit.config import load_config
from pfedkit.core.contract import Forward, cross_entropy
from pfedkit.run_files import read_diagnostics
from pfedkit.runs import prepare

from conftest import final_state


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def config(small_config):
    return {**small_config, "algorithm": "feddistill"}


def softmax(values):
    exps = [math.exp(v) for v in values]
    return [e / sum(exps) for e in exps]


@pytest.mark.parametrize("upload", ["after_training", "training_passes"])
def test_lam_zero_is_local_training(config, upload):
    distill = pfedkit.run({**config, "feddistill": {"lam": 0.0, "upload_logits": upload}})
    local = pfedkit.run({**config, "algorithm": "local"})
    columns = ["round", "client", "correct", "accuracy", "loss", "train_loss"]
    pd.testing.assert_frame_equal(distill.metrics[columns], local.metrics[columns])


def test_kl_and_both_pfllib_terms_match_a_hand_computation():
    logits = torch.tensor([[2.0, 0.0, -1.0], [0.5, 0.5, 0.0]])
    labels = torch.tensor([1, 0])
    targets = torch.tensor([[3.0, 1.0, 0.0], [0.0, 2.0, -2.0], [9.0, 9.0, 9.0]])
    has = torch.tensor([True, True, False])
    expected_kl, expected_ce, expected_mse = 0.0, 0.0, 0.0
    for z, label in zip(logits.tolist(), labels.tolist()):
        p, q = softmax(targets[label].tolist()), softmax(z)
        expected_kl += sum(pk * (math.log(pk) - math.log(qk)) for pk, qk in zip(p, q))
        expected_ce += -sum(tk * math.log(qk) for tk, qk in zip(targets[label].tolist(), q))
        expected_mse += sum((zk - tk) ** 2 for zk, tk in zip(z, targets[label].tolist())) / 3
    torch.testing.assert_close(distillation_term(logits, labels, targets, has, "kl"),
                               torch.tensor(expected_kl / 2))
    torch.testing.assert_close(distillation_term(logits, labels, targets, has, "pfllib_ce"),
                               torch.tensor(expected_ce / 2))
    torch.testing.assert_close(distillation_term(logits, labels, targets, has, "pfllib_mse"),
                               torch.tensor(expected_mse / 2))
    out = Forward(torch.zeros(2, 4), logits)
    context = {"targets": targets, "has_target": has}
    torch.testing.assert_close(feddistill_loss(out, labels, {}, context, lam=0.3),
                               cross_entropy(out, labels, {}, {}) + 0.3 * expected_kl / 2)
    # KL(p || p) = 0: a model already matching the global soft labels is not pushed
    assert float(distillation_term(targets[labels], labels, targets, has, "kl")) == pytest.approx(0.0, abs=1e-7)


def test_samples_whose_class_has_no_global_vector_contribute_zero():
    logits = torch.tensor([[2.0, 0.0, -1.0], [0.5, 0.5, 0.0], [1.0, -1.0, 3.0]], requires_grad=True)
    labels = torch.tensor([1, 2, 0])
    targets = torch.tensor([[3.0, 1.0, 0.0], [0.0, 2.0, -2.0], [5.0, -5.0, 0.0]])
    has = torch.tensor([True, True, False])  # class 2 has no global vector: sample 1 is left out
    term = distillation_term(logits, labels, targets, has)
    term.backward()
    assert torch.count_nonzero(logits.grad[1]) == 0 and torch.count_nonzero(logits.grad[0]) > 0
    kept = distillation_term(logits[[0, 2]].detach(), labels[[0, 2]], targets, has)
    torch.testing.assert_close(term.detach(), kept * 2 / 3)  # still averaged over the whole batch of 3
    nothing = torch.zeros(3, dtype=torch.bool)
    assert float(distillation_term(logits.detach(), labels, targets, nothing)) == 0.0


def test_pfllib_mse_equals_pfllibs_mse_loss_with_own_logits_where_a_class_has_no_vector():
    """PFLlib's FedDistill (until 2024-04): MSELoss(target, z) over [B, C], where a sample whose class
    has a global vector gets it as target and any other sample its own detached logits (so 0)."""
    logits = torch.tensor([[2.0, 0.0, -1.0], [0.5, 0.5, 0.0], [1.0, -1.0, 3.0]], requires_grad=True)
    labels = torch.tensor([1, 2, 0])
    targets = torch.tensor([[3.0, 1.0, 0.0], [0.0, 2.0, -2.0], [5.0, -5.0, 0.0]])
    has = torch.tensor([True, True, False])
    pfllib_target = logits.detach().clone()
    for b, label in enumerate(labels.tolist()):
        if has[label]:
            pfllib_target[b] = targets[label]
    torch.testing.assert_close(distillation_term(logits, labels, targets, has, "pfllib_mse"),
                               nn.functional.mse_loss(logits, pfllib_target))


def test_server_vector_is_the_plain_mean_over_owners_and_exclude_self_leaves_out_the_receiver(config):
    uploads = {0: {0: torch.tensor([1.0] * 10), 2: torch.arange(10.0)},
               1: {0: torch.tensor([3.0] * 10)},
               3: {0: torch.tensor([8.0] * 10), 2: torch.ones(10), 5: torch.full((10,), -2.0)}}
    replies = {cid: {"logits": vectors} for cid, vectors in uploads.items()}
    for exclude_self in (False, True):
        prepared = prepare(load_config({**config, "feddistill": {"exclude_self": exclude_self}}))
        algo, server = prepared.simulation.algorithm, prepared.state.server
        server = algo.aggregate(1, server, replies)
        recorded = algo.diagnostics["global_logits"][1]
        np.testing.assert_allclose(recorded[0], np.full(10, 4.0))  # (1 + 3 + 8) / 3, unweighted
        np.testing.assert_allclose(recorded[2], (np.arange(10.0) + 1) / 2)
        np.testing.assert_allclose(recorded[5], np.full(10, -2.0))
        assert np.isnan(recorded[[1, 3, 4, 6, 7, 8, 9]]).all()
        down = algo.broadcast(2, server, [0, 1, 2, 3])
        if not exclude_self:
            for cid in range(4):
                assert sorted(down[cid]["logits"]) == [0, 2, 5]
                torch.testing.assert_close(down[cid]["logits"][0], torch.full((10,), 4.0))
        else:
            torch.testing.assert_close(down[0]["logits"][0], torch.full((10,), 5.5))  # (3 + 8) / 2
            torch.testing.assert_close(down[1]["logits"][0], torch.full((10,), 4.5))  # (1 + 8) / 2
            torch.testing.assert_close(down[2]["logits"][0], torch.full((10,), 4.0))  # not an owner: all
            torch.testing.assert_close(down[0]["logits"][2], torch.ones(10))
            torch.testing.assert_close(down[3]["logits"][2], torch.arange(10.0))
            assert 5 not in down[3]["logits"] and 5 in down[0]["logits"]  # its only owner gets nothing
        # a later round without class 5 keeps its vector; class 0 is replaced by that round's mean
        server = algo.aggregate(2, server, {1: {"logits": {0: torch.zeros(10)}}})
        np.testing.assert_allclose(algo.diagnostics["global_logits"][2][0], np.zeros(10))
        np.testing.assert_allclose(algo.diagnostics["global_logits"][2][5], np.full(10, -2.0))
        if exclude_self:
            assert 0 not in algo.broadcast(3, server, [1])[1]["logits"]  # 1 is now class 0's only owner
            torch.testing.assert_close(algo.broadcast(3, server, [0])[0]["logits"][0], torch.zeros(10))


def upload_of_one_update(config, cid: int = 2):
    """(algorithm, client data, initial params, new client state, reply) of client cid's round 1."""
    from pfedkit.engine.trainer import FitJob

    prepared = prepare(load_config(config))
    algo, trainer, data = prepared.simulation.algorithm, prepared.runtime.trainer, prepared.data.clients[cid]
    start = {name: value.clone() for name, value in prepared.state.clients[cid]["params"].items()}
    update = algo.client_update(1, cid, prepared.state.clients[cid], {}, data)
    outcome = trainer.fit(FitJob(1, cid, 0, next(update), None), data.x_train, data.y_train)
    with pytest.raises(StopIteration) as stop:
        update.send(outcome.params)
    return algo, data, start, *stop.value.value


def class_mean_logits(algo, params, data):
    logits = algo.setup.ops.logits(params, data.x_train)
    return {c: logits[data.y_train == c].mean(dim=0) for c in sorted(set(data.y_train.tolist()))}


def test_upload_is_the_per_label_mean_logits_of_the_trained_model(config):
    algo, data, _, state, reply = upload_of_one_update(config)
    expected = class_mean_logits(algo, state["params"], data)
    assert sorted(reply["logits"]) == sorted(expected)
    for c, vector in reply["logits"].items():
        torch.testing.assert_close(vector, expected[c])


def test_training_passes_upload_the_logits_of_the_training_forwards_not_of_the_trained_model(config):
    """One epoch of one full batch: the only training forward is the initial model's, so the upload
    is the initial model's per-class mean logits (train mode = eval mode on this MLP), and not the
    trained model's; the client keeps the model alone, without the carried sums."""
    config = {**config, "batch_size": 10_000, "drop_last": False, "local_epochs": 1,
              "feddistill": {"upload_logits": "training_passes"}}
    algo, data, start, state, reply = upload_of_one_update(config)
    before, after = class_mean_logits(algo, start, data), class_mean_logits(algo, state["params"], data)
    assert sorted(reply["logits"]) == sorted(before)
    assert sorted(state["params"]) == sorted(start)
    for c, vector in reply["logits"].items():
        torch.testing.assert_close(vector, before[c])
        assert (vector - after[c]).abs().max() > 1e-3


def test_training_passes_weigh_every_forward_of_every_epoch_alike(config):
    """lr ~ 0 over 3 epochs of small batches: every forward sees the same model, so the mean over
    the training forwards equals the eval-mode class means (a count off or a batch lost moves it)."""
    config = {**config, "lr": 1e-9, "batch_size": 7, "drop_last": False, "local_epochs": 3,
              "feddistill": {"upload_logits": "training_passes"}}
    algo, data, start, state, reply = upload_of_one_update(config)
    expected = class_mean_logits(algo, start, data)
    assert sorted(reply["logits"]) == sorted(expected)
    for c, vector in reply["logits"].items():
        torch.testing.assert_close(vector, expected[c])


def test_training_passes_under_sample_level_dp_is_a_clear_config_error(config):
    from pfedkit.core.errors import ConfigError

    with pytest.raises(ConfigError, match="dp.level=sample"):
        pfedkit.run({**config, "rounds": 1, "backend": "sequential", "dp": {"level": "sample"},
                     "feddistill": {"upload_logits": "training_passes"}})


def test_end_to_end_bytes_diagnostic_and_accuracy(config):
    result = pfedkit.run(config)
    counts = prepare(load_config(config)).data.train_counts()
    owned, classes = (counts > 0).sum(axis=1), int((counts.sum(axis=0) > 0).sum())
    m = result.metrics[result.metrics["round"] >= 1]
    for _, row in m.iterrows():
        assert row["bytes_up"] == owned[int(row["client"])] * 10 * 4
        assert row["bytes_down"] == (0 if row["round"] == 1 else classes * 10 * 4)
    diagnostics = read_diagnostics(result.run_dir / "diagnostics.pt")
    assert sorted(diagnostics["global_logits"]) == [1, 2, 3]
    assert all(matrix.shape == (10, 10) for matrix in diagnostics["global_logits"].values())
    last = m[m["round"] == 3]
    assert last["correct"].sum() / last["n_test"].sum() > 0.5
    assert final_state(result).server["counts"].tolist() == (counts > 0).sum(axis=0).tolist()


@pytest.mark.parametrize("upload", ["after_training", "training_passes"])
def test_processes_backend_gives_the_sequential_metrics(config, upload):
    columns = ["round", "client", "accuracy", "loss", "bytes_up", "bytes_down"]
    base = {**config, "rounds": 2, "join_ratio": 0.75, "feddistill": {"exclude_self": True, "upload_logits": upload}}
    sequential = pfedkit.run({**base, "backend": "sequential"})
    processes = pfedkit.run({**base, "backend": "processes", "workers": 2})
    pd.testing.assert_frame_equal(sequential.metrics[columns], processes.metrics[columns])
