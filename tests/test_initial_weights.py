"""Config `init_weights`: a run that starts from a file's weights (pfedkit/models/initial_weights.py)."""
from __future__ import annotations

import pickle

import pandas as pd
import pytest
import torch

import pfedkit
from pfedkit.config import load_config
from pfedkit.core.errors import ConfigError
from pfedkit.models.initial_weights import unprefixed_name
from pfedkit.runs import prepare

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def config(tmp_path, **extra) -> dict:
    return {"dataset": "digits", "num_clients": 4, "rounds": 2, "seed": 3, "threads": 1, "out_dir": str(tmp_path),
            **extra}


def initial_params(settings: dict) -> dict[str, torch.Tensor]:
    prepared = prepare(load_config(settings))
    prepared.runtime.close()
    return prepared.simulation.algorithm.setup.ops.initial_params()


def test_a_file_of_the_seeded_weights_gives_the_seeded_run_exactly(tmp_path):
    """Invariant: starting from the very weights the seed draws changes nothing."""
    seeded = initial_params(config(tmp_path / "a"))
    path = tmp_path / "seeded.pt"
    torch.save(seeded, path)
    plain = pfedkit.run(config(tmp_path / "b", name="plain"))
    loaded = pfedkit.run(config(tmp_path / "b", name="loaded", init_weights=str(path)))
    pd.testing.assert_frame_equal(plain.metrics, loaded.metrics)


@pytest.mark.parametrize("names", ["full", "unprefixed"])
def test_the_run_starts_from_the_files_weights(names, tmp_path):
    other = initial_params(config(tmp_path / "a", seed=11))
    own = initial_params(config(tmp_path / "a"))
    assert not torch.equal(other["head.fc.weight"], own["head.fc.weight"])
    weights = other if names == "full" else {unprefixed_name(n): t for n, t in other.items()}
    torch.save(weights, tmp_path / "w.pt")
    started = initial_params(config(tmp_path / "b", init_weights=str(tmp_path / "w.pt")))
    assert started.keys() == other.keys() and all(torch.equal(started[n], other[n]) for n in other)


def test_unprefixed_names_follow_the_layers_into_the_head_of_another_split(tmp_path):
    """conv/fc names without body./head. load whether fc1 is in the body (last) or the head (fc)."""
    cnn = dict(dataset="mnist", data_dir="../shared/datasets", model="cnn", algorithm="fedper")
    base = initial_params(config(tmp_path / "a", **cnn, seed=5))
    torch.save({unprefixed_name(n): t for n, t in base.items()}, tmp_path / "w.pt")
    split = initial_params(config(tmp_path / "b", **cnn, head_split="fc", init_weights=str(tmp_path / "w.pt")))
    assert "body.fc1.weight" in base and "head.fc1.weight" in split
    assert torch.equal(split["head.fc1.weight"], base["body.fc1.weight"])


def broken(weights: dict) -> dict:
    weights = dict(weights)
    weights.pop("head.fc.bias")
    weights["head.fc.weight"] = weights["head.fc.weight"][:, :3]
    weights["body.extra.weight"] = torch.zeros(2)
    return weights


@pytest.mark.parametrize("content, message", [
    (None, "no such file"),
    ("not tensors", "expected a non-empty dict of name -> tensor"),
    ("code", "weights_only"),
    ("broken", "not in the model: body.extra.weight; missing: head.fc.bias; of another shape: head.fc.weight"),
])
@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_files_that_do_not_fit_are_refused_in_one_line(content, message, tmp_path):
    path = tmp_path / "w.pt"
    if content == "not tensors":
        torch.save({"head.fc.weight": [1.0, 2.0]}, path)
    elif content == "code":
        path.write_bytes(pickle.dumps(pd.Timestamp("2026-01-01")))  # unpickling would run pandas' code
    elif content == "broken":
        torch.save(broken(initial_params(config(tmp_path / "a"))), path)
    with pytest.raises(ConfigError, match=f"^init_weights=.*{message}"):
        prepare(load_config(config(tmp_path / "b", init_weights=str(path))))


def test_one_file_for_several_architectures_is_refused(tmp_path):
    torch.save(initial_params(config(tmp_path / "a")), tmp_path / "w.pt")
    with pytest.raises(ConfigError, match="client_model_options"):
        prepare(load_config(config(tmp_path / "b", algorithm="local", init_weights=str(tmp_path / "w.pt"),
                                   client_model_options={"0-1": {"hidden": 32}})))
