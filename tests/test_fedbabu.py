"""FedBABU: the head never trains during federated training; evaluation fine-tunes a copy."""
from __future__ import annotations

import pandas as pd
import torch
from conftest import final_state

import pfedkit
from pfedkit.config import load_config
from pfedkit.core.params import select
from pfedkit.runs import prepare


def test_head_is_unchanged_during_federated_training(small_config):
    config = {**small_config, "algorithm": "fedbabu"}
    state = final_state(pfedkit.run(config))
    init = prepare(load_config(config)).simulation.algorithm.setup.ops.initial_params()
    for client in state.clients:
        assert all(torch.equal(client["head"][k], init[k]) for k in select(init, "head"))
    assert any(not torch.equal(state.server["body"][k], init[k]) for k in select(init, "body"))


def test_fine_tuning_is_evaluated_but_never_written_back(small_config):
    """Training is identical whether or not (and how) clients fine-tune before evaluation; the
    evaluated accuracy is not (the fine-tuned copy is what is measured)."""
    config = {**small_config, "algorithm": "fedbabu", "momentum": 0.5, "keep_optimizer_state": True}
    tuned = pfedkit.run(config)
    plain = pfedkit.run({**config, "fedbabu": {"finetune_epochs": 0}})
    head_only = pfedkit.run({**config, "fedbabu": {"finetune_steps": 3, "finetune_part": "head"}})
    states = [final_state(r) for r in (tuned, plain, head_only)]
    for other in states[1:]:
        assert all(torch.equal(states[0].server["body"][k], other.server["body"][k]) for k in other.server["body"])
        assert all(torch.equal(a["head"][k], b["head"][k]) for a, b in zip(states[0].clients, other.clients) for k in a["head"])
        assert states[0].optimizer_states[0].keys() == other.optimizer_states[0].keys()
    pd.testing.assert_series_equal(tuned.metrics["train_loss"], plain.metrics["train_loss"])
    assert (tuned.metrics["accuracy"] != plain.metrics["accuracy"]).any()
    assert (head_only.metrics["accuracy"] != plain.metrics["accuracy"]).any()
    assert tuned.summary["final_acc"] > plain.summary["final_acc"]  # the fixed random head is poor alone


def test_uploads_and_downloads_are_the_body_only(small_config):
    result = pfedkit.run({**small_config, "algorithm": "fedbabu", "rounds": 1})
    body = final_state(result).server["body"]
    body_bytes = sum(t.numel() * t.element_size() for t in body.values())
    rows = result.metrics[result.metrics["round"] == 1]
    assert (rows["bytes_up"] == body_bytes + 8).all()  # + the sample count n_i
    assert (rows["bytes_down"] == body_bytes).all()


def test_the_local_fit_of_a_round_trains_the_body_only(small_config):
    """What each round asks of the trainer: the downloaded body under the client's fixed head,
    the body trainable and the head frozen (a head trained here and then dropped would still leave
    the head unchanged, but would train the body against a moving head)."""
    prepared = prepare(load_config({**small_config, "algorithm": "fedbabu"}))
    prepared.runtime.close()
    algorithm, init = prepared.simulation.algorithm, prepared.state
    server, client = init.server, init.clients[0]
    message = algorithm.broadcast(1, server, [0])[0]
    update = algorithm.client_update(1, 0, client, message, prepared.data.clients[0])
    fit = next(update)
    assert fit.trainable == "body"
    for name, value in fit.params.items():
        expected = server["body"][name] if name.startswith("body.") else client["head"][name]
        assert torch.equal(value, expected), name
