"""kNN-Per: the kNN distribution (eq. 2) against a hand computation, the interpolation (eq. 1) in
both readings, lam = 0 giving the global model's predictions exactly (FedAvg's metrics), the
datastore built at evaluation with the evaluated model, and a digits run."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import TinyNet, final_state, tiny_params

import pfedkit
from pfedkit.algorithms.knnper import KNNPer, interpolated_logits, knn_distribution
from pfedkit.core.contract import ClientData, Setup
from pfedkit.core.model_ops import ModelOps

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def algorithm(**options) -> KNNPer:
    return KNNPer(KNNPer.Hyper(**options), Setup(2, 3, np.ones((2, 3)), 0, 1, ModelOps(TinyNet)))


KEYS = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 2.0], [3.0, 3.0]])
LABELS = torch.tensor([0, 1, 1, 2])


def test_knn_distribution_weights_the_k_nearest_labels_by_the_gaussian_kernel():
    query = torch.tensor([[0.0, 0.5]])  # squared distances 0.25, 1.25, 2.25, 15.25: k = 3 keeps the first three
    got = knn_distribution(query, KEYS, LABELS, k=3, scale=0.5, num_classes=3)
    weights = [math.exp(-d / (2 * 0.5)) for d in (0.25, 1.25, 2.25)]  # exp(-dist^2 / (d sigma)), d = 2
    expected = [weights[0] / sum(weights), (weights[1] + weights[2]) / sum(weights), 0.0]
    np.testing.assert_allclose(got[0].numpy(), expected, rtol=1e-6)
    only_nearest = knn_distribution(query, KEYS, LABELS, k=1, scale=0.5, num_classes=3)
    np.testing.assert_array_equal(only_nearest[0].numpy(), [1.0, 0.0, 0.0])
    everything = knn_distribution(query, KEYS, LABELS, k=50, scale=1e6, num_classes=3)  # k > n: all keys
    np.testing.assert_allclose(everything[0].numpy(), [0.25, 0.5, 0.25], rtol=1e-5)  # huge sigma: plain votes


def test_a_query_far_from_every_key_still_gets_a_distribution():
    far = knn_distribution(torch.tensor([[1e4, 1e4]]), KEYS, LABELS, k=2, scale=1.0, num_classes=3)
    assert torch.isfinite(far).all() and far.sum().item() == pytest.approx(1.0)
    assert far[0, 2].item() > 0.99  # (3, 3) is much nearer than (1, 0) relative to the kernel width


def test_interpolation_mixes_probabilities_or_logits():
    z = torch.tensor([[2.0, 0.0, -1.0]])
    knn = torch.tensor([[0.0, 1.0, 0.0]])
    mixed = interpolated_logits(z, knn, 0.25, "probabilities")
    np.testing.assert_allclose(mixed.exp().numpy(), (0.25 * knn + 0.75 * F.softmax(z, dim=1)).numpy(), rtol=1e-6)
    np.testing.assert_allclose(interpolated_logits(z, knn, 0.25, "logits").numpy(), (0.25 * knn + 0.75 * z).numpy())
    assert torch.equal(interpolated_logits(z, knn, 0.0, "probabilities"), F.log_softmax(z, dim=1))
    pure = interpolated_logits(z, knn, 1.0, "probabilities")
    assert pure.argmax().item() == 1 and torch.isfinite(pure).all()  # log(0) floored: a finite loss


def test_datastore_holds_the_training_embeddings_under_the_evaluated_model():
    """Built at evaluation from the model being measured (its BatchNorm statistics from `data`),
    not from the model downloaded in the client's last round; training keeps no state."""
    algo = algorithm()
    x = torch.linspace(-1, 1, 18).reshape(6, 3)
    y = torch.tensor([0, 1, 2, 0, 1, 2])
    data = ClientData(0, x, y, x[:2], y[:2], np.bincount(y.numpy(), minlength=3))
    downloaded, trained, evaluated = tiny_params(1), tiny_params(2), tiny_params(3)
    update = algo.client_update(1, 0, algo.init_client(0, downloaded), {"params": downloaded}, data)
    assert next(update).params is downloaded
    with pytest.raises(StopIteration) as stop:
        update.send(trained)
    state, reply = stop.value.value
    assert state is None and reply == {"params": trained, "weight": 6}
    memory = algo.evaluation_state(0, {"params": downloaded}, state, evaluated, data)
    torch.testing.assert_close(memory["keys"], ModelOps(TinyNet).features(evaluated, x))
    assert not torch.allclose(memory["keys"], ModelOps(TinyNet).features(downloaded, x))
    assert torch.equal(memory["labels"], y) and memory["params"] is evaluated


def test_prediction_reads_the_evaluated_head_the_labels_of_neighbours_and_an_empty_store_falls_back():
    algo = algorithm(lam=1.0, k=1)
    server, evaluated = {"params": tiny_params(4)}, tiny_params(3)
    features = torch.tensor([[0.1, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 5.0]])
    head = ModelOps(TinyNet).head_logits(evaluated, features)
    empty = {"params": evaluated, "keys": torch.zeros(0, 4), "labels": torch.zeros(0, dtype=torch.long)}
    torch.testing.assert_close(algo.predict(0, server, empty, features), F.log_softmax(head, dim=1))
    memory = {**empty, "keys": torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 4.0]]), "labels": torch.tensor([2, 0])}
    assert algo.predict(0, server, memory, features).argmax(dim=1).tolist() == [2, 0]
    half = algorithm(lam=0.5, k=1).predict(0, server, memory, features).exp()
    expected = 0.5 * F.one_hot(torch.tensor([2, 0]), 3) + 0.5 * F.softmax(head, dim=1)
    torch.testing.assert_close(half, expected.float())


def test_lam_zero_gives_the_metrics_of_fedavg(small_config):
    config = {**small_config, "join_ratio": 0.75}
    fedavg = pfedkit.run({**config, "out_dir": config["out_dir"] + "-fedavg"}).metrics
    knnper = pfedkit.run({**config, "algorithm": "knnper", "knnper": {"lam": 0.0}}).metrics
    for column in ["round", "client", "participated", "accuracy", "correct", "bytes_up", "bytes_down"]:
        np.testing.assert_array_equal(knnper[column].to_numpy(), fedavg[column].to_numpy(), err_msg=column)
    np.testing.assert_allclose(knnper["loss"].to_numpy(), fedavg["loss"].to_numpy(), rtol=1e-5)


def test_digits_run_learns_and_keeps_no_datastore_between_rounds(small_config):
    result = pfedkit.run({**small_config, "algorithm": "knnper"})
    last = result.metrics[result.metrics["round"] == 3]
    assert last["correct"].sum() / last["n_test"].sum() > 0.5
    assert all(client is None for client in final_state(result).clients)
