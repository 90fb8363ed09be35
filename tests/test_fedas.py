"""FedAS: without alignment and with n_i weights it is FedPer; the alignment Fit starts from the
global body and the client's own head and pulls towards the prototypes of the client's own
previous body; both alignment losses and the Fisher trace against written-out computations; the
server weighs the bodies by the traces."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import TinyNet, final_state, tiny_params
from torch.func import functional_call

import pfedkit
from pfedkit.algorithms.fedas import PROTOTYPES, FedAS, alignment_loss, fisher_trace, synchronised_model
from pfedkit.core.contract import ClientData, Forward, Setup
from pfedkit.core.model_ops import ModelOps
from pfedkit.core.params import merge, select

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def algorithm(**options) -> FedAS:
    setup = Setup(2, 3, np.full((2, 3), 4), seed=0, local_epochs=1, ops=ModelOps(TinyNet), rounds=5)
    return FedAS(FedAS.Hyper(**options), setup)


def client_data(n: int = 12, seed: int = 0) -> ClientData:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, 3, generator=g), torch.arange(n) % 3
    return ClientData(0, x, y, x[:2], y[:2], np.bincount(y.numpy(), minlength=3))


def test_without_alignment_and_with_sample_weights_it_is_fedper_evaluated_after_local_training(small_config):
    """The same rounds as FedPer (global body + own head, trained, bodies averaged by n_i); FedAS
    evaluates the client's own trained model, which is FedPer's at eval_point=after_local_training
    (every client takes part every round here)."""
    fedas = pfedkit.run({**small_config, "algorithm": "fedas",
                         "fedas": {"alignment_epochs": 0, "aggregation": "samples"}})
    fedper = pfedkit.run({**small_config, "algorithm": "fedper", "eval_point": "after_local_training"})
    columns = ["round", "client", "participated", "correct", "loss", "train_loss"]
    pd.testing.assert_frame_equal(fedas.metrics[columns], fedper.metrics[columns])
    body, shared = final_state(fedas).server["shared"], final_state(fedper).server["shared"]
    assert all(torch.equal(body[name], shared[name]) for name in shared)


def test_alignment_fit_starts_from_global_body_and_own_head_towards_own_prototypes():
    algo = algorithm(alignment_epochs=2, alignment_lr=0.03)
    own, global_body = tiny_params(0), select(tiny_params(1), "body")
    data = client_data()
    update = algo.client_update(1, 0, {"params": own}, {"shared": global_body}, data)
    align = next(update)
    assert align.trainable == "body" and align.epochs == 2 and align.lr == 0.03
    expected_start = merge(global_body, select(own, "head"))
    assert all(torch.equal(align.params[name], expected_start[name]) for name in expected_start)
    features = torch.func.functional_call(TinyNet().eval().body, {k[5:]: v for k, v in own.items()
                                                                   if k.startswith("body.")}, (data.x_train,))
    for c in range(3):
        torch.testing.assert_close(align.context[PROTOTYPES][c], features[data.y_train == c].mean(dim=0))
    aligned = tiny_params(2)
    train = update.send(aligned)  # the aligned body with the client's own head (not the aligned Fit's head)
    expected = merge(select(aligned, "body"), select(own, "head"))
    assert all(torch.equal(train.params[name], expected[name]) for name in expected)
    assert train.trainable == "all" and train.epochs is None
    trained = tiny_params(3)
    with pytest.raises(StopIteration) as stop:
        update.send(trained)
    state, reply = stop.value.value
    assert state["params"] is trained and set(reply["shared"]) == set(select(trained, "body"))
    assert reply["fisher"] > 0 and reply["weight"] == 12


@pytest.mark.parametrize("kind", ["pfllib", "flbench"])
def test_alignment_losses_by_hand(kind):
    g = torch.Generator().manual_seed(3)
    features, prototypes = torch.randn(5, 4, generator=g), torch.randn(3, 4, generator=g)
    y = torch.tensor([0, 2, 0, 0, 2])  # class 1 absent from the batch
    loss = alignment_loss(Forward(features, torch.zeros(5, 3)), y, {}, {PROTOTYPES: prototypes}, kind=kind)
    expected = 0.0
    for c in (0, 2):
        rows = features[y == c]
        if kind == "pfllib":  # torch's MSELoss(features of class c, prototype): mean over n_c x d
            expected += float(torch.nn.functional.mse_loss(rows, prototypes[c].expand_as(rows)))
        else:  # MSELoss(mean feature of class c, prototype): mean over d
            expected += float(torch.nn.functional.mse_loss(rows.mean(dim=0), prototypes[c]))
    assert float(loss) == pytest.approx(expected, rel=1e-6)


def test_fisher_trace_is_the_sum_over_batches_of_squared_gradient_norms():
    params, data = tiny_params(4), client_data(n=7, seed=5)
    ops = ModelOps(TinyNet)
    got = fisher_trace(ops, params, None, data.x_train, data.y_train, 3, torch.Generator().manual_seed(9))
    order = torch.randperm(7, generator=torch.Generator().manual_seed(9))
    expected = 0.0
    for rows in (order[:3], order[3:6], order[6:]):
        live = {k: v.clone().requires_grad_(True) for k, v in params.items()}
        logits = functional_call(TinyNet().eval(), live, (data.x_train[rows],))
        nll = -torch.log_softmax(logits, dim=1)[torch.arange(len(rows)), data.y_train[rows]].mean()
        expected += sum(float(g.square().sum()) for g in torch.autograd.grad(nll, list(live.values())))
    assert got == pytest.approx(expected, rel=1e-5)


def test_server_weighs_the_bodies_by_their_fisher_traces():
    replies = {0: {"shared": {"w": torch.tensor([1.0])}, "fisher": 3.0, "weight": 10},
               1: {"shared": {"w": torch.tensor([5.0])}, "fisher": 1.0, "weight": 30}}
    assert float(synchronised_model(replies, "fisher")["w"]) == pytest.approx(2.0)  # (3 * 1 + 1 * 5) / 4
    assert float(synchronised_model(replies, "samples")["w"]) == pytest.approx(4.0)  # (10 * 1 + 30 * 5) / 40
    flat = {cid: {**reply, "fisher": 0.0} for cid, reply in replies.items()}
    assert float(synchronised_model(flat, "fisher")["w"]) == pytest.approx(4.0)  # all zero: n_i


def test_records_the_traces_and_learns_on_digits(small_config):
    from pfedkit.run_files import read_diagnostics

    result = pfedkit.run({**small_config, "algorithm": "fedas"})
    assert result.summary["final_acc"] > 0.3
    traces = read_diagnostics(result.run_dir / "diagnostics.pt")["fisher_trace"]
    assert set(traces) == {1, 2, 3} and all(np.all(np.asarray(t) > 0) for t in traces.values())


def test_shared_head_option_starts_from_the_global_model_and_uploads_it_whole():
    algo = algorithm(alignment_epochs=1, private_head=False)
    own, global_model = tiny_params(0), tiny_params(1)
    assert set(algo.init_server(own)["shared"]) == set(own)
    update = algo.client_update(1, 0, {"params": own}, {"shared": global_model}, client_data())
    align = next(update)
    assert all(torch.equal(align.params[name], global_model[name]) for name in global_model)
    aligned = tiny_params(2)
    train = update.send(aligned)
    expected = merge(select(global_model, "head"), select(aligned, "body"))
    assert all(torch.equal(train.params[name], expected[name]) for name in expected)
    with pytest.raises(StopIteration) as stop:
        update.send(tiny_params(3))
    assert set(stop.value.value[1]["shared"]) == set(own)
