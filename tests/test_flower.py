"""Beyond one machine: Flower records, Flower simulation == sequential, deployment on loopback
(a node killed mid-run; TLS with node authentication), and backend=ray == processes.

Flower simulation and Ray start several processes (~20-40 s per run on 2 cores); the deployment
tests start a SuperLink and SuperNodes as separate processes and are marked slow.
"""
from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import quick_options

flwr = pytest.importorskip("flwr")

import pfedkit  # noqa: E402
from pfedkit.algorithms import algorithm_names  # noqa: E402
from pfedkit.config import load_config  # noqa: E402
from pfedkit.core.contract import message_bytes  # noqa: E402
from pfedkit.flower.records import pack, put, take, unpack  # noqa: E402


# --- records ------------------------------------------------------------------------------------

def _same(a, b) -> bool:
    """Equal values AND equal types, dtypes, shapes (recursively)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b, equal_nan=True)
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and np.isnan(a):
        return np.isnan(b)
    return a == b


def test_every_message_type_round_trips_exactly_with_the_same_byte_count():
    value = {
        "params": {"body.0.weight": torch.randn(4, 3), "head.bias": torch.zeros(2)},
        "mask": torch.tensor([True, False]), "count": torch.tensor(7), "half": torch.randn(3).to(torch.bfloat16),
        "conv": torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
        "matrix": np.eye(3, dtype=np.float32), "flags": np.array([1, 0], dtype=np.int8),
        "weight": 125, "score": 0.1 + 0.2, "nan": float("nan"), "f32": np.float32(1.1), "i64": np.int64(-3),
        "name": "fedrema", "none": None, "yes": True,
        3: [torch.ones(1), (1, "a", None)], (0, 1): {"nested": [np.arange(3)]}, "empty": {},
    }
    back = unpack(*pack(value))
    assert _same(value, back)
    assert back["conv"].is_contiguous(memory_format=torch.channels_last)
    assert message_bytes(back) == message_bytes(value)


def test_put_take_keeps_values_under_their_names_and_decoded_tensors_are_independent():
    from flwr.app import RecordDict

    record = RecordDict()
    put(record, "a", {"x": torch.arange(3.0)})
    put(record, "b", [1, 2])
    assert take(record, "missing", default="none") == "none"
    a = take(record, "a")
    a["x"].add_(1)  # writable, and not shared with the record
    assert torch.equal(take(record, "a")["x"], torch.arange(3.0))
    assert take(record, "b") == [1, 2]


def test_unsendable_values_are_refused_with_the_type_named():
    with pytest.raises(TypeError, match="set"):
        pack({"bad": {1, 2}})
    with pytest.raises(TypeError, match="objects"):
        pack(np.array([object()], dtype=object))


def _tampered(entry: str, change) -> "flwr.app.RecordDict":
    """A message whose payload `put` wrote, then `change(record)` made something else of."""
    from flwr.app import RecordDict

    record = RecordDict()
    put(record, "payload", {"params": {"w": torch.ones(2)}, "weight": 3})
    change(record)
    return record


def _refused_messages(marker: Path) -> dict[str, "flwr.app.RecordDict"]:
    import json
    import pickle

    from flwr.app import Array, ArrayRecord, ConfigRecord

    class Payload:
        def __reduce__(self):
            return exec, (f"open({str(marker)!r}, 'w').write('ran')",)

    evil = pickle.dumps(Payload())
    skeleton = {"t": "dict", "items": [["x", {"t": "tensor", "k": "99"}]]}

    def replace(key, value):
        return lambda record: record.__setitem__(key, value)

    return {
        "a pickle as an array": _tampered("arrays", replace("payload.arrays", ArrayRecord(
            {"0": Array(dtype="float32", shape=(2,), stype="pickle", data=evil)}))),
        "a pickled object array in numpy's format": _tampered("arrays", replace("payload.arrays", ArrayRecord(
            {"0": Array(dtype="object", shape=(1,), stype="numpy.ndarray", data=_npy_of_objects(Payload()))}))),
        "a skeleton as bytes": _tampered("meta", replace("payload.meta", ConfigRecord({"skeleton": evil}))),
        "a config record for the arrays": _tampered("arrays", replace("payload.arrays", ConfigRecord({"0": evil}))),
        "an unknown skeleton node": _tampered("meta", replace("payload.meta", ConfigRecord(
            {"skeleton": json.dumps({"t": "pickle", "v": evil.hex()})}))),
        "an object-dtype scalar": _tampered("meta", replace("payload.meta", ConfigRecord(
            {"skeleton": json.dumps({"t": "npscalar", "dtype": "|O", "v": 1})}))),
        "a tensor missing from the arrays": _tampered("meta", replace("payload.meta", ConfigRecord(
            {"skeleton": json.dumps(skeleton)}))),
        "a meta record with more entries": _tampered("meta", replace("payload.meta", ConfigRecord(
            {"skeleton": "null", "code": evil}))),
    }


def _npy_of_objects(obj) -> bytes:
    import io

    buffer = io.BytesIO()
    np.save(buffer, np.array([obj], dtype=object), allow_pickle=True)
    return buffer.getvalue()


def test_a_message_carrying_anything_but_arrays_and_a_json_skeleton_is_refused(tmp_path):
    """What a node decodes from the server and the server from a node (`take`): anything but the
    numpy arrays and JSON skeleton `put` writes is one RecordError line, and nothing runs."""
    from pfedkit.flower.records import RecordError

    marker = tmp_path / "payload-ran"
    for case, record in _refused_messages(marker).items():
        with pytest.raises(RecordError) as refused:
            take(record, "payload")
        assert "\n" not in str(refused.value) and "payload" in str(refused.value), case
    assert not marker.exists()
    assert take(_tampered("none", lambda record: None), "payload")["weight"] == 3  # untouched: accepted


# --- Flower simulation == sequential -----------------------------------------------------------

def _overrides(algorithm: str, tmp_path: Path, extra: list[str] = ()) -> list[str]:
    return ["dataset=digits", "num_clients=4", "rounds=2", f"algorithm={algorithm}", "threads=1", "workers=2",
            "join_ratio=0.75", f"out_dir={tmp_path}", "seed=5", *extra]


@pytest.mark.parametrize("algorithm", ["fedavg", "fedrema", "dapfl"])
def test_flower_simulation_gives_the_sequential_metrics_bytes_included(algorithm, tmp_path):
    _flower_equals_sequential(algorithm, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", algorithm_names())
def test_every_algorithm_on_flower_gives_the_sequential_metrics(algorithm, tmp_path):
    """Every registered method on a Flower simulation, message by message, to the bit (slow: ~70 runs)."""
    quick = [f"{algorithm}.{key}={value}" for key, value in quick_options(algorithm).get(algorithm, {}).items()]
    _flower_equals_sequential(algorithm, tmp_path, quick)


def _flower_equals_sequential(algorithm: str, tmp_path: Path, extra: list[str] = ()) -> None:
    from pfedkit.flower.app import simulate

    overrides = _overrides(algorithm, tmp_path, extra)
    reference = pfedkit.run(None, overrides + ["backend=sequential", "name=seq"])
    flower_run = simulate(load_config(None, overrides + ["name=flower"]))
    pd.testing.assert_frame_equal(flower_run.metrics, reference.metrics, check_exact=True)
    assert reference.metrics["bytes_down"].sum() > 0 and reference.metrics["bytes_up"].sum() > 0
    assert (reference.metrics["participated"] == 0).any()  # partial participation was exercised
    written = pd.read_csv(flower_run.run_dir / "metrics.csv")
    pd.testing.assert_frame_equal(written, pd.read_csv(reference.run_dir / "metrics.csv"), check_exact=True)
    for name in ("config.yaml", "partition.npz", "summary.json", "clients.npz"):
        assert (flower_run.run_dir / name).is_file()
    assert flower_run.summary["backend"] == "flower"
    assert flower_run.summary["best_acc"] == reference.summary["best_acc"]
    # the device is the one the nodes reported (here this machine's CPU), once per client that trained
    trained = flower_run.metrics.query("participated == 1")["client"].nunique()
    assert flower_run.summary["device"] == f"{reference.summary['device']} x {trained}"


# --- backend=ray == processes ------------------------------------------------------------------

def test_ray_backend_gives_the_processes_metrics(tmp_path):
    pytest.importorskip("ray")
    overrides = _overrides("fedper", tmp_path, ["rounds=3"])
    processes = pfedkit.run(None, overrides + ["backend=processes", "name=processes"])
    ray_run = pfedkit.run(None, overrides + ["backend=ray", "name=ray"])
    pd.testing.assert_frame_equal(ray_run.metrics, processes.metrics, check_exact=True)
    assert ray_run.summary["backend"] == "ray"


# --- deployment on loopback --------------------------------------------------------------------

def _deploy(tmp_path: Path, nodes: int, extra: list[str], tls=None):
    from pfedkit.flower.deploy import LocalDeployment

    config = load_config(None, _overrides("fedavg", tmp_path / "runs", [f"num_clients={nodes}", "join_ratio=1",
                                                                       "name=deployed", *extra]))
    deployment = LocalDeployment(tmp_path / "app", nodes, tls=tls)
    deployment.write_app(config)
    return config, deployment


@pytest.mark.slow
def test_deployment_with_a_node_killed_in_round_two_finishes_without_it(tmp_path):
    config, deployment = _deploy(tmp_path, 3, ["rounds=2", "flower.round_timeout=60"])
    metrics_file = Path(config.out_dir) / "deployed" / "metrics.csv"
    with deployment:
        def kill_after_round_one():
            while not metrics_file.is_file():
                time.sleep(0.2)
            deployment.kill("supernode-2")
        killer = threading.Thread(target=kill_after_round_one, daemon=True)
        killer.start()
        finished = deployment.run(timeout=600)
    assert finished.returncode == 0, finished.stdout[-2000:] + finished.stderr[-2000:]
    metrics = pd.read_csv(metrics_file)
    reference = pfedkit.run(None, _overrides("fedavg", tmp_path / "ref", ["num_clients=3", "join_ratio=1",
                                                                          "rounds=2"])).metrics
    first = metrics["round"] == 1
    pd.testing.assert_frame_equal(metrics[first].reset_index(drop=True), reference[first].reset_index(drop=True),
                                  check_exact=True, check_dtype=False)  # round 1: all nodes, the sequential numbers
    second = metrics[metrics["round"] == 2].set_index("client")
    assert second.loc[2, "dropped"] == 1 and np.isnan(second.loc[2, "accuracy"])
    assert (second.loc[[0, 1], "dropped"] == 0).all() and second.loc[[0, 1], "accuracy"].notna().all()
    assert second.loc[2, "bytes_down"] > 0 and second.loc[2, "bytes_up"] == 0  # sent to, never heard from
    # round 2 aggregated only clients 0 and 1, so their models differ from the full round's
    full = reference[reference["round"] == 2].set_index("client")
    assert not np.array_equal(second.loc[[0, 1], "loss"], full.loc[[0, 1], "loss"])


@pytest.mark.slow
def test_deployment_with_tls_and_node_authentication_refuses_an_unregistered_node(tmp_path):
    from pfedkit.flower.certificates import make_certificates
    from pfedkit.flower.deploy import TLSFiles

    tls = make_certificates(tmp_path / "certs", nodes=3)
    registered = TLSFiles(tls.ca_cert, tls.server_cert, tls.server_key, tls.node_keys[:2])
    config, deployment = _deploy(tmp_path, 2, ["rounds=1"], tls=registered)
    with deployment:
        # a third node whose key the SuperLink never registered: it must not join
        deployment.start_node(2, auth_key=tls.node_keys[2])
        needs_three = config.model_copy(update={"num_clients": 3, "name": "three",
                                                "flower": config.flower.model_copy(update={"connect_timeout": 30})})
        deployment.write_app(needs_three)
        refused = deployment.run(timeout=600)
        deployment.write_app(config)
        finished = deployment.run(timeout=600)
    assert not (Path(config.out_dir) / "three" / "metrics.csv").is_file()
    assert "2 of 3 nodes connected" in refused.stdout + refused.stderr
    assert finished.returncode == 0, finished.stdout[-2000:] + finished.stderr[-2000:]
    metrics = pd.read_csv(Path(config.out_dir) / "deployed" / "metrics.csv")
    reference = pfedkit.run(None, _overrides("fedavg", tmp_path / "ref", ["num_clients=2", "join_ratio=1",
                                                                          "rounds=1"])).metrics
    pd.testing.assert_frame_equal(metrics, reference, check_exact=True)  # over TLS, the same numbers
