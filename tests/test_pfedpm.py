"""pFedPM / R-pFedPM (seed spec §2): the checkable properties of §2.13, the public functions, and
short end-to-end runs on digits."""
from __future__ import annotations

import itertools

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F

import pfedkit
from pfedkit.core.contract import ClientData, Forward, Setup, message_bytes
from pfedkit.algorithms.pfedpm import (UNAVAILABLE_SCORE, PFedPM, RPFedPM, mix_features, pfedpm_loss,
                                       relation_class_features, relation_logits, relation_extra, relation_from,
                                       relation_loss)
from pfedkit.algorithms.prototype_exchange import (class_distance_regulariser, feature_distance, global_features,
                                                   prototype_regulariser)
from pfedkit.algorithms.prototypes import class_means, message_to_table, table_to_message
from pfedkit.config import load_config
from pfedkit.core.errors import ConfigError
from pfedkit.core.model_ops import ModelOps
from pfedkit.core.seeds import torch_generator
from pfedkit.engine.state import read_checkpoint
from pfedkit.engine.trainer import FitJob, LocalTrainer, TrainSettings, request_schedule
from pfedkit.models import build_model
from pfedkit.models.relation import (RelationModule, make_pairs, relation_buffers, relation_params,
                                     relation_scores)
from pfedkit.report.run_report import report_run
from pfedkit.run_files import read_diagnostics
from pfedkit.runs import CHECKPOINT, prepare

D = 6  # feature dimension of the synthetic tests
C = 5  # classes of the synthetic tests


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def digits_config(tmp_path):
    """FedProto's n-way k-shot partition on digits with small shots: 4 clients of 2-4 classes."""
    return {"algorithm": "pfedpm", "dataset": "digits", "num_clients": 4, "rounds": 3, "threads": 1,
            "batch_size": 10, "lr": 0.05, "seed": 1, "out_dir": str(tmp_path / "runs"),
            "partition": {"scheme": "nway_kshot", "n": 3, "k": 10, "test_shots": 10}}


def random_table(seed: int, present: list[int], dim: int = D) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    table = torch.randn(C, dim, generator=generator)
    mask = torch.zeros(C, dtype=torch.bool)
    mask[present] = True
    return table * mask.unsqueeze(1), mask


# ------------------------------------------------------------------------------------------------
# §2.13 property 1: the mixed feature


def test_mixed_feature_is_local_at_a_one_global_at_a_zero_and_on_the_segment_between():
    local, has_local = random_table(0, [0, 1, 2, 3])
    global_, has_global = random_table(1, [1, 2, 3, 4])
    both = has_local & has_global
    mixed, has_mixed = mix_features(local, has_local, global_, has_global, 1.0)
    assert torch.equal(has_mixed, both)
    torch.testing.assert_close(mixed[both], local[both])
    mixed, _ = mix_features(local, has_local, global_, has_global, 0.0)
    torch.testing.assert_close(mixed[both], global_[both])
    for a in (0.1, 0.4, 0.75):
        mixed, _ = mix_features(local, has_local, global_, has_global, a)
        # on the segment: mixed - global = a (local - global), so its distances add up to the segment's
        torch.testing.assert_close(mixed[both] - global_[both], a * (local[both] - global_[both]))
        to_local = torch.linalg.vector_norm(mixed[both] - local[both], dim=1)
        to_global = torch.linalg.vector_norm(mixed[both] - global_[both], dim=1)
        segment = torch.linalg.vector_norm(local[both] - global_[both], dim=1)
        torch.testing.assert_close(to_local + to_global, segment)


def test_mixed_feature_is_undefined_without_local_or_global_feature():
    local, has_local = random_table(0, [0, 1])
    global_, has_global = random_table(1, [1, 2])
    mixed, has_mixed = mix_features(local, has_local, global_, has_global, 0.4)
    assert has_mixed.tolist() == [False, True, False, False, False]
    assert torch.count_nonzero(mixed[~has_mixed]) == 0
    with pytest.raises(ValueError, match="a must lie in"):
        mix_features(local, has_local, global_, has_global, 1.5)


# ------------------------------------------------------------------------------------------------
# §2.13 property 2: the global feature


def test_global_feature_is_count_weighted_mean_of_uploads_and_order_independent():
    uploads = []
    for client in range(4):
        classes = [c for c in range(C) if (c + client) % 3 != 0]
        features = {c: torch.randn(D, generator=torch.Generator().manual_seed(10 * client + c)) for c in classes}
        counts = {c: 1 + 7 * client + c for c in classes}
        uploads.append((features, counts))
    means, totals = global_features(uploads)
    for c in range(C):
        owners = [(f[c], n[c]) for f, n in uploads if c in f]
        expected = sum(n * f for f, n in owners) / sum(n for _, n in owners)
        torch.testing.assert_close(means[c], expected)
        assert totals[c] == sum(n for _, n in owners)
    for order in itertools.permutations(range(4)):
        shuffled, _ = global_features([uploads[i] for i in order])
        for c in range(C):
            torch.testing.assert_close(shuffled[c], means[c], rtol=0, atol=1e-7)
    uniform, _ = global_features(uploads, "uniform")
    for c in range(C):
        owners = [f[c] for f, _ in uploads if c in f]
        torch.testing.assert_close(uniform[c], sum(owners) / len(owners))
    printed, _ = global_features(uploads, "printed")  # FedProto's printed formula: "count" / |N_c|
    for c in range(C):
        owners = sum(1 for f, _ in uploads if c in f)
        torch.testing.assert_close(printed[c], means[c] / owners)


def test_class_distance_regulariser_is_eq_11_over_the_batch_classes():
    features = torch.tensor([[1.0, 0.0], [3.0, 2.0], [0.0, 4.0], [5.0, 5.0]])
    labels = torch.tensor([0, 0, 1, 2])
    mixed = torch.tensor([[1.0, 1.0], [0.0, 0.0], [9.0, 9.0]])
    has_mixed = torch.tensor([True, True, False])  # class 2 has no mixed feature: left out
    # class 0: batch mean (2, 1), distance^2 to (1, 1) = 1; class 1: (0, 4) to (0, 0) = 16
    assert float(class_distance_regulariser(features, labels, mixed, has_mixed)) == 17.0
    assert float(class_distance_regulariser(features, labels, mixed, torch.zeros(3, dtype=torch.bool))) == 0.0
    loss = pfedpm_loss(Forward(features, torch.zeros(4, 3)), labels, {}, {"mixed": mixed, "has_mixed": has_mixed},
                       lam=0.5, regulariser="class_distance")
    torch.testing.assert_close(loss, torch.log(torch.tensor(3.0)) + 0.5 * 17.0)


def test_class_uploaded_by_nobody_has_no_global_feature():
    means, totals = global_features([({0: torch.ones(D)}, {0: 3}), ({2: torch.zeros(D)}, {2: 1})])
    assert sorted(means) == [0, 2] and sorted(totals) == [0, 2]
    algo = make_algorithm(PFedPM)
    algo.feature_dim = D  # server-side math only: the synthetic features are D-dimensional
    server = algo.init_server({})
    server = algo.aggregate(1, server, {0: {"features": {1: torch.ones(D)}, "counts": {1: 4}}})
    assert server["present"].tolist() == [False, True, False, False, False]
    assert set(algo.broadcast(2, server, [0])[0]["features"]) == {1}
    # a class absent from this round's uploads keeps its previous global feature (spec §2.5 step 5)
    server = algo.aggregate(2, server, {0: {"features": {3: torch.zeros(D)}, "counts": {3: 2}}})
    assert server["present"].tolist() == [False, True, False, True, False]
    torch.testing.assert_close(server["features"][1], torch.ones(D))


def test_identical_local_features_give_global_equal_local_equal_mixed_for_every_a():
    local, has_local = random_table(5, [0, 2, 4])
    message = table_to_message(local, has_local)
    uploads = [(message, {c: n for c in message}) for n in (3, 7, 11)]
    means, _ = global_features(uploads)
    global_, has_global = message_to_table(means, C, D)
    assert torch.equal(has_global, has_local)
    torch.testing.assert_close(global_, local)
    for a in (0.0, 0.3, 0.6, 1.0):
        mixed, has_mixed = mix_features(local, has_local, global_, has_global, a)
        torch.testing.assert_close(mixed, local)


# ------------------------------------------------------------------------------------------------
# §2.13 property 3: the regulariser


def test_regulariser_is_zero_when_features_equal_mixed_features_and_never_reaches_the_head():
    mixed, has_mixed = random_table(2, [0, 1, 3])
    labels = torch.tensor([0, 1, 1, 3, 2, 4])  # classes 2 and 4 have no mixed feature
    features = mixed[labels] + torch.where(has_mixed[labels], 0.0, 5.0).unsqueeze(1)
    assert float(prototype_regulariser(features, labels, mixed, has_mixed)) == 0.0
    moved = features + 0.5
    expected = F.mse_loss(moved[has_mixed[labels]], mixed[labels[has_mixed[labels]]])
    torch.testing.assert_close(prototype_regulariser(moved, labels, mixed, has_mixed), expected)
    assert float(prototype_regulariser(features, labels, mixed, torch.zeros(C, dtype=torch.bool))) == 0.0

    model = build_model("mlp", (8,), C)
    params = dict(model.named_parameters())
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(0))
    features = model.body(x)
    target = torch.zeros(C, model.feature_dim)
    prototype_regulariser(features, labels, target, has_mixed).backward()
    assert all(params[n].grad is None for n in params if n.startswith("head."))
    assert all(params[n].grad.abs().sum() > 0 for n in params if n.startswith("body.fc"))
    # so inside the full loss, the head's gradient is that of the cross-entropy alone
    model.zero_grad(set_to_none=True)
    out = Forward(model.body(x), model(x))
    pfedpm_loss(out, labels, params, {"mixed": target, "has_mixed": has_mixed}, lam=3.0).backward()
    head_grads = {n: params[n].grad.clone() for n in params if n.startswith("head.")}
    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), labels).backward()
    for name, grad in head_grads.items():
        torch.testing.assert_close(grad, params[name].grad)


def test_regulariser_runs_under_vmap_so_the_vectorized_runtime_can_batch_clients():
    features = torch.randn(3, 6, D, generator=torch.Generator().manual_seed(0))
    labels = torch.tensor([[0, 1, 1, 3, 2, 4]] * 3)
    tables = [random_table(seed, present) for seed, present in ((1, [0, 1]), (2, []), (3, [1, 2, 3, 4]))]
    mixed = torch.stack([t for t, _ in tables])
    has_mixed = torch.stack([m for _, m in tables])
    batched = torch.vmap(prototype_regulariser)(features, labels, mixed, has_mixed)
    for k in range(3):
        torch.testing.assert_close(batched[k], prototype_regulariser(features[k], labels[k], mixed[k], has_mixed[k]))
    assert float(batched[1]) == 0.0


# ------------------------------------------------------------------------------------------------
# §2.13 property 4: what is uploaded


def make_algorithm(cls, hyper=None, *, model="mlp", input_shape=(8,), options=None):
    """An algorithm instance over a real ModelOps, outside any run (4 clients, C classes)."""
    def build():
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            return build_model(model, input_shape, C, **(options or {}))
    hyper = cls.Hyper() if hyper is None else hyper
    return cls(hyper, Setup(4, C, np.zeros((4, C), dtype=np.int64), 0, 1, ModelOps(build)))


def synthetic_client(cid: int, classes: list[int], per_class: int, input_shape) -> ClientData:
    generator = torch.Generator().manual_seed(cid)
    y = torch.tensor(classes).repeat_interleave(per_class)
    x = torch.randn(len(y), *input_shape, generator=generator) + y.view(-1, *[1] * len(input_shape)).float()
    counts = np.bincount(y.numpy(), minlength=C)
    return ClientData(cid, x, y, x[:4], y[:4], counts)


def drive(algo, trainer, rnd, cid, client, message, data):
    """Run one client_update to completion, answering its Fit requests with `trainer`."""
    update = algo.client_update(rnd, cid, client, message, data)
    request, index = next(update), 0
    while True:
        outcome = trainer.fit(FitJob(rnd, cid, index, request, None), data.x_train, data.y_train)
        index += 1
        try:
            request = update.send(outcome.params)
        except StopIteration as stop:
            return stop.value


def test_upload_is_classes_times_d_plus_one_numbers_and_no_parameter_leaves_the_client():
    algo = make_algorithm(PFedPM)
    data = synthetic_client(0, [1, 3, 4], 7, (8,))
    trainer = LocalTrainer(algo.setup.ops.build, TrainSettings(1, 5, 0.05))
    state, reply = drive(algo, trainer, 1, 0, algo.init_client(0, algo.setup.ops.initial_params()), {}, data)
    d = algo.feature_dim
    tensors = list(reply["features"].values())
    numbers = sum(t.numel() for t in tensors) + len(reply["counts"])
    assert sorted(reply["features"]) == sorted(reply["counts"]) == [1, 3, 4]
    assert numbers == 3 * (d + 1)
    assert message_bytes(reply) == 3 * (4 * d + 8)
    assert all(t.shape == (d,) for t in tensors)
    assert reply["counts"] == {1: 7, 3: 7, 4: 7}
    # the uploaded features are the class means of the trained body's outputs (eq. 6)
    features = algo.setup.ops.features(state["params"], data.x_train)
    for c in (1, 3, 4):
        torch.testing.assert_close(reply["features"][c], features[data.y_train == c].mean(0))


def test_clients_with_different_conv_widths_share_features_without_error():
    """pFedPM-mh's algorithmic side: clients whose CNNs differ (conv2 width 18/20/22) exchange
    only d = 50 features. (End-to-end runs: tests/test_model_heterogeneity.py.)"""
    shape = (1, 28, 28)
    algos, trainers, clients, data = [], [], [], []
    for cid, width in enumerate((18, 20, 22)):
        algo = make_algorithm(PFedPM, model="cnn_proto", input_shape=shape,
                              options={"c2": width})
        algos.append(algo)
        trainers.append(LocalTrainer(algo.setup.ops.build, TrainSettings(1, 10, 0.05)))
        clients.append(algo.init_client(cid, algo.setup.ops.initial_params()))
        data.append(synthetic_client(cid, [cid, cid + 1], 3, shape))
    server = algos[0].init_server({})
    for rnd in (1, 2):
        messages = algos[0].broadcast(rnd, server, [0, 1, 2])
        replies = {}
        for cid in range(3):
            clients[cid], replies[cid] = drive(algos[cid], trainers[cid], rnd, cid, clients[cid], messages[cid], data[cid])
        server = algos[0].aggregate(rnd, server, replies)
    assert server["present"].tolist() == [True, True, True, True, False]
    assert {clients[cid]["params"]["body.conv2.weight"].shape[0] for cid in range(3)} == {18, 20, 22}
    assert server["features"].shape == (C, 50)


# ------------------------------------------------------------------------------------------------
# §2.13 property 5: relation targets and prediction


def test_relation_loss_is_zero_iff_scores_are_one_for_the_true_class_and_zero_elsewhere():
    labels = torch.tensor([2, 0, 4])
    class_ids = torch.tensor([0, 2, 4])
    perfect = (labels.unsqueeze(1) == class_ids.unsqueeze(0)).float()
    assert float(relation_loss(perfect, labels, class_ids)) == 0.0
    for b, k in itertools.product(range(3), range(3)):
        wrong = perfect.clone()
        wrong[b, k] = 0.5
        assert float(relation_loss(wrong, labels, class_ids)) == pytest.approx(0.25 / 9)
    # a sample whose class has no class feature has all-zero targets
    assert float(relation_loss(torch.zeros(1, 3), torch.tensor([1]), class_ids)) == 0.0


def test_prediction_is_argmax_over_available_classes_only():
    class_ids = torch.tensor([1, 3])
    scores = torch.tensor([[0.2, 0.9], [0.7, 0.1]])
    logits = relation_logits(scores, class_ids, C)
    assert logits.argmax(1).tolist() == [3, 1]
    assert torch.all(logits[:, [0, 2, 4]] == UNAVAILABLE_SCORE)
    # through the algorithm's predict hook: only classes with a class feature can be predicted
    algo = make_algorithm(RPFedPM)
    client = algo.init_client(0, algo.setup.ops.initial_params())
    client["class_features"], client["available"] = random_table(3, [1, 3], algo.feature_dim)
    features = torch.randn(50, algo.feature_dim, generator=torch.Generator().manual_seed(1))
    predicted = algo.predict(0, None, client, features).argmax(1)
    assert set(predicted.tolist()) <= {1, 3}
    # before any class feature exists it falls back to the decision head
    client["available"][:] = False
    torch.testing.assert_close(algo.predict(0, None, client, features),
                               algo.setup.ops.head_logits(client["params"], features))


def test_relation_class_features_are_mixed_else_global():
    mixed, has_mixed = random_table(0, [0, 1])
    global_, has_global = random_table(1, [1, 2, 3])
    table, available = relation_class_features(mixed, has_mixed, global_, has_global)
    assert available.tolist() == [True, True, True, True, False]
    torch.testing.assert_close(table[:2], mixed[:2])
    torch.testing.assert_close(table[2:4], global_[2:4])


# ------------------------------------------------------------------------------------------------
# §2.13 property 6: lambda = 0 is Local training


def test_lambda_zero_without_relation_head_reduces_to_local_training(digits_config):
    local = pfedkit.run({**digits_config, "algorithm": "local"})
    pfedpm = pfedkit.run({**digits_config, "pfedpm": {"lam": 0.0}})
    columns = ["round", "client", "correct", "accuracy", "loss", "train_loss"]
    pd.testing.assert_frame_equal(local.metrics[columns], pfedpm.metrics[columns])
    clients_local = read_checkpoint(local.run_dir / CHECKPOINT).state.clients
    clients_pfedpm = read_checkpoint(pfedpm.run_dir / CHECKPOINT).state.clients
    for a, b in zip(clients_local, clients_pfedpm):
        assert all(torch.equal(a["params"][n], b["params"][n]) for n in a["params"])


def test_prototypes_act_at_the_default_lambda_in_the_readme_setting_on_digits(tmp_path):
    """README's default job (digits, 10 clients, Dirichlet 0.5) at pFedPM's defaults (lam = 1,
    a = 0.4): round 1 is Local exactly (no mixed feature exists yet); from round 2 the regulariser
    is part of every client's loss and the trained models, hence the evaluations, differ from
    Local's. (The summaries still nearly coincide there: docs/algorithms/pfedpm.md says why.)"""
    config = {"dataset": "digits", "rounds": 4, "threads": 1, "seed": 0, "out_dir": str(tmp_path)}
    local = pfedkit.run({**config, "algorithm": "local"}).metrics
    pfedpm = pfedkit.run({**config, "algorithm": "pfedpm"}).metrics
    assert load_config({**config, "algorithm": "pfedpm"}).to_dict()["pfedpm"]["lam"] == 1.0
    columns = ["client", "correct", "loss", "train_loss"]
    first = [frame[frame["round"] == 1][columns].reset_index(drop=True) for frame in (local, pfedpm)]
    pd.testing.assert_frame_equal(*first)
    later_local, later_pfedpm = (frame[frame["round"] >= 2].reset_index(drop=True) for frame in (local, pfedpm))
    assert (later_pfedpm["train_loss"] > later_local["train_loss"]).all()  # + lam R on every client, every round
    assert (later_pfedpm["loss"] != later_local["loss"]).all()  # every client's evaluated model differs


def test_relation_gradient_reaches_the_body_unless_detached(digits_config):
    """relation_detach_body=True: the body trains exactly as pFedPM's (psi never touches it);
    False (default): the relation loss changes the body from round 2 on (round 1 has no class
    features yet, so round-1 models are identical)."""
    config = {**digits_config, "rounds": 2}
    pfedpm = pfedkit.run(config)
    detached = pfedkit.run({**config, "algorithm": "rpfedpm", "rpfedpm": {"relation_detach_body": True}})
    joint = pfedkit.run({**config, "algorithm": "rpfedpm"})
    clients = [read_checkpoint(r.run_dir / CHECKPOINT).state.clients for r in (pfedpm, detached, joint)]
    for plain, no_grad, with_grad in zip(*clients):
        assert all(torch.equal(plain["params"][n], no_grad["params"][n]) for n in plain["params"])
        assert any(not torch.equal(plain["params"][n], with_grad["params"][n]) for n in plain["params"])


# ------------------------------------------------------------------------------------------------
# Public functions


def test_class_means_are_per_class_averages_with_counts():
    features = torch.arange(12.0).reshape(6, 2)
    labels = torch.tensor([0, 2, 0, 2, 2, 4])
    means, counts = class_means(features, labels, C)
    assert counts.tolist() == [2, 0, 3, 0, 1]
    torch.testing.assert_close(means[0], features[[0, 2]].mean(0))
    torch.testing.assert_close(means[2], features[[1, 3, 4]].mean(0))
    assert torch.count_nonzero(means[[1, 3]]) == 0


def test_feature_distance_is_mean_l2_over_shared_classes():
    a = {0: torch.tensor([3.0, 4.0]), 1: torch.zeros(2)}
    b = {0: torch.zeros(2), 1: torch.tensor([0.0, 1.0]), 2: torch.ones(2)}
    assert feature_distance(a, b) == pytest.approx(3.0)
    assert np.isnan(feature_distance({}, b))


def test_relation_module_sizes_and_functional_form_match_the_module():
    assert sum(p.numel() for p in RelationModule(50).parameters()) == 26_193
    assert sum(p.numel() for p in RelationModule(512).parameters()) == 262_737
    torch.manual_seed(0)
    module = RelationModule(D)
    params, buffers = relation_params(module), relation_buffers(module)
    features, class_features = torch.randn(4, D), torch.randn(3, D)
    pairs = make_pairs(features, class_features)
    assert torch.equal(pairs[1 * 3 + 2], torch.stack([features[1], class_features[2]]))
    module.train()
    expected = module(pairs).reshape(4, 3)
    torch.testing.assert_close(relation_scores(params, features, class_features, training=True, buffers=buffers),
                               expected)
    torch.testing.assert_close(buffers["bn.running_mean"], module.bn.running_mean)  # same stats update
    module.eval()
    torch.testing.assert_close(relation_scores(params, features, class_features, training=False, buffers=buffers),
                               module(pairs).reshape(4, 3))


# ------------------------------------------------------------------------------------------------
# The relation module trains in the engine's Fit (issue 22)


def relation_client(hyper: dict):
    """R-pFedPM on a synthetic client of classes 1, 3, 4 that has local features and receives
    global ones: every class has a class feature, so psi trains this round."""
    algo = make_algorithm(RPFedPM, RPFedPM.Hyper(**hyper))
    data = synthetic_client(0, [1, 3, 4], 8, (8,))
    client = algo.init_client(0, algo.setup.ops.initial_params())
    local, has_local = random_table(5, [1, 3, 4], algo.feature_dim)
    client.update(local=local, has_local=has_local)
    message = {"features": table_to_message(*random_table(6, [0, 1, 2, 3, 4], algo.feature_dim))}
    return algo, data, client, message


def drive_counting(algo, trainer, client, message, data) -> tuple[dict, list]:
    """`drive` that also returns the Fit requests the update made."""
    requests = []
    update = algo.client_update(1, 0, client, message, data)
    request = next(update)
    while True:
        requests.append(request)
        outcome = trainer.fit(FitJob(1, 0, len(requests) - 1, request, None), data.x_train, data.y_train)
        try:
            request = update.send(outcome.params)
        except StopIteration as stop:
            return stop.value[0], requests


def reference_relation_sgd(psi, statistics, features, labels, class_features, class_ids, batches, *, lr, momentum,
                           weight):
    """The hand-written loop R-pFedPM used before issue 22 (SGD on weight * L_rel over psi alone,
    features fixed), run over given mini-batches: what its alternate Fit must compute."""
    live = {name: value.detach().clone().requires_grad_(True) for name, value in psi.items()}
    stats = {name: value.detach().clone() for name, value in statistics.items()}
    optimizer = torch.optim.SGD(list(live.values()), lr=lr, momentum=momentum)
    for batch in batches:
        scores = relation_scores(live, features[batch], class_features, training=True, buffers=stats)
        loss = weight * relation_loss(scores, labels[batch], class_ids)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return {name: value.detach() for name, value in live.items()}, stats


def test_alternate_relation_fit_is_the_former_hand_loop_run_by_the_engine_trainer():
    """psi's own Fit (alternate form) = SGD with the run's lr and momentum on weight * L_rel over
    the body's fixed features, on the trainer's mini-batches; the model itself stays frozen."""
    algo, data, client, _ = relation_client({"relation_training": "alternate", "relation_weight": 2.0})
    params = algo.setup.ops.initial_params()
    body_features, _, _ = algo.local_features(params, data)
    # what the Fit reads per batch: given features (here the body's, shifted), not its own forward
    features = body_features + torch.randn(body_features.shape, generator=torch.Generator().manual_seed(8))
    class_features, available = random_table(7, [1, 2, 3, 4], algo.feature_dim)
    request = algo.relation_fit(params, client["relation"], client["relation_stats"], features,
                                {"class_features": class_features, "available": available})
    settings = TrainSettings(local_epochs=3, batch_size=5, lr=0.1, momentum=0.5, seed=4)
    outcome = LocalTrainer(algo.setup.ops.build, settings).fit(FitJob(1, 0, 1, request, None), data.x_train,
                                                                 data.y_train)
    batches = request_schedule(request, settings, data.n_train, torch_generator(4, 1, 0, "fit-1"))
    class_ids = available.nonzero().squeeze(1)
    expected_psi, expected_stats = reference_relation_sgd(
        client["relation"], client["relation_stats"], features, data.y_train, class_features[class_ids], class_ids,
        batches, lr=0.1, momentum=0.5, weight=2.0)
    psi, stats = relation_from(outcome.params)
    assert outcome.steps == len(batches) == 3 * 5  # 24 samples in batches of 5, 3 epochs
    for name in expected_psi:
        torch.testing.assert_close(psi[name], expected_psi[name], rtol=1e-5, atol=1e-6)
    for name in expected_stats:
        torch.testing.assert_close(stats[name], expected_stats[name], rtol=1e-5, atol=1e-6)
    assert any(not torch.equal(psi[n], client["relation"][n]) for n in psi)
    assert all(torch.equal(outcome.params[n], params[n]) for n in params)  # the model is frozen


def test_relation_training_with_lr_zero_leaves_psi_unchanged_but_moves_its_batchnorm_statistics():
    """lr=0: psi and the model keep their values (the Fit's SGD trains psi, nothing else does);
    psi's BatchNorm running statistics still move, as BatchNorm's do in train mode."""
    algo, data, client, message = relation_client({})
    for lr in (0.0, 0.05):
        trainer = LocalTrainer(algo.setup.ops.build, TrainSettings(1, 5, lr, momentum=0.5))
        state, requests = drive_counting(algo, trainer, dict(client), message, data)
        assert len(requests) == 1 and set(relation_extra(client["relation"], client["relation_stats"])) \
            == set(requests[0].extra)  # joint: one Fit that carries psi
        unchanged = all(torch.equal(state["relation"][n], client["relation"][n]) for n in client["relation"])
        assert unchanged == (lr == 0.0)
        assert not torch.equal(state["relation_stats"]["bn.running_mean"], client["relation_stats"]["bn.running_mean"])
        model_unchanged = all(torch.equal(state["params"][n], client["params"][n]) for n in client["params"])
        assert model_unchanged == (lr == 0.0)
        assert not any(name.startswith("relation.") for name in state["params"])


def test_joint_and_alternate_relation_training_differ():
    """joint: one Fit trains body, head and psi together; alternate: body + head with psi fixed,
    then psi alone (a second Fit, optimizer "relation", model frozen). Different psi and body."""
    states = {}
    for form in ("joint", "alternate"):
        algo, data, client, message = relation_client({"relation_training": form})
        trainer = LocalTrainer(algo.setup.ops.build, TrainSettings(1, 5, 0.05, momentum=0.5))
        states[form], requests = drive_counting(algo, trainer, client, message, data)
        if form == "joint":
            assert [(r.trainable, r.optimizer) for r in requests] == [("all", "default")]
        else:
            assert [(r.trainable, r.optimizer, bool(r.extra)) for r in requests] == \
                [("all", "default", False), ("none", "relation", True)]
    joint, alternate = states["joint"], states["alternate"]
    assert any(not torch.equal(joint["relation"][n], alternate["relation"][n]) for n in joint["relation"])
    assert any(not torch.equal(joint["params"][n], alternate["params"][n]) for n in joint["params"])


def test_relation_module_keeps_its_momentum_with_keep_optimizer_state(digits_config):
    """psi trains with the run's optimiser: with keep_optimizer_state its momentum buffers are kept
    per client, in the local Fit's optimizer (joint) or in its own "relation" slot (alternate)."""
    config = {**digits_config, "algorithm": "rpfedpm", "rounds": 2, "momentum": 0.5, "keep_optimizer_state": True}
    for form, slot in (("joint", "default"), ("alternate", "relation")):
        result = pfedkit.run({**config, "rpfedpm": {"relation_training": form}})
        kept = read_checkpoint(result.run_dir / CHECKPOINT).state.optimizer_states
        for state in kept:
            assert "relation.conv.weight" in state[slot]
            assert not any(name.startswith("relation.bn.running") for name in state[slot])  # never trained


def test_removed_relation_optimiser_keys_and_joint_epochs_are_refused(digits_config):
    for key in ("relation_lr", "relation_momentum", "relation_batch_size"):
        with pytest.raises(ConfigError, match=f"{key} was removed.*lr, momentum and batch_size"):
            load_config({**digits_config, "algorithm": "rpfedpm", "rpfedpm": {key: 0.1}}).hyper()
    with pytest.raises(ConfigError, match="relation_epochs applies to relation_training=alternate"):
        load_config({**digits_config, "algorithm": "rpfedpm", "rpfedpm": {"relation_epochs": 2}}).hyper()
    hyper = load_config({**digits_config, "algorithm": "rpfedpm",
                         "rpfedpm": {"relation_training": "alternate", "relation_epochs": 2}}).hyper()
    assert (hyper.relation_training, hyper.relation_epochs) == ("alternate", 2)
    assert RPFedPM.Hyper().relation_training == "joint"


def test_training_passes_prototype_source_is_refused_with_a_clear_message(digits_config):
    with pytest.raises(ConfigError, match="training_passes"):
        load_config({**digits_config, "pfedpm": {"prototype_source": "training_passes"}})


# ------------------------------------------------------------------------------------------------
# End to end on digits


def expected_bytes(metrics: pd.DataFrame, counts: np.ndarray, global_classes: dict, d: int) -> tuple:
    up = {cid: int((counts[cid] > 0).sum()) * (4 * d + 8) for cid in range(len(counts))}
    down = {rnd: (global_classes.get(rnd - 1, 0)) * 4 * d for rnd in metrics["round"].unique()}
    return up, down


@pytest.mark.parametrize("name", ["pfedpm", "rpfedpm", "rpfedpm-alternate"])
def test_end_to_end_on_digits(name, digits_config):
    config = {**digits_config, "algorithm": name.split("-")[0]}
    if name == "rpfedpm-alternate":
        config["rpfedpm"] = {"relation_training": "alternate", "relation_epochs": 2}
    result = pfedkit.run(config)
    state = read_checkpoint(result.run_dir / CHECKPOINT).state
    diagnostics = read_diagnostics(result.run_dir / "diagnostics.pt")
    prepared = prepare(load_config(config))
    data, algo = prepared.data, prepared.simulation.algorithm
    d = algo.feature_dim
    # communication: features + counts up, all known global features down (nothing before round 1)
    up, down = expected_bytes(result.metrics, data.train_counts(), diagnostics["global_classes"], d)
    for row in result.metrics.itertuples():
        assert row.bytes_up == up[row.client]
        assert row.bytes_down == down[row.round]
    assert diagnostics["global_classes"][3] == int((data.train_counts().sum(0) > 0).sum())
    # the per-client local/global feature distance is recorded every round and plotted
    for rnd in (1, 2, 3):
        distances = diagnostics["local_global_distance"][rnd]
        assert distances.shape == (4,) and np.all(np.isfinite(distances)) and np.all(distances >= 0)
    written = report_run(result.run_dir)
    assert any(p.name == "pfedpm_feature_distance.png" and p.stat().st_size > 0 for p in written)
    final = result.metrics[result.metrics["round"] == 3]
    chance = np.mean(1.0 / (data.train_counts() > 0).sum(1))  # clients hold 2-4 classes
    if name == "pfedpm":
        assert final["accuracy"].mean() > 1.5 * chance
    else:
        # evaluation used the relation head against each client's stored class features
        for cid, client in enumerate(state.clients):
            assert bool(client["available"].any())
            test = data.clients[cid]
            features = algo.setup.ops.features(client["params"], test.x_test)
            predicted = algo.predict(cid, state.server, client, features).argmax(1)
            assert int((predicted == test.y_test).sum()) == int(final[final["client"] == cid]["correct"].iloc[0])
            initial = algo.init_client(cid, algo.setup.ops.initial_params())["relation"]
            assert any(not torch.equal(initial[n], client["relation"][n]) for n in initial)
