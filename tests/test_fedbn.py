"""FedBN: the BatchNorm layers (weights, biases and statistics) stay on each client, never averaged
nor sent; every other parameter is FedAvg's n_i-weighted mean; a model without BatchNorm is FedAvg."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import final_state, interrupt_and_resume, num_parameters
from torch import nn

import pfedkit
from pfedkit.algorithms.fedbn import FedBN, batchnorm_parameter_names
from pfedkit.core.contract import ClientData, Setup
from pfedkit.core.errors import ConfigWarning
from pfedkit.core.model_ops import ModelOps
from pfedkit.models import MODELS, ModelInfo
from pfedkit.models.base import BodyHeadModel, head_start

BATCHNORM = {"body.bn1.weight", "body.bn1.bias", "body.bn2.weight", "body.bn2.bias"}


class DigitsBatchNormMLP(BodyHeadModel):
    """The digits features through two hidden layers, each followed by BatchNorm."""
    HEAD_SPLITS = {"last": "fc"}

    def __init__(self, input_shape, num_classes: int, head: str = "last"):
        layers = [("fc1", nn.Linear(64, 32)), ("bn1", nn.BatchNorm1d(32)), ("relu1", nn.ReLU()),
                  ("fc2", nn.Linear(32, 16)), ("bn2", nn.BatchNorm1d(16)), ("relu2", nn.ReLU()),
                  ("fc", nn.Linear(16, num_classes))]
        super().__init__(layers, head_start(head, self.HEAD_SPLITS, "digits_bn"))


@pytest.fixture
def bn_config(small_config, monkeypatch):
    """FedBN on digits with a BatchNorm model (registered for this test; forked workers inherit it)."""
    monkeypatch.setitem(MODELS, "digits_bn", ModelInfo("digits_bn", DigitsBatchNormMLP, "test model"))
    return {**small_config, "algorithm": "fedbn", "model": "digits_bn"}


def equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_batchnorm_layers_are_found_by_type_wherever_they_are():
    assert batchnorm_parameter_names(DigitsBatchNormMLP((64,), 10)) == BATCHNORM
    resnet = MODELS["resnet18"].builder((3, 32, 32), 10)
    names = batchnorm_parameter_names(resnet)
    assert "body.layer2.0.shortcut.1.weight" in names  # a BatchNorm named without "bn"
    assert len(names) == 2 * sum(isinstance(m, nn.BatchNorm2d) for m in resnet.modules())
    assert batchnorm_parameter_names(MODELS["cnn"].builder((1, 28, 28), 10)) == frozenset()


def test_a_round_keeps_each_clients_batchnorm_and_averages_the_rest_by_n_i():
    sizes = [5, 10, 25]
    counts = np.array([[size, 0, 0] for size in sizes])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        ops = ModelOps(lambda: DigitsBatchNormMLP((64,), 3))
    algorithm = FedBN(FedBN.Hyper(), Setup(3, 3, counts, seed=0, local_epochs=1, ops=ops))
    initial = ops.initial_params()
    server = algorithm.init_server(initial)
    assert set(server["params"]) == set(initial) - BATCHNORM
    messages = algorithm.broadcast(1, server, [0, 1, 2])
    aggregation, states, trained = algorithm.start_aggregation(1, server, [0, 1, 2]), {}, {}
    for cid, size in enumerate(sizes):
        client = algorithm.init_client(cid, initial)
        x, y = torch.zeros(size, 64), torch.zeros(size, dtype=torch.long)
        update = algorithm.client_update(1, cid, client, messages[cid], ClientData(cid, x, y, x, y, counts[cid]))
        request = next(update)
        assert equal(request.params, initial)  # the downloaded rest + its own (initial) BatchNorm layers
        trained[cid] = {name: value + (cid + 1) * torch.randn_like(value) for name, value in initial.items()}
        with pytest.raises(StopIteration) as stop:
            update.send(trained[cid])
        states[cid], reply = stop.value.value
        assert set(reply["params"]) == set(initial) - BATCHNORM and reply["weight"] == size
        assert equal(states[cid]["batchnorm"], {name: trained[cid][name] for name in BATCHNORM})
        aggregation.add(cid, reply)
    new = aggregation.finish()
    assert set(new["params"]) == set(initial) - BATCHNORM
    for name, value in new["params"].items():
        by_hand = sum(size * trained[cid][name].double().numpy() for cid, size in enumerate(sizes)) / sum(sizes)
        np.testing.assert_allclose(value.numpy(), by_hand, rtol=1e-5, atol=1e-6)
    assert not torch.equal(states[0]["batchnorm"]["body.bn1.weight"], states[1]["batchnorm"]["body.bn1.weight"])
    model = algorithm.client_model(2, new, states[2])
    assert equal(model, {**new["params"], **states[2]["batchnorm"]})
    x, y = torch.zeros(25, 64), torch.zeros(25, dtype=torch.long)  # round 2 trains from its own BatchNorm layers
    message = algorithm.broadcast(2, new, [2])[2]
    assert equal(next(algorithm.client_update(2, 2, states[2], message, ClientData(2, x, y, x, y, counts[2]))).params,
                 model)


def test_batchnorm_never_travels_and_stays_apart_between_clients(bn_config):
    result = pfedkit.run({**bn_config, "rounds": 2})
    fedavg = pfedkit.run({**bn_config, "algorithm": "fedavg", "rounds": 2})
    state = final_state(result)
    rest = 4 * num_parameters(state.server["params"])
    batchnorm = 4 * num_parameters(state.clients[0]["batchnorm"])
    trained = result.metrics[result.metrics["round"] >= 1]
    assert (trained["bytes_down"] == rest).all() and (trained["bytes_up"] == rest + 8).all()
    assert (fedavg.metrics["bytes_down"] - result.metrics["bytes_down"] == batchnorm * (fedavg.metrics["round"] >= 1)).all()
    assert not set(state.server["params"]) & BATCHNORM
    first, second = state.clients[0]["batchnorm"], state.clients[1]["batchnorm"]
    assert all(not torch.equal(first[name], second[name]) for name in BATCHNORM)
    assert not torch.equal(state.buffers[0]["body.bn1.running_mean"], state.buffers[1]["body.bn1.running_mean"])


def test_the_non_batchnorm_part_of_a_first_round_is_fedavgs(bn_config):
    """Same start, same local training: after one round the averaged part equals FedAvg's bit for bit
    (FedAvg then also averages the BatchNorm layers, which FedBN does not)."""
    fedbn = final_state(pfedkit.run({**bn_config, "rounds": 1}))
    fedavg = final_state(pfedkit.run({**bn_config, "algorithm": "fedavg", "rounds": 1}))
    assert equal(fedbn.server["params"], {k: v for k, v in fedavg.server["params"].items() if k not in BATCHNORM})


def test_without_batchnorm_it_is_fedavg_and_says_so(small_config):
    with pytest.warns(ConfigWarning, match="no BatchNorm layer, so FedBN runs as FedAvg"):
        fedbn = pfedkit.run({**small_config, "algorithm": "fedbn"})
    fedavg = pfedkit.run(small_config)
    columns = [c for c in fedavg.metrics.columns if c != "seconds"]
    pd.testing.assert_frame_equal(fedbn.metrics[columns], fedavg.metrics[columns])


def test_processes_and_resume_give_the_sequential_numbers_with_batchnorm(bn_config, tmp_path, monkeypatch):
    """The generic backend and resume tests run on the digits mlp, which has no BatchNorm."""
    config = {**bn_config, "join_ratio": 0.75}
    sequential = pfedkit.run({**config, "out_dir": str(tmp_path / "s")})
    processes = pfedkit.run({**config, "backend": "processes", "workers": 2, "out_dir": str(tmp_path / "p")})
    columns = [c for c in sequential.metrics.columns if c != "seconds"]
    pd.testing.assert_frame_equal(sequential.metrics[columns], processes.metrics[columns])
    assert sequential.metrics.loc[sequential.metrics["round"] == 3, "accuracy"].mean() > 0.3
    reference, run_dir, done, resumed = interrupt_and_resume(config, tmp_path, monkeypatch, after_round=2)
    assert done == 2
    assert (run_dir / "metrics.csv").read_bytes() == (reference.run_dir / "metrics.csv").read_bytes()
    ours, theirs = final_state(resumed), final_state(reference)
    assert all(equal(a["batchnorm"], b["batchnorm"]) and equal(c, d) for a, b, c, d
               in zip(ours.clients, theirs.clients, ours.buffers, theirs.buffers))
