"""A client's own BatchNorm statistics (ClientData.buffers) reach the feature math of FedReMa
(prototype uploads) and pFedPM (local class features): features are computed with the client's
running statistics, not the model template's initial ones (issue 12)."""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from pfedkit.algorithms.fedrema import FedReMa, class_prototypes
from pfedkit.algorithms.pfedpm import PFedPM
from pfedkit.algorithms.prototypes import class_means
from pfedkit.core.contract import ClientData, Setup
from pfedkit.core.model_ops import ModelOps
from pfedkit.models import BodyHeadModel

IN_DIM, FEATURES, NUM_CLASSES, N = 5, 6, 3, 12


class BatchNormNet(BodyHeadModel):
    """fc0 + BatchNorm (body, 5 -> 6) then fc1, fc2 (head): the smallest model with running stats."""
    HEAD_SPLITS = {"fc": "fc1", "last": "fc2"}

    def __init__(self, head: str):
        super().__init__([("fc0", nn.Linear(IN_DIM, FEATURES)), ("bn", nn.BatchNorm1d(FEATURES)),
                          ("fc1", nn.Linear(FEATURES, FEATURES)), ("relu", nn.ReLU()),
                          ("fc2", nn.Linear(FEATURES, NUM_CLASSES))], self.HEAD_SPLITS[head])


def ops_for(head: str) -> ModelOps:
    def build():
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            return BatchNormNet(head)
    return ModelOps(build)


def client_buffers() -> dict[str, torch.Tensor]:
    """Running statistics far from the initial (0 mean, 1 variance) ones."""
    return {"body.bn.running_mean": torch.full((FEATURES,), 3.0), "body.bn.running_var": torch.full((FEATURES,), 0.25),
            "body.bn.num_batches_tracked": torch.tensor(7)}


def client_data() -> ClientData:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(N, IN_DIM, generator=generator)
    y = torch.arange(N) % NUM_CLASSES
    return ClientData(0, x, y, x[:3], y[:3], np.bincount(y.numpy(), minlength=NUM_CLASSES),
                      buffers_source=client_buffers)


def setup(ops: ModelOps) -> Setup:
    return Setup(2, NUM_CLASSES, np.full((2, NUM_CLASSES), N // NUM_CLASSES), seed=0, local_epochs=1, ops=ops)


def test_buffers_property_reads_the_source_each_time():
    calls = []
    data = ClientData(0, torch.zeros(1, 1), torch.zeros(1), torch.zeros(1, 1), torch.zeros(1), np.ones(1),
                      buffers_source=lambda: calls.append(1) or {"x": torch.tensor(len(calls))})
    assert int(data.buffers["x"]) == 1 and int(data.buffers["x"]) == 2
    assert ClientData(0, *([torch.zeros(1)] * 4), np.ones(1)).buffers is None


def test_pfedpm_local_features_use_the_clients_running_statistics():
    ops = ops_for("last")
    algo = PFedPM(PFedPM.Hyper(), setup(ops))
    params, data = ops.initial_params(), client_data()
    features, means, counts = algo.local_features(params, data)
    own = ops.features(params, data.x_train, client_buffers())
    torch.testing.assert_close(features, own)
    torch.testing.assert_close(means, class_means(own, data.y_train, NUM_CLASSES)[0])
    assert not torch.allclose(features, ops.features(params, data.x_train, None))  # template statistics


def test_fedrema_prototypes_use_the_clients_running_statistics():
    ops = ops_for("fc")
    algo = FedReMa(FedReMa.Hyper(variant="F"), setup(ops))
    params, data = ops.initial_params(), client_data()
    upload = algo._prototype_upload(params, data)
    own = ops.features(params, data.x_train, client_buffers()).reshape(N, -1)
    _, expected, _ = class_prototypes(own, data.y_train, NUM_CLASSES)
    torch.testing.assert_close(upload["prototypes"], expected)
    template = ops.features(params, data.x_train, None).reshape(N, -1)
    assert not torch.allclose(upload["prototypes"], class_prototypes(template, data.y_train, NUM_CLASSES)[1])
