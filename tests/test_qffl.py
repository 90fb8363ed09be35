"""q-FFL (q-FedAvg): the server step by hand with two clients, q = 0 is the uniform mean of the
local models (not the n_i-weighted one), a larger q leans towards the high-loss client, the client
reports its loss at the received model on its whole training set, and a run with equal n_i and
q = 0 matches FedAvg."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import pfedkit
from pfedkit.algorithms.qffl import QFFL
from pfedkit.config import load_config
from pfedkit.core.contract import Setup, message_bytes
from pfedkit.core.params import weighted_mean
from pfedkit.run_files import read_diagnostics
from pfedkit.runs import prepare
from tests.conftest import num_parameters

CONFIG = {"dataset": "digits", "num_clients": 4, "rounds": 3, "threads": 1, "batch_size": 20, "lr": 0.05,
          "seed": 3, "partition": {"scheme": "dirichlet", "alpha": 0.5}}
# 60 training samples per client: FedAvg's n_i-weighted mean is the uniform one
EQUAL_CLIENTS = {**CONFIG, "partition": {"scheme": "iid", "samples_per_client": 80, "stratified": False}}


def server_step(q: float, lipschitz: float, received: dict, uploads: dict[int, tuple[dict, float]]) -> dict:
    """QFFL.aggregate on {cid: (trained params, F_k)}, the server holding `received`."""
    algo = QFFL(QFFL.Hyper(q=q, lipschitz=lipschitz), Setup(3, 2, np.ones((3, 2)), seed=0, local_epochs=1, ops=None))
    replies = {cid: {"params": params, "loss": loss} for cid, (params, loss) in uploads.items()}
    return algo.aggregate(1, {"params": received}, replies)["params"]


def test_the_server_step_matches_a_hand_computation_with_two_clients():
    # w = (1, 2); w_1 = (0, 2), F_1 = 1; w_2 = (1, 0), F_2 = 4; q = 1, L = 2:
    # Delta w_1 = 2 (1, 0) = (2, 0), Delta_1 = 1 (2, 0);  h_1 = 1 * 1^0 * 4 + 2 * 1 = 6
    # Delta w_2 = 2 (0, 2) = (0, 4), Delta_2 = 4 (0, 4) = (0, 16);  h_2 = 1 * 4^0 * 16 + 2 * 4 = 24
    # w' = (1, 2) - (2, 16) / 30 = (14/15, 22/15)
    new = server_step(1.0, 2.0, {"w": torch.tensor([1.0, 2.0])},
                      {0: ({"w": torch.tensor([0.0, 2.0])}, 1.0), 2: ({"w": torch.tensor([1.0, 0.0])}, 4.0)})
    torch.testing.assert_close(new["w"], torch.tensor([14 / 15, 22 / 15]))
    # q = 2: Delta_1 = (2, 0), h_1 = 2 * 1 * 4 + 2 = 10; Delta_2 = 16 (0, 4), h_2 = 2 * 4 * 16 + 2 * 16 = 160
    new = server_step(2.0, 2.0, {"w": torch.tensor([1.0, 2.0])},
                      {0: ({"w": torch.tensor([0.0, 2.0])}, 1.0), 2: ({"w": torch.tensor([1.0, 0.0])}, 4.0)})
    torch.testing.assert_close(new["w"], torch.tensor([1 - 2 / 170, 2 - 64 / 170]))


def test_q_zero_is_the_uniform_mean_of_the_local_models_whatever_the_losses():
    generator = torch.Generator().manual_seed(0)
    received = {"a": torch.randn(3, 2, generator=generator), "b": torch.randn(4, generator=generator)}
    models = [{name: value + torch.randn(value.shape, generator=generator) for name, value in received.items()}
              for _ in range(3)]
    new = server_step(0.0, 7.0, received, {cid: (models[cid], loss) for cid, loss in zip(range(3), (0.1, 2.0, 9.0))})
    uniform = weighted_mean(models, [1.0, 1.0, 1.0])
    for name in received:
        torch.testing.assert_close(new[name], uniform[name])


def test_a_larger_q_moves_the_model_further_towards_the_high_loss_client():
    received = {"w": torch.zeros(2)}
    uploads = {0: ({"w": torch.tensor([1.0, 0.0])}, 0.5), 1: ({"w": torch.tensor([0.0, 1.0])}, 2.0)}
    shares = []
    for q in (0.0, 0.5, 1.0, 3.0):
        new = server_step(q, 1.0, received, uploads)["w"]
        shares.append(float(new[1] / new.sum()))  # the high-loss client's share of the step
    assert shares[0] == pytest.approx(0.5) and all(a < b for a, b in zip(shares, shares[1:]))


def test_the_client_reports_its_loss_at_the_received_model_on_its_whole_training_set(tmp_path):
    prepared = prepare(load_config({"algorithm": "qffl", "dataset": "digits", "num_clients": 3, "rounds": 1,
                                    "threads": 1, "seed": 3, "out_dir": str(tmp_path)}))
    algo, data = prepared.simulation.algorithm, prepared.data.clients[1]
    received = {name: value - 0.02 for name, value in algo.setup.ops.initial_params().items()}
    update = algo.client_update(1, 1, None, {"params": received}, data)
    fit = next(update)
    assert fit.params is received and fit.step is None and not fit.context  # plain local SGD on CE
    trained = {name: value + 1.0 for name, value in received.items()}
    with pytest.raises(StopIteration) as stop:
        update.send(trained)
    _, reply = stop.value.value
    expected = F.cross_entropy(algo.setup.ops.logits(received, data.x_train).double(), data.y_train)
    assert reply["params"] is trained and reply["loss"] == pytest.approx(float(expected), rel=1e-9)
    assert message_bytes(reply) == 4 * num_parameters(received) + 8  # the model and F_k


def test_q_zero_with_equal_clients_matches_fedavg_and_the_default_learns(tmp_path):
    fedavg = pfedkit.run({**EQUAL_CLIENTS, "algorithm": "fedavg", "out_dir": str(tmp_path / "fedavg")})
    uniform = pfedkit.run({**EQUAL_CLIENTS, "algorithm": "qffl", "qffl": {"q": 0.0}, "out_dir": str(tmp_path / "q0")})
    for column in ("accuracy", "loss"):
        np.testing.assert_allclose(uniform.metrics[column], fedavg.metrics[column], rtol=0, atol=1e-5)
    qffl = pfedkit.run({**CONFIG, "algorithm": "qffl", "out_dir": str(tmp_path / "qffl")})
    assert qffl.metrics[qffl.metrics["round"] == CONFIG["rounds"]]["accuracy"].mean() > 0.3
    losses = read_diagnostics(qffl.run_dir / "diagnostics.pt")["qffl_loss"]  # F_k of every participant, per round
    assert set(losses) == {1, 2, 3} and all(set(round_losses) == {0, 1, 2, 3} for round_losses in losses.values())
    assert np.mean(list(losses[3].values())) < np.mean(list(losses[1].values()))
