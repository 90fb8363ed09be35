"""Every registered algorithm on every registered model: one short round on real data, with the
evaluated models complete, losses finite and bytes counted from the messages. Slow: `-m slow`."""
from __future__ import annotations

import math

import pytest
from conftest import SHARED_DATASETS, needs_dataset

import pfedkit
from pfedkit.algorithms import algorithm_names
from pfedkit.core.errors import ConfigError
from pfedkit.models import MODELS

DATASET_OF = {"mlp": "mnist", "cnn": "mnist", "cnn_proto": "mnist"}  # the rest: CIFAR-10 models
# ResNet-18 (the BatchNorm model) with the ImageNet stem: 8x8 maps after the stem, 16x cheaper
MODEL_OPTIONS = {"resnet18": {"stem": "imagenet"}}


def config_for(algorithm: str, model: str, tmp_path) -> dict:
    dataset = DATASET_OF.get(model, "cifar10")
    return {"algorithm": algorithm, "dataset": dataset, "model": model, "data_dir": str(SHARED_DATASETS),
            "model_options": MODEL_OPTIONS.get(model, {}),
            "num_clients": 4, "rounds": 2, "batch_size": 16, "lr": 0.01, "seed": 1, "threads": 2,
            "partition": {"scheme": "dirichlet", "alpha": 0.3, "pool_fraction": 0.01},
            "out_dir": str(tmp_path), "join_ratio": 0.75}


@pytest.mark.slow
@needs_dataset("mnist")
@needs_dataset("cifar10")
@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("algorithm", algorithm_names())
def test_algorithm_runs_on_model(algorithm, model, tmp_path):
    try:
        result = pfedkit.run(config_for(algorithm, model, tmp_path))
    except ConfigError as err:  # a documented refusal (Algorithm.check): one line
        assert "\n" not in str(err)
        pytest.skip(f"{algorithm} refuses {model}: {err}")
    metrics = result.metrics[result.metrics["round"] >= 1]
    assert metrics["accuracy"].between(0, 1).all()
    trained = metrics[metrics["train_steps"] > 0]
    assert trained["train_loss"].map(math.isfinite).all()
    # bytes are counted from the messages of the round's participants (some methods send nothing
    # in a short run: Local never, L2GD only on its random aggregation rounds)
    traffic = metrics[["bytes_up", "bytes_down"]]
    assert (traffic >= 0).all().all() and (traffic[metrics["participated"] == 0] == 0).all().all()
