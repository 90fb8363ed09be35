"""The input-level prediction hook (`Algorithm.predict_inputs`): where a method overrides it, every
evaluation (participants, new clients, every backend) predicts with it on the test inputs, with the
client's own state and buffers, instead of the loaded model; the metrics are its numbers by hand."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import pfedkit
from pfedkit.algorithms.fedavg import FedAvg
from pfedkit.algorithms.registry import registry
from pfedkit.config import load_config
from pfedkit.core.contract import Algorithm
from pfedkit.engine.protocols import OnInputs
from pfedkit.engine.runtimes.workers import ModelEvaluator
from pfedkit.runs import prepare

from conftest import TinyNet, tiny_params

SCALE = 3.0
CALLS: list[tuple[int, float, bool]] = []  # (cid, the client's shift, buffers is None)


class InputsProbe(FedAvg):
    """FedAvg whose clients predict SCALE * (the first C pixels) + their own shift on class 0:
    nothing of the trained model, so the metrics are computable by hand from the test data."""
    name = "inputs_probe"
    evaluated_model = "custom"

    def init_client(self, cid, params):
        return {"shift": torch.tensor(0.5 * cid)}

    def joining_state(self, cid, server, client, data):
        return {"shift": torch.tensor(-1.0)}  # what a newcomer's evaluation must read

    def predict_inputs(self, cid, server, client, x, buffers=None):
        CALLS.append((cid, float(client["shift"]), buffers is None))
        logits = SCALE * x[:, :self.setup.num_classes].clone()
        logits[:, 0] += client["shift"]
        return logits


def by_hand(x: torch.Tensor, y: torch.Tensor, shift: float, num_classes: int) -> tuple[float, float]:
    logits = SCALE * x[:, :num_classes].clone()
    logits[:, 0] += shift
    return float((logits.argmax(1) == y).double().mean()), float(F.cross_entropy(logits, y))


@pytest.mark.parametrize("backend", ["sequential", "processes"])
def test_predict_inputs_gives_every_evaluation_its_numbers(backend, tmp_path, monkeypatch):
    monkeypatch.setitem(registry(), InputsProbe.name, InputsProbe)
    CALLS.clear()
    config = {"algorithm": "inputs_probe", "dataset": "digits", "num_clients": 5, "rounds": 2, "threads": 1,
              "batch_size": 20, "lr": 0.05, "seed": 3, "join_ratio": 0.5, "new_clients": 1,
              "new_client_finetune": 1, "backend": backend, "out_dir": str(tmp_path / "runs"),
              "partition": {"scheme": "dirichlet", "alpha": 0.5}, **({"workers": 2} if backend == "processes" else {})}
    result = pfedkit.run(config)
    data = prepare(load_config(config), state_dir=tmp_path / "states").data
    newcomers = set(result.metrics.loc[result.metrics["new_client"] == 1, "client"])
    assert len(newcomers) == 1
    rows = result.metrics[result.metrics["round"] >= 1]
    assert len(rows) == 2 * 5
    for row in rows.itertuples():
        client = data.clients[int(row.client)]
        shift = -1.0 if row.client in newcomers else 0.5 * row.client
        accuracy, loss = by_hand(client.x_test, client.y_test, shift, data.num_classes)
        assert row.accuracy == pytest.approx(accuracy, abs=1e-12)
        assert row.loss == pytest.approx(loss, rel=1e-6)
    # called in this process (the processes backend keeps it here), with the states the engine holds
    assert {(cid, shift) for cid, shift, _ in CALLS} == \
        {(c, -1.0 if c in newcomers else 0.5 * c) for c in range(5)}
    assert all(no_buffers for _, _, no_buffers in CALLS)  # the digits mlp has no BatchNorm


def test_evaluator_calls_an_on_inputs_prediction_on_the_inputs_and_ignores_the_model():
    evaluator = ModelEvaluator(TinyNet, 3)
    x, y = torch.randn(7, 3, generator=torch.Generator().manual_seed(0)), torch.tensor([0, 1, 2, 0, 1, 2, 0])
    fixed = torch.tensor([[0.0, 2.0, 0.0]]).expand(7, 3)
    seen = []
    on_inputs = OnInputs(lambda xb: (seen.append(xb), fixed[:len(xb)])[1])
    result = evaluator.evaluate(tiny_params(1), None, x, y, on_inputs)
    assert torch.equal(seen[0], x)  # the raw inputs, not body features
    assert result.correct == 2 and result.loss == pytest.approx(float(F.cross_entropy(fixed, y)), rel=1e-6)
    # a plain callable still receives the body's features (Algorithm.predict)
    features = []
    evaluator.evaluate(tiny_params(1), None, x, y, lambda h: (features.append(h), fixed[:len(h)])[1])
    assert features[0].shape[1] == evaluator.model.body(x).shape[1] and not torch.equal(features[0], x)


def test_the_hook_is_off_unless_overridden():
    assert not FedAvg.has_input_predict(object.__new__(FedAvg))
    assert InputsProbe.has_input_predict(object.__new__(InputsProbe))
    assert Algorithm.joining_state(object.__new__(FedAvg), 0, None, {"a": 1}, None) == {"a": 1}
