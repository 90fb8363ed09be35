"""CCVR: the clients' class moments, their pooling into the moments of the union, the virtual
features, the server's calibration of the downloaded model's classifier, and the runs around it
(off = FedAvg; training always FedAvg's; the statistics' bytes; calibration in the last round)."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import final_state, num_parameters
from torch import nn

import pfedkit
from pfedkit.algorithms.ccvr import CCVR, class_statistics, pooled_statistics, sample_virtual_features
from pfedkit.algorithms.creff import retrain_classifier
from pfedkit.core.contract import ClientData, Setup, message_bytes
from pfedkit.core.model_ops import ModelOps
from pfedkit.core.params import select
from pfedkit.core.seeds import SERVER, torch_generator
from pfedkit.models.base import BodyHeadModel
from pfedkit.run_files import read_diagnostics

QUICK = dict(CCVR.quick_test_options)


def tiny_algorithm(counts: np.ndarray, **hyper) -> CCVR:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        ops = ModelOps(lambda: BodyHeadModel([("fc1", nn.Linear(3, 5)), ("relu", nn.ReLU()),
                                              ("fc", nn.Linear(5, 4))], "fc"))
    return CCVR(CCVR.Hyper(**hyper), Setup(len(counts), 4, counts, seed=5, local_epochs=1, ops=ops))


def client_features() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Three clients: classes shared, a class with one sample on a client, a class on one client only."""
    g = torch.Generator().manual_seed(0)
    labels = [torch.tensor([0, 0, 0, 1, 1, 2, 2, 2]), torch.tensor([0, 1, 1, 1, 1, 2]), torch.tensor([3] + [1] * 9)]
    return [(torch.randn(len(y), 6, generator=g) * (1 + y[:, None]) + y[:, None], y) for y in labels]


# --- eqs. (1)-(4): the moments --------------------------------------------------------------------

def test_class_statistics_are_the_class_means_and_unbiased_covariances():
    features, labels = client_features()[0]
    stats = class_statistics(features, labels)
    assert stats["classes"].tolist() == [0, 1, 2] and stats["counts"].tolist() == [3, 2, 3]
    assert stats["means"].dtype == torch.float32 and stats["covariances"].shape == (3, 6, 6)
    for k, c in enumerate([0, 1, 2]):
        z = features[labels == c].double().numpy()
        np.testing.assert_allclose(stats["means"][k].numpy(), z.mean(0), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(stats["covariances"][k].numpy(), np.cov(z.T, ddof=1), rtol=1e-5, atol=1e-6)
    single = class_statistics(*client_features()[1])
    assert float(single["covariances"][0].abs().max()) == 0.0  # class 0: one sample, no covariance


def test_pooled_moments_are_the_moments_of_the_union_of_the_clients_features():
    clients = client_features()
    totals, means, covariances = pooled_statistics([class_statistics(x, y) for x, y in clients], num_classes=5)
    union_x = torch.cat([x for x, _ in clients]).double().numpy()
    union_y = torch.cat([y for _, y in clients]).numpy()
    assert totals.tolist() == [4, 15, 4, 1, 0]
    for c in range(3):
        z = union_x[union_y == c]
        np.testing.assert_allclose(means[c].numpy(), z.mean(0), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(covariances[c].numpy(), np.cov(z.T, ddof=1), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(means[3].numpy(), union_x[union_y == 3][0], rtol=1e-6)  # one sample:
    assert float(covariances[3].abs().max()) == 0.0  # its mean, no spread
    assert float(means[4].abs().max()) == 0.0 and float(covariances[4].abs().max()) == 0.0  # held by none


# --- eq. (5): the virtual features ----------------------------------------------------------------

def test_virtual_features_have_the_pooled_moments():
    g = torch.Generator().manual_seed(1)
    factor = torch.randn(2, 4, 4, generator=g, dtype=torch.float64)
    covariances = factor @ factor.transpose(1, 2)
    covariances[1, :, 3] = covariances[1, 3, :] = 0  # a singular covariance: no spread along axis 3
    means = torch.tensor([[1.0, -2.0, 0.5, 3.0], [0.0, 4.0, -1.0, 2.0]], dtype=torch.float64)
    virtual = sample_virtual_features(means, covariances, 40_000, torch.Generator().manual_seed(2))
    assert virtual.shape == (2, 40_000, 4) and virtual.dtype == torch.float32
    for c in range(2):
        z = virtual[c].double().numpy()
        np.testing.assert_allclose(z.mean(0), means[c].numpy(), atol=0.05)
        np.testing.assert_allclose(np.cov(z.T), covariances[c].numpy(), atol=0.1 * float(covariances[c].abs().max()))
    assert torch.allclose(virtual[1, :, 3], torch.tensor(2.0), atol=1e-5)
    again = sample_virtual_features(means, covariances, 40_000, torch.Generator().manual_seed(2))
    assert torch.equal(virtual, again)  # seeded


# --- a round: the client's upload and the server's calibration --------------------------------------

def test_client_uploads_the_moments_of_the_downloaded_body_then_trains_that_model():
    algorithm = tiny_algorithm(np.array([[3, 3, 0, 4]]))
    params = algorithm.setup.ops.initial_params()
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(10, 3, generator=g), torch.tensor([0, 0, 1, 1, 1, 3, 3, 3, 3, 0])
    update = algorithm.client_update(1, 0, None, {"params": params}, ClientData(0, x, y, x[:2], y[:2], np.array([3, 3, 0, 4])))
    request = next(update)
    assert request.params is params  # trains the FedAvg model, never a calibrated one
    trained = {name: value + 1.0 for name, value in params.items()}
    with pytest.raises(StopIteration) as stop:
        update.send(trained)
    _, reply = stop.value.value
    assert reply["params"] is trained and reply["weight"] == 10
    hidden = torch.relu(x @ params["body.fc1.weight"].T + params["body.fc1.bias"])  # the downloaded body
    expected = class_statistics(hidden, y)
    assert all(torch.allclose(reply["statistics"][key].float(), expected[key].float()) for key in expected)
    # bytes up: the model, n_i, and per owned class d + d^2 floats, its class and count
    assert message_bytes(reply) == 4 * num_parameters(params) + 8 + 3 * (4 * (5 + 25) + 16)


def test_server_calibrates_the_downloaded_models_classifier_on_virtual_features():
    counts = np.array([[3, 3, 0, 0], [2, 0, 4, 0]])
    algorithm = tiny_algorithm(counts, virtual_per_class=30, calibration_epochs=3, calibration_lr=0.5)
    server = algorithm.init_server(algorithm.setup.ops.initial_params())
    g = torch.Generator().manual_seed(4)
    replies, features = {}, {}
    for cid in (0, 1):
        y = torch.repeat_interleave(torch.arange(4), torch.as_tensor(counts[cid]))
        features[cid] = torch.rand(len(y), 5, generator=g) + y[:, None]
        trained = {name: value + cid + 1 for name, value in server["params"].items()}
        replies[cid] = {"params": trained, "weight": len(y), "statistics": class_statistics(features[cid], y)}
    new = algorithm.aggregate(2, server, replies)
    for name, value in new["params"].items():  # training goes on from FedAvg's mean
        torch.testing.assert_close(value, (6 * replies[0]["params"][name] + 6 * replies[1]["params"][name]) / 12)
    calibrated = new["calibrated"]
    assert all(torch.equal(calibrated[name], value) for name, value in select(server["params"], "body").items())
    # the head by hand: eqs. (3)-(5) for classes 0-2, then SGD from the downloaded rows of those classes
    _, means, covariances = pooled_statistics([replies[0]["statistics"], replies[1]["statistics"]], 4)
    generator = torch_generator(5, 2, SERVER, "ccvr-virtual")
    virtual = sample_virtual_features(means[:3], covariances[:3], 30, generator).reshape(90, 5)
    head = select(server["params"], "head")
    weight, bias = retrain_classifier(virtual, torch.arange(3).repeat_interleave(30), head["head.fc.weight"][:3],
                                      head["head.fc.bias"][:3], epochs=3, lr=0.5, batch_size=32, generator=generator)
    assert torch.equal(calibrated["head.fc.weight"][:3], weight) and torch.equal(calibrated["head.fc.bias"][:3], bias)
    assert not torch.equal(weight, head["head.fc.weight"][:3])
    # class 3 has no statistics: its row stays the downloaded one
    assert torch.equal(calibrated["head.fc.weight"][3], head["head.fc.weight"][3])
    assert torch.equal(calibrated["head.fc.bias"][3], head["head.fc.bias"][3])
    assert algorithm.client_model(0, new, None) is calibrated


# --- runs ---------------------------------------------------------------------------------------

def test_without_calibration_it_is_fedavg(small_config):
    ccvr = pfedkit.run({**small_config, "algorithm": "ccvr", "ccvr": {"calibration": "off"}})
    fedavg = pfedkit.run(small_config)
    columns = [c for c in fedavg.metrics.columns if c != "seconds"]
    pd.testing.assert_frame_equal(ccvr.metrics[columns], fedavg.metrics[columns])


def test_training_is_fedavgs_and_the_calibrated_model_is_evaluated(small_config):
    ccvr = pfedkit.run({**small_config, "algorithm": "ccvr", "join_ratio": 0.75, "ccvr": QUICK})
    fedavg = pfedkit.run({**small_config, "join_ratio": 0.75})
    pd.testing.assert_series_equal(ccvr.metrics["train_loss"], fedavg.metrics["train_loss"])
    ours, theirs = final_state(ccvr).server, final_state(fedavg).server
    assert all(torch.equal(ours["params"][k], v) for k, v in theirs["params"].items())
    assert (ccvr.metrics.loc[ccvr.metrics["round"] >= 1, "loss"] != fedavg.metrics.loc[fedavg.metrics["round"] >= 1, "loss"]).all()
    # bytes: FedAvg's down; up, for each participant, its owned classes' moments on top
    params = theirs["params"]
    dim = params["head.fc.weight"].shape[1]
    owned = {cid: int((row > 0).sum()) for cid, row in enumerate(prepared_counts(small_config))}
    joined = ccvr.metrics[(ccvr.metrics["round"] >= 1) & (ccvr.metrics["participated"] == 1)]
    assert (joined["bytes_down"] == 4 * num_parameters(params)).all()
    expected = [4 * num_parameters(params) + 8 + owned[c] * (4 * (dim + dim * dim) + 16) for c in joined["client"]]
    assert joined["bytes_up"].tolist() == expected
    diagnostics = read_diagnostics(ccvr.run_dir / "diagnostics.pt")
    assert all(diagnostics["virtual_loss_after"][r] < diagnostics["virtual_loss_before"][r] for r in (1, 2, 3))


def test_last_round_calibration_is_fedavg_until_the_last_round(small_config):
    ccvr = pfedkit.run({**small_config, "algorithm": "ccvr", "ccvr": {**QUICK, "calibration": "last_round"}})
    fedavg = pfedkit.run(small_config)
    before = ccvr.metrics["round"] < 3
    columns = [c for c in fedavg.metrics.columns if c != "seconds"]
    pd.testing.assert_frame_equal(ccvr.metrics.loc[before, columns], fedavg.metrics.loc[before, columns])
    last = ~before & (ccvr.metrics["round"] == 3)
    assert (ccvr.metrics.loc[last, "bytes_up"] > fedavg.metrics.loc[last, "bytes_up"]).all()
    assert (ccvr.metrics.loc[last, "loss"] != fedavg.metrics.loc[last, "loss"]).all()
    assert sorted(read_diagnostics(ccvr.run_dir / "diagnostics.pt")["calibrated_classes"]) == [3]


def prepared_counts(config: dict) -> np.ndarray:
    from pfedkit.config import load_config
    from pfedkit.runs import prepare

    prepared = prepare(load_config({**config, "algorithm": "ccvr"}))
    prepared.runtime.close()
    return np.asarray(prepared.data.train_counts())
