"""FedAvg-FT: FedAvg's training untouched; each client's evaluation fine-tunes a thrown-away copy."""
from __future__ import annotations

import numpy as np
import pandas as pd
import torch
from conftest import final_state

import pfedkit
from pfedkit.algorithms.fedavgft import FedAvgFT
from pfedkit.core.contract import Setup

EVALUATION = ["accuracy", "loss", "balanced_acc", "correct"]


def without_seconds(metrics: pd.DataFrame) -> pd.DataFrame:
    return metrics.drop(columns=["seconds"], errors="ignore")


def request(**options):
    algorithm = FedAvgFT(FedAvgFT.Hyper(**options), Setup(2, 3, np.ones((2, 3)), seed=0, local_epochs=1, ops=None))
    return algorithm.adapt(0, {}, None, {"head.w": torch.zeros(1)})


def test_fine_tuning_never_changes_training(small_config):
    """Server state, optimizer states, training losses and bytes are FedAvg's, bit for bit."""
    config = {**small_config, "momentum": 0.5, "keep_optimizer_state": True}
    fedavg = pfedkit.run(config)
    tuned = pfedkit.run({**config, "algorithm": "fedavgft", "fedavgft": {"finetune_epochs": 2}})
    reference, state = final_state(fedavg), final_state(tuned)
    assert reference.server.keys() == state.server.keys()
    assert all(torch.equal(reference.server["params"][k], v) for k, v in state.server["params"].items())
    for ours, theirs in zip(state.optimizer_states, reference.optimizer_states):
        assert ours.keys() == theirs.keys()
        assert all(torch.equal(ours[slot][k], theirs[slot][k]) for slot in ours for k in ours[slot])
    columns = ["round", "client", "participated", "train_loss", "train_steps", "bytes_up", "bytes_down"]
    pd.testing.assert_frame_equal(tuned.metrics[columns], fedavg.metrics[columns])


def test_without_fine_tuning_it_is_fedavg(small_config):
    fedavg = without_seconds(pfedkit.run(small_config).metrics)
    for options in ({"finetune_epochs": 0}, {"finetune_steps": 0}):
        plain = pfedkit.run({**small_config, "algorithm": "fedavgft", "fedavgft": options})
        pd.testing.assert_frame_equal(without_seconds(plain.metrics), fedavg)


def test_the_fine_tuned_model_is_what_is_evaluated(small_config):
    """Every client's accuracy moves, and on label-skewed clients towards its own classes: up."""
    fedavg = pfedkit.run(small_config).metrics
    tuned = pfedkit.run({**small_config, "algorithm": "fedavgft", "fedavgft": {"finetune_epochs": 1}}).metrics
    assert (tuned["loss"] != fedavg["loss"]).all()
    last = tuned["round"] == tuned["round"].max()
    assert tuned.loc[last, "accuracy"].mean() > fedavg.loc[last, "accuracy"].mean()


def test_the_adaptation_request_follows_the_options():
    default = request()
    assert (default.steps, default.epochs, default.lr, default.trainable) == (5, None, 0.01, "all")
    by_epochs = request(finetune_epochs=3, finetune_steps=7, finetune_lr=None, finetune_part="head")
    assert (by_epochs.steps, by_epochs.epochs, by_epochs.lr, by_epochs.trainable) == (None, 3, None, "head")
    assert request(finetune_epochs=0) is None and request(finetune_steps=0) is None
    assert request(finetune_steps=0, finetune_epochs=1).epochs == 1  # epochs, when set, replace steps
