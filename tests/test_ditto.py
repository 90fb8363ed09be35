"""Ditto: lam = 0 gives Local training as the personal model; the global model is FedAvg's."""
from __future__ import annotations

import pandas as pd
import pytest
import torch

import pfedkit


def test_personal_model_with_lam_zero_is_local_training(small_config):
    ditto = pfedkit.run({**small_config, "algorithm": "ditto", "ditto": {"lam": 0.0}})
    local = pfedkit.run({**small_config, "algorithm": "local"})
    columns = ["round", "client", "accuracy", "loss"]
    evaluated = ditto.metrics["round"] >= 1
    pd.testing.assert_frame_equal(ditto.metrics.loc[evaluated, columns].reset_index(drop=True),
                                  local.metrics.loc[local.metrics["round"] >= 1, columns].reset_index(drop=True))


def test_personal_fit_is_pulled_to_the_received_global_model_then_the_global_model_trains():
    """Ditto's two requests: the personal model v_i with the proximal anchor = the RECEIVED w^t
    (not v_i's own start), then w^t itself; the upload is the second result, the state the first."""
    from pfedkit.core.contract import ClientData
    from pfedkit.algorithms.ditto import Ditto

    algo = Ditto(Ditto.Hyper(lam=0.7, personal_epochs=2), None)
    received, personal = {"w": torch.tensor([1.0])}, {"w": torch.tensor([5.0])}
    data = ClientData(0, torch.zeros(6, 1), torch.zeros(6), torch.zeros(1, 1), torch.zeros(1), None)
    update = algo.client_update(1, 0, {"personal": personal}, {"params": received}, data)
    first = next(update)
    assert first.params is personal and first.context["anchor"] is received
    assert first.loss.keywords == {"mu": 0.7} and first.epochs == 2 and first.optimizer == "personal"
    second = update.send({"w": torch.tensor([4.0])})
    assert second.params is received and second.optimizer == "global" and second.epochs is None
    with pytest.raises(StopIteration) as stop:
        update.send({"w": torch.tensor([2.0])})
    state, reply = stop.value.value
    assert state["personal"]["w"].item() == 4.0 and reply["params"]["w"].item() == 2.0 and reply["weight"] == 6
