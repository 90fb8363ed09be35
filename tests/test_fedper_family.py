"""FedPer, LG-FedAvg and FedRep: which part is shared, which stays private, and FedRep's two phases."""
from __future__ import annotations

import numpy as np
import torch
from conftest import SHARED_DATASETS, final_state, needs_dataset

import pfedkit
from pfedkit.config import load_config
from pfedkit.core.params import select
from pfedkit.runs import prepare


def initial_params(config):
    return prepare(load_config(config)).simulation.algorithm.setup.ops.initial_params()


def equal(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_fedper_private_head_changes_only_when_the_client_trains(small_config, tmp_path):
    config = {**small_config, "algorithm": "fedper", "join_ratio": 0.5, "rounds": 1}
    state = final_state(pfedkit.run(config))
    head0 = select(initial_params(config), "head")
    participants = {row.client for row in pfedkit.run({**config, "out_dir": str(tmp_path / "b")}).metrics.itertuples()
                    if row.participated}
    for cid, client in enumerate(state.clients):
        assert set(client["private"]) == set(head0)  # only the head is private
        assert equal(client["private"], head0) == (cid not in participants)
    assert set(state.server["shared"]) == set(select(head0 | initial_params(config), "body"))


def test_lg_fedavg_is_fedper_with_the_parts_swapped(small_config):
    config = {**small_config, "algorithm": "lg_fedavg", "join_ratio": 0.5, "rounds": 2}
    result = pfedkit.run(config)
    state = final_state(result)
    init = initial_params(config)
    assert set(state.server["shared"]) == set(select(init, "head"))
    assert all(set(c["private"]) == set(select(init, "body")) for c in state.clients)
    # bytes: only the head goes up and down
    head_bytes = sum(t.numel() * 4 for t in select(init, "head").values())
    joined = result.metrics[(result.metrics["round"] >= 1) & (result.metrics["participated"] == 1)]
    assert (joined["bytes_up"] == head_bytes + 8).all()  # + the sample count n_i
    assert (joined["bytes_down"] == head_bytes).all()
    never = [cid for cid in range(4) if not result.metrics[(result.metrics.client == cid)].participated.any()]
    for cid in never:
        assert equal(state.clients[cid]["private"], select(init, "body"))


def test_fedper_with_one_client_equals_local(small_config):
    config = {**small_config, "num_clients": 1, "partition": {"scheme": "iid"}}
    fedper = pfedkit.run({**config, "algorithm": "fedper"}).metrics
    local = pfedkit.run({**config, "algorithm": "local"}).metrics
    np.testing.assert_array_equal(fedper["accuracy"].to_numpy(), local["accuracy"].to_numpy())


def test_fedrep_without_head_epochs_is_fedavg_on_the_body_with_frozen_heads(small_config):
    fedrep = final_state(pfedkit.run({**small_config, "algorithm": "fedrep", "fedrep": {"head_epochs": 0}}))
    fedbabu = final_state(pfedkit.run({**small_config, "algorithm": "fedbabu", "fedbabu": {"finetune_epochs": 0}}))
    assert equal(fedrep.server["shared"], fedbabu.server["body"])
    head0 = select(initial_params(small_config), "head")
    assert all(equal(client["private"], head0) for client in fedrep.clients)


def test_fedrep_trains_the_head_with_the_body_frozen_then_the_body(small_config):
    """Head epochs move only the head; the uploaded body differs from the received one; with
    head_epochs > 0 the final heads differ from a run without head epochs."""
    config = {**small_config, "algorithm": "fedrep", "rounds": 1, "fedrep": {"head_epochs": 2, "body_epochs": 0}}
    state = final_state(pfedkit.run(config))
    init = initial_params(config)
    for name, value in select(init, "body").items():  # body epochs 0: the body never moved
        torch.testing.assert_close(state.server["shared"][name], value)
    assert all(not equal(client["private"], select(init, "head")) for client in state.clients)


@needs_dataset("mnist")
def test_head_split_fc_keeps_every_fully_connected_layer_private(small_config):
    """head_split=fc: FedPer's private part is all the FC layers (the CNN's fc1 too), the shared
    part the convolutions; the default keeps the last layer only."""
    config = {**small_config, "algorithm": "fedper", "rounds": 1, "dataset": "mnist", "model": "cnn",
              "data_dir": str(SHARED_DATASETS), "partition": {"scheme": "iid", "pool_fraction": 0.005}}
    last, fc = final_state(pfedkit.run(config)), final_state(pfedkit.run({**config, "head_split": "fc"}))

    def size(params: dict) -> int:
        return sum(t.numel() for t in params.values())

    def layers(params: dict) -> set:  # names without the body/head prefix, which the split sets
        return {name.split(".", 1)[1] for name in params}

    assert layers(last.clients[0]["private"]) < layers(fc.clients[0]["private"])
    assert size(fc.clients[0]["private"]) > size(last.clients[0]["private"])
    assert size(fc.clients[0]["private"]) + size(fc.server["shared"]) == \
        size(last.clients[0]["private"]) + size(last.server["shared"])
    assert all(name.startswith("head.fc") for name in fc.clients[0]["private"])


def test_head_split_is_refused_where_the_algorithms_math_reads_one_split(small_config, tmp_path):
    from pfedkit.core.errors import ConfigError

    for config, words in (({**small_config, "algorithm": "pfedcs", "head_split": "fc"}, "applies to fedbabu, fedpac, fedper"),
                          ({**small_config, "algorithm": "fedper", "model_options": {"head": "fc"}}, "head_split"),
                          ({**small_config, "algorithm": "fedpac", "head_split": "fc"}, "body would be empty")):
        try:
            pfedkit.run(config)
        except ConfigError as err:
            assert words in str(err) and "\n" not in str(err)
        else:
            raise AssertionError(f"{config} was not refused")
    # the algorithm's own split named explicitly is no change
    assert pfedkit.run({**small_config, "algorithm": "fedrema", "head_split": "fc", "rounds": 1}).summary["rounds_done"] == 1
