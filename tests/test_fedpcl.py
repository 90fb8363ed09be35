"""FedPCL: the prototype-wise contrastive losses (eqs. 3-5) by hand, the global prototypes (eq. 2)
over the stored local tables, the padded local tables, uploads = class means of normalised trained
features (eq. 1), no training before any prototype exists, nearest-prototype prediction, and a
short digits run (bytes, private bodies)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import final_state, learned_run
from torch import nn

from pfedkit.algorithms.fedpcl import FedPCL, fedpcl_loss, prototype_contrastive_loss
from pfedkit.core.contract import ClientData, Forward, Setup
from pfedkit.core.model_ops import ModelOps
from pfedkit.models.base import BodyHeadModel

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def tiny_model() -> BodyHeadModel:
    return BodyHeadModel([("fc1", nn.Linear(3, 4)), ("relu", nn.ReLU()), ("fc", nn.Linear(4, 3))], "fc")


def tiny_algorithm(num_clients: int = 3, **hyper) -> FedPCL:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        ops = ModelOps(tiny_model)
    return FedPCL(FedPCL.Hyper(**hyper), Setup(num_clients, 3, np.ones((num_clients, 3)), seed=5, local_epochs=1,
                                               ops=ops))


def by_hand(reps: torch.Tensor, labels: list[int], prototypes: torch.Tensor, present: list[bool], tau: float) -> float:
    """-(1/B) sum_b log(exp(<r_b, P_y>/tau) / sum_{c present} exp(<r_b, P_c>/tau)), 0 for absent y_b."""
    total = 0.0
    for r, y in zip(reps.tolist(), labels):
        if not present[y]:
            continue
        scores = {c: sum(a * b for a, b in zip(r, prototypes[c].tolist())) / tau for c in range(len(present)) if present[c]}
        total -= scores[y] - math.log(sum(math.exp(s) for s in scores.values()))
    return total / len(labels)


def test_contrastive_loss_is_the_log_softmax_over_prototype_similarities():
    g = torch.Generator().manual_seed(1)
    reps = F.normalize(torch.randn(4, 5, generator=g), dim=1)
    prototypes = torch.randn(3, 5, generator=g)
    present = [True, False, True]  # class 1 has no prototype: out of every softmax, its sample adds 0
    labels = [0, 2, 1, 2]
    loss = prototype_contrastive_loss(reps, torch.tensor(labels), prototypes, torch.tensor(present), tau=0.3)
    assert float(loss) == pytest.approx(by_hand(reps, labels, prototypes, present, 0.3), rel=1e-5)
    # S tables: the mean of each table's loss
    second = torch.randn(3, 5, generator=g)
    both = prototype_contrastive_loss(reps, torch.tensor(labels), torch.stack([prototypes, second]),
                                      torch.tensor(present), tau=0.3)
    expected = (by_hand(reps, labels, prototypes, present, 0.3) + by_hand(reps, labels, second, present, 0.3)) / 2
    assert float(both) == pytest.approx(expected, rel=1e-5)


def test_local_objective_is_global_term_plus_mean_over_local_tables_of_normalised_features():
    g = torch.Generator().manual_seed(2)
    features = 7.0 * torch.randn(5, 4, generator=g)  # not normalised: the loss normalises them
    labels = [0, 1, 2, 1, 0]
    global_table, tables = torch.randn(3, 4, generator=g), torch.randn(2, 3, 4, generator=g)
    present = [True, True, True]
    context = {"global": global_table, "locals": tables, "present": torch.tensor(present)}
    loss = fedpcl_loss(Forward(features, torch.zeros(5, 3)), torch.tensor(labels), {}, context, tau=0.5)
    reps = F.normalize(features, dim=1)
    expected = by_hand(reps, labels, global_table, present, 0.5) + sum(
        by_hand(reps, labels, tables[s], present, 0.5) for s in range(2)) / 2
    assert float(loss) == pytest.approx(expected, rel=1e-5)
    no_locals = {**context, "locals": torch.zeros(0, 3, 4)}
    assert float(fedpcl_loss(Forward(features, torch.zeros(5, 3)), torch.tensor(labels), {}, no_locals, tau=0.5)) \
        == pytest.approx(by_hand(reps, labels, global_table, present, 0.5), rel=1e-5)


def stored_server(algo: FedPCL) -> dict:
    """Clients 0 and 2 uploaded: client 0 classes {0, 1} (counts 9, 1), client 2 class 0 (count 1)."""
    server = algo.init_server(algo.setup.ops.initial_params())
    replies = {2: {"prototypes": {0: torch.full((4,), 3.0)}, "counts": {0: 1}},
               0: {"prototypes": {0: torch.full((4,), 1.0), 1: torch.full((4,), -1.0)}, "counts": {0: 9, 1: 1}}}
    return algo.aggregate(1, server, replies)


def test_global_prototype_is_the_plain_mean_over_the_stored_tables_holding_the_class():
    algo = tiny_algorithm()
    server = stored_server(algo)
    down = algo.broadcast(2, server, [1])[1]
    assert sorted(down["global"]) == [0, 1] and sorted(down["locals"]) == [0, 2]  # client 1 never uploaded
    torch.testing.assert_close(down["global"][0], torch.full((4,), 2.0))  # (1 + 3) / 2, not (9 + 3) / 10
    torch.testing.assert_close(down["global"][1], torch.full((4,), -1.0))
    counted = tiny_algorithm(global_weighting="count")
    down = counted.broadcast(2, stored_server(counted), [1])[1]
    torch.testing.assert_close(down["global"][0], torch.full((4,), 1.2))  # (9 * 1 + 1 * 3) / 10
    # a later upload replaces the client's table (class 1 gone from client 0): no longer global
    server = algo.aggregate(2, server, {0: {"prototypes": {0: torch.full((4,), 5.0)}, "counts": {0: 2}}})
    down = algo.broadcast(3, server, [1])[1]
    assert sorted(down["global"]) == [0]
    torch.testing.assert_close(down["global"][0], torch.full((4,), 4.0))


def test_local_tables_are_padded_with_the_global_prototype_and_unseen_clients_skipped_or_global():
    algo = tiny_algorithm()
    context = algo.training_context(algo.broadcast(2, stored_server(algo), [1])[1])
    assert context["present"].tolist() == [True, True, False]
    assert context["locals"].shape == (2, 3, 4)  # clients 0 and 2 only
    torch.testing.assert_close(context["locals"][1, 0], torch.full((4,), 3.0))  # client 2's own class 0
    torch.testing.assert_close(context["locals"][1, 1], torch.full((4,), -1.0))  # its missing class 1: global
    padded = tiny_algorithm(unseen_clients="global")
    context = padded.training_context(padded.broadcast(2, stored_server(padded), [1])[1])
    assert context["locals"].shape == (3, 3, 4)
    torch.testing.assert_close(context["locals"][2], context["global"])  # client 1 counts as the global table


def client_data(cid: int = 1) -> ClientData:
    x = torch.randn(7, 3, generator=torch.Generator().manual_seed(3))
    y = torch.tensor([0, 2, 2, 0, 2, 0, 0])
    return ClientData(cid, x, y, x[:2], y[:2], np.array([4, 0, 3]))


def finish(update, answer):
    try:
        update.send(answer)
    except StopIteration as stop:
        return stop.value
    raise AssertionError("the client update asked for a second Fit")


def test_round_one_does_not_train_and_uploads_class_means_of_normalised_features():
    algo, data = tiny_algorithm(), client_data()
    client = algo.init_client(1, algo.setup.ops.initial_params())
    update = algo.client_update(1, 1, client, {"global": {}, "locals": {}}, data)
    request = next(update)
    assert request.steps == 0  # nothing to contrast with yet: no training (PFLlib, the FedPCL code)
    trained = {name: value * 1.5 for name, value in request.params.items()}
    state, reply = finish(update, trained)
    reps = F.normalize(algo.setup.ops.features(trained, data.x_train), dim=1)
    assert sorted(reply["prototypes"]) == [0, 2] and reply["counts"] == {0: 4, 2: 3}
    for c in (0, 2):
        torch.testing.assert_close(reply["prototypes"][c], reps[data.y_train == c].mean(dim=0))
        torch.testing.assert_close(state["prototypes"][c], reps[data.y_train == c].mean(dim=0))
    assert state["present"].tolist() == [True, False, True] and state["params"] is trained


def test_later_rounds_train_the_body_on_the_contrastive_objective():
    algo = tiny_algorithm(tau=0.2)
    message = algo.broadcast(2, stored_server(algo), [1])[1]
    request = next(algo.client_update(2, 1, algo.init_client(1, algo.setup.ops.initial_params()), message,
                                      client_data()))
    assert request.trainable == "body" and request.steps is None and request.epochs is None
    assert request.loss.func is fedpcl_loss and request.loss.keywords == {"tau": 0.2}
    assert request.context["locals"].shape == (2, 3, 4)


def test_prediction_is_the_nearest_local_prototype_or_the_global_one():
    algo = tiny_algorithm()
    client = {"params": {}, "prototypes": torch.tensor([[1.0, 0, 0, 0], [0, 0, 0, 0], [0, 1.0, 0, 0]]),
              "present": torch.tensor([True, False, True])}
    features = torch.tensor([[5.0, 1.0, 0, 0], [0.1, 3.0, 0, 0], [0, 0, 2.0, 0]])
    logits = algo.predict(0, stored_server(algo), client, features)
    assert logits.argmax(dim=1).tolist() == [0, 2, 0]  # never class 1 (the client has no prototype of it)
    reps = F.normalize(features, dim=1)
    torch.testing.assert_close(logits[:, [0, 2]], -torch.cdist(reps, client["prototypes"][[0, 2]]))
    globally = tiny_algorithm(prediction="global")
    logits = globally.predict(0, stored_server(globally), client, features)
    assert torch.isneginf(logits[:, 2]).all()  # the global table has classes 0 and 1 only
    torch.testing.assert_close(logits[:, 0], -torch.linalg.vector_norm(reps - 2.0, dim=1))


def test_fedpcl_learns_on_digits_bodies_stay_private_and_bytes_are_the_tables(small_config):
    config = {**small_config, "algorithm": "fedpcl", "rounds": 4}
    result, metrics, state = learned_run(config)
    d = 200  # digits MLP feature size
    owned = state.server["present"].sum(dim=1)  # every client took part: its last table is stored
    for row in metrics[metrics["round"] >= 1].itertuples():
        assert row.bytes_up == int(owned[row.client]) * (4 * d + 8)
        expected_down = 0 if row.round == 1 else None
        if expected_down is not None:
            assert row.bytes_down == expected_down
    last = metrics[metrics["round"] == 4]
    global_classes = int(state.server["present"].any(dim=0).sum())
    assert (last["bytes_down"] == 4 * d * (global_classes + int(owned.sum()))).all()
    bodies = [client["params"]["body.fc1.weight"] for client in state.clients]
    assert not torch.equal(bodies[0], bodies[1])
