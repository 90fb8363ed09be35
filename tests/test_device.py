"""The `device` key: plumbing and refusals everywhere; runs on a GPU where CUDA is present.

The CUDA tests run only on a machine with a GPU (they skip elsewhere, so CI on CPUs skips them);
benchmarks/gpu.sh runs them there."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from conftest import final_state, interrupt_and_resume, refusal

import pfedkit
from pfedkit.algorithms import algorithm_names
from pfedkit.cli import main
from pfedkit.core.errors import ConfigError
from pfedkit.engine import device as device_module
from pfedkit.engine.device import DeviceData, resolve_device, to_device

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def gpu_config(small_config, **extra) -> dict:
    return {**small_config, "device": "cuda", **extra}


# ------------------------------------------------------------------ everywhere (CPU checks)
def test_auto_is_cpu_without_cuda_and_a_gpu_with_one(monkeypatch):
    monkeypatch.setattr(device_module, "make_deterministic", lambda device: None)  # process-wide switches
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    for backend in ("sequential", "vectorized", "processes", "ray"):
        assert resolve_device("auto", backend) == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("auto", "sequential") == torch.device("cuda", 0)
    assert resolve_device("auto", "processes") == torch.device("cuda")  # workers over every GPU
    assert resolve_device("auto", "ray") == torch.device("cuda")  # the GPUs Ray gives the actors
    assert resolve_device("cpu", "vectorized") == torch.device("cpu")


@pytest.mark.parametrize("spec, backend, culprit", [
    ("cuda", "processes", "device=cuda"),
    ("cuda:0", "ray", "backend=ray"),
    ("gpu", "sequential", "'gpu'"),
    ("cuda:x", "sequential", "'cuda:x'"),
])
def test_unusable_devices_are_refused_in_one_line(spec, backend, culprit, monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)  # as on a machine without CUDA
    assert culprit in refusal(resolve_device, spec, backend)


@pytest.mark.parametrize("backend", ["sequential", "processes"])
def test_cuda_index_beyond_the_devices_is_refused(monkeypatch, backend):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError, match="1 CUDA device"):
        resolve_device("cuda:1", backend)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cli_device_cuda_without_cuda_exits_2_and_leaves_no_run(small_config, tmp_path, capsys):
    out_dir = tmp_path / "runs"
    code = main(["run", "-q", "device=cuda", "dataset=digits", "rounds=1", f"out_dir={out_dir}"])
    err = capsys.readouterr().err
    assert code == 2 and "device=cuda" in err and "Traceback" not in err
    assert not out_dir.exists() or not any(out_dir.iterdir())


def test_explicit_cpu_equals_auto_on_a_cpu_and_is_recorded(small_config, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    auto = pfedkit.run({**small_config, "out_dir": str(tmp_path / "a")})
    cpu = pfedkit.run({**small_config, "device": "cpu", "out_dir": str(tmp_path / "b")})
    pd_cols = ["round", "client", "correct", "loss", "train_loss"]
    assert auto.metrics[pd_cols].equals(cpu.metrics[pd_cols])
    summary = json.loads((cpu.run_dir / "summary.json").read_text())
    assert summary["device"].startswith("cpu (")


def test_to_device_and_device_data_are_the_identity_on_the_cpu():
    tree = {"a": torch.ones(2), "b": [torch.zeros(1), 3]}
    assert to_device(tree, torch.device("cpu")) is tree
    x, y = torch.ones(3, 2), torch.arange(3)
    got = DeviceData(torch.device("cpu")).get(0, "train", x, y)
    assert got[0] is x and got[1] is y


# ------------------------------------------------------------------ on a GPU
@needs_cuda
@pytest.mark.parametrize("algorithm", algorithm_names())
def test_every_algorithm_runs_on_the_gpu_near_its_cpu_numbers(algorithm, small_config, tmp_path):
    config = {**small_config, "algorithm": algorithm, "rounds": 2}
    try:
        gpu = pfedkit.run({**config, "device": "cuda", "out_dir": str(tmp_path / "gpu")})
    except ConfigError as err:
        pytest.skip(f"{algorithm}: {err}")
    cpu = pfedkit.run({**config, "device": "cpu", "out_dir": str(tmp_path / "cpu")})
    assert gpu.summary["device"].startswith("cuda:0 (")
    trained = gpu.metrics[gpu.metrics["train_steps"] > 0]
    assert trained["train_loss"].map(math.isfinite).all()
    # Same algorithm, other kernels: losses agree to float rounding over two short rounds.
    np.testing.assert_allclose(gpu.metrics["train_loss"].fillna(0), cpu.metrics["train_loss"].fillna(0),
                               rtol=2e-3, atol=2e-4)


@needs_cuda
@pytest.mark.parametrize("backend", ["sequential", "vectorized"])
def test_a_gpu_run_repeats_bit_for_bit(backend, small_config, tmp_path):
    config = gpu_config(small_config, backend=backend, algorithm="fedprox")
    first = pfedkit.run({**config, "out_dir": str(tmp_path / "a")})
    second = pfedkit.run({**config, "out_dir": str(tmp_path / "b")})
    columns = ["correct", "loss", "train_loss"]
    assert first.metrics[columns].equals(second.metrics[columns])


@needs_cuda
@pytest.mark.parametrize("algorithm", ["fedavg", "ditto", "fedrep"])
def test_vectorized_equals_sequential_on_the_same_gpu(algorithm, small_config, tmp_path):
    config = gpu_config(small_config, algorithm=algorithm)
    seq = pfedkit.run({**config, "backend": "sequential", "out_dir": str(tmp_path / "s")})
    vec = pfedkit.run({**config, "backend": "vectorized", "out_dir": str(tmp_path / "v")})
    np.testing.assert_allclose(vec.metrics["train_loss"].fillna(0), seq.metrics["train_loss"].fillna(0),
                               rtol=1e-4, atol=1e-6)
    assert abs(vec.summary["final_acc"] - seq.summary["final_acc"]) <= 1e-4 * 10
    for a, b in zip(_tensors(final_state(seq).server), _tensors(final_state(vec).server)):
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-4, atol=1e-5)


@needs_cuda
@pytest.mark.parametrize("algorithm", ["fedavg", "fedprox", "ditto", "local", "pfedcs"])
def test_graphed_steps_equal_the_eager_step_on_the_same_gpu(algorithm, small_config, tmp_path, capsys):
    """vectorized.step=graphs (auto on a GPU) replays one CUDA graph per shape on padded members;
    its numbers are the eager step's on the same GPU, in chunks too (max_clients=2)."""
    config = gpu_config(small_config, algorithm=algorithm, backend="vectorized", rounds=3)
    eager = pfedkit.run({**config, "vectorized": {"step": "eager"}, "out_dir": str(tmp_path / "e")})
    graphs = pfedkit.run({**config, "out_dir": str(tmp_path / "g")})
    chunked = pfedkit.run({**config, "vectorized": {"max_clients": 2}, "out_dir": str(tmp_path / "c")})
    out = capsys.readouterr().out
    assert out.count("replays a CUDA graph") == 2 and "falling back" not in out
    for run in (graphs, chunked):
        np.testing.assert_allclose(run.metrics["train_loss"].fillna(0), eager.metrics["train_loss"].fillna(0),
                                   rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(run.metrics["accuracy"], eager.metrics["accuracy"], atol=1e-3)


@needs_cuda
def test_graphs_are_captured_once_per_shape_and_reused_across_rounds(small_config):
    from pfedkit.config import load_config
    from pfedkit.core.contract import Fit
    from pfedkit.engine.trainer import FitJob
    from pfedkit.runs import prepare
    prepared = prepare(load_config(gpu_config(small_config, backend="vectorized")))
    runtime, ops = prepared.runtime, prepared.simulation.algorithm.setup.ops
    init = ops.initial_params()
    cids = range(len(prepared.data.clients))
    first = runtime.fit_many([FitJob(1, cid, 0, Fit(init), None) for cid in cids])
    (_, (_, shapes)), = runtime.workspaces
    captured = shapes.captured
    assert captured == len(shapes.shapes) > 0
    second = runtime.fit_many([FitJob(1, cid, 0, Fit(init), None) for cid in cids])
    assert shapes.captured == captured  # the same shapes: replayed, not captured again
    for cid in first:  # the same jobs again: the same numbers, bit for bit
        assert all(torch.equal(first[cid].params[n], second[cid].params[n]) for n in init)
    runtime.close()


@needs_cuda
def test_resume_on_the_gpu_gives_the_uninterrupted_numbers(small_config, tmp_path, monkeypatch):
    config = gpu_config(small_config, algorithm="ditto", rounds=4)
    reference, _, done, resumed = interrupt_and_resume(config, tmp_path, monkeypatch)
    assert done == 2
    columns = ["round", "client", "correct", "loss", "train_loss"]
    assert resumed.metrics[columns].equals(reference.metrics[columns])


@needs_cuda
def test_client_states_stay_on_the_host(small_config, tmp_path):
    result = pfedkit.run(gpu_config(small_config, algorithm="local", rounds=1))
    state = final_state(result)
    devices = {tensor.device.type for client in state.clients for tensor in _tensors(client)}
    assert devices == {"cpu"}


def _tensors(tree):
    from torch.utils._pytree import tree_leaves
    return [leaf for leaf in tree_leaves(tree) if isinstance(leaf, torch.Tensor)]
