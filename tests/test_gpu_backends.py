"""Every backend on the hardware a user has (issue 26): processes, ray and Flower nodes on GPUs.

The plumbing is checked on the CPU: the rule that gives each worker its GPU, Ray's actor
resources, spawned workers (the GPU path's start method, run on the CPU) giving the forked
workers' and the sequential numbers bit for bit, and a Flower node's device. The CUDA tests skip
without CUDA; benchmarks/gpu.sh runs them on a GPU machine.
"""
from __future__ import annotations

import pytest
import torch
from conftest import refusal

import pfedkit
from pfedkit.config import Config
from pfedkit.core.errors import ConfigError
from pfedkit.engine import device as device_module
from pfedkit.engine.device import resolve_device, worker_devices
from pfedkit.engine.runtimes import processes
from pfedkit.engine.runtimes.ray import actor_plan, gpus_per_actor

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def cuda(index: int) -> torch.device:
    return torch.device("cuda", index)


# ------------------------------------------------------------------ which worker on which GPU
def test_workers_go_round_robin_over_the_gpus():
    assert worker_devices(CUDA, 3, 2) == [cuda(0), cuda(1), cuda(0)]
    assert worker_devices(CUDA, 5, 4) == [cuda(0), cuda(1), cuda(2), cuda(3), cuda(0)]
    assert worker_devices(CUDA, None, 4) == [cuda(0), cuda(1), cuda(2), cuda(3)]  # one per GPU by default


def test_a_gpu_index_pins_every_worker_to_it():
    assert worker_devices(cuda(1), 3, 2) == [cuda(1)] * 3
    assert worker_devices(cuda(1), None, 2) == [cuda(1)]  # one worker by default


def test_cpu_workers_default_to_the_cores_given():
    assert worker_devices(CPU, 3, 2) == [CPU] * 3
    assert worker_devices(CPU, None, 0, cpu_workers=5) == [CPU] * 5


# ------------------------------------------------------------------ resolve_device per backend
@pytest.fixture
def two_gpus(monkeypatch):
    """torch "sees" two GPUs; make_deterministic's process-wide switches are left alone."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(device_module, "make_deterministic", lambda device: None)


def test_processes_and_ray_take_every_gpu_for_cuda_and_auto(two_gpus):
    for backend in ("processes", "ray"):
        assert resolve_device("cuda", backend) == CUDA  # no index: the workers' GPUs
        assert resolve_device("auto", backend) == CUDA
    assert resolve_device("cuda:1", "processes") == cuda(1)  # pinned
    assert resolve_device("cuda", "sequential") == cuda(0)  # one process: the first GPU
    assert resolve_device("cpu", "processes") == CPU


@pytest.mark.parametrize("spec, backend, culprit", [
    ("cuda:2", "processes", "2 CUDA device(s)"),
    ("cuda:0", "ray", "backend=ray"),
])
def test_an_index_out_of_range_or_for_ray_is_refused_in_one_line(two_gpus, spec, backend, culprit):
    assert culprit in refusal(resolve_device, spec, backend)


@pytest.mark.parametrize("backend", ["processes", "ray"])
def test_cuda_without_cuda_is_refused_in_one_line(monkeypatch, backend):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert "no CUDA device" in refusal(resolve_device, "cuda", backend)
    assert resolve_device("auto", backend) == CPU


# ------------------------------------------------------------------ ray: the GPUs an actor asks for
def test_a_gpu_run_asks_one_gpu_per_actor_and_one_actor_per_gpu():
    count, options = actor_plan(CUDA, None, None, {"CPU": 16, "GPU": 2})
    assert (count, options) == (2, {"num_cpus": 1, "num_gpus": 1.0})


def test_fractional_gpus_put_several_actors_on_a_gpu():
    count, options = actor_plan(CUDA, None, 0.5, {"CPU": 16, "GPU": 2})
    assert count == 4 and options["num_gpus"] == 0.5
    assert actor_plan(CUDA, 3, 0.25, {"CPU": 4, "GPU": 1}) == (3, {"num_cpus": 1, "num_gpus": 0.25})


def test_cpu_actors_ask_no_gpu_whatever_the_config_says():
    assert actor_plan(CPU, None, None, {"CPU": 6, "GPU": 2}) == (6, {"num_cpus": 1, "num_gpus": 0.0})
    assert actor_plan(CPU, 3, 1.0, {"CPU": 6, "GPU": 2}) == (3, {"num_cpus": 1, "num_gpus": 0.0})


@pytest.mark.parametrize("workers, share, cluster, culprit", [
    (3, 1.0, {"CPU": 8, "GPU": 2}, "asks for 3 GPUs"),       # Ray would wait for a third GPU forever
    (None, None, {"CPU": 8}, "has 0 GPU(s)"),
    (None, 0.0, {"CPU": 8, "GPU": 2}, "ray.gpus_per_worker=0.0"),
    (None, 1.5, {"CPU": 8, "GPU": 2}, "whole number"),
])
def test_gpu_requests_ray_cannot_meet_are_refused_in_one_line(workers, share, cluster, culprit):
    assert culprit in refusal(actor_plan, CUDA, workers, share, cluster)


def test_gpus_per_worker_is_a_validated_config_field():
    assert Config(ray={"gpus_per_worker": 0.5}).ray.gpus_per_worker == 0.5
    assert Config().ray.gpus_per_worker is None
    with pytest.raises(Exception, match="gpus_per_worker"):
        Config(ray={"gpus_per_worker": -1})
    assert gpus_per_actor(CUDA, 2) == 2.0


# ------------------------------------------------------------------ spawned workers (the GPU path) on the CPU
def spawned(monkeypatch):
    """Every ProcessRuntime made from here on spawns its workers, as it does on a GPU."""
    original = processes.ProcessRuntime.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **{**kwargs, "start_method": "spawn"})
    monkeypatch.setattr(processes.ProcessRuntime, "__init__", init)


@pytest.mark.parametrize("algorithm", ["fedavg", pytest.param("ditto", marks=pytest.mark.slow)])
def test_spawned_workers_give_the_forked_and_the_sequential_metrics(algorithm, small_config, tmp_path, monkeypatch):
    # Spawned workers start fresh interpreters (~10 s each on 2 loaded cores): 2 rounds.
    config = {**small_config, "algorithm": algorithm, "rounds": 2, "join_ratio": 0.75, "device": "cpu"}
    sequential = pfedkit.run({**config, "backend": "sequential", "out_dir": str(tmp_path / "s")})
    forked = pfedkit.run({**config, "backend": "processes", "workers": 2, "out_dir": str(tmp_path / "f")})
    spawned(monkeypatch)
    spawn = pfedkit.run({**config, "backend": "processes", "workers": 2, "out_dir": str(tmp_path / "p")})
    reference = (sequential.run_dir / "metrics.csv").read_bytes()
    assert (forked.run_dir / "metrics.csv").read_bytes() == reference
    assert (spawn.run_dir / "metrics.csv").read_bytes() == reference
    assert spawn.metrics["train_steps"].sum() > 0


def test_cuda_workers_are_never_forked():
    with pytest.raises(ValueError, match="spawned"):
        processes.ProcessRuntime(lambda: torch.nn.Linear(1, 1), None, None, device=cuda(0), start_method="fork")


def test_a_spawned_worker_that_cannot_start_fails_the_first_job():
    """A pool restarts a worker whose initializer raises, forever: the error waits for a job."""
    processes._WORKER.clear()
    try:
        processes._init_spawned_worker(None, _Counter(), ["cpu"], b"not a pickle", None, b"", 1)
        with pytest.raises(RuntimeError, match="could not start"):
            processes._fit(b"")
    finally:
        processes._WORKER.clear()


class _Counter:
    value = 0

    def get_lock(self):
        import contextlib
        return contextlib.nullcontext()


# ------------------------------------------------------------------ Flower nodes
flower_config = {"dataset": "digits", "num_clients": 4, "threads": 1, "seed": 5, "batch_size": 20}


def test_a_flower_node_trains_on_its_device_and_says_so():
    pytest.importorskip("flwr")
    from pfedkit.flower import node as flower_node

    built = flower_node.build_node(Config(**flower_config, device="cpu"), 1)
    assert built.device == CPU and built.clients.runtime.device == CPU
    stored = dict(built.initial)
    params = built.clients.algorithm.setup.ops_for(1).initial_params()
    answer = flower_node._train(built, 1, stored, {"params": params})
    assert answer["device"].startswith("cpu (") and answer["steps"] > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_a_flower_node_without_cuda_refuses_device_cuda_in_one_line():
    pytest.importorskip("flwr")
    from pfedkit.flower import node as flower_node

    with pytest.raises(ConfigError) as err:
        flower_node.build_node(Config(**flower_config, device="cuda"), 0)
    assert "device=cuda" in str(err.value) and "\n" not in str(err.value)
    # `auto` on the same node: its CPU
    assert flower_node.build_node(Config(**flower_config, device="auto"), 0).device == CPU


def test_the_flower_server_logs_each_clients_device_once(caplog):
    pytest.importorskip("flwr")
    from pfedkit.flower.server import FlowerClients

    clients = FlowerClients.__new__(FlowerClients)  # no grid: only the bookkeeping
    clients.devices = {}
    with caplog.at_level("INFO", logger="pfedkit.flower"):
        for device in ("cuda:0 (X)", "cuda:0 (X)", None):
            clients.note_device(3, device)
    assert clients.devices == {3: "cuda:0 (X)"}
    assert [r.getMessage() for r in caplog.records] == ["client 3 trains on cuda:0 (X)"]


def test_a_flower_runs_summary_names_the_nodes_devices_not_the_servers():
    pytest.importorskip("flwr")
    from pfedkit.flower.server import FlowerClients

    clients = FlowerClients.__new__(FlowerClients)  # no grid: only the bookkeeping
    clients.devices = {}
    assert clients.describe_devices() == "not reported by any node"
    for cid, device in enumerate(["cpu (AVX2)", "cuda:0 (X)", "cpu (AVX2)"]):
        clients.note_device(cid, device)
    assert clients.describe_devices() == "cpu (AVX2) x 2, cuda:0 (X) x 1"


# ------------------------------------------------------------------ on a GPU
@needs_cuda
def test_processes_pinned_to_a_gpu_equal_sequential_on_it(small_config, tmp_path):
    config = {**small_config, "algorithm": "fedprox", "device": "cuda:0"}
    sequential = pfedkit.run({**config, "backend": "sequential", "out_dir": str(tmp_path / "s")})
    spread = pfedkit.run({**config, "backend": "processes", "workers": 2, "out_dir": str(tmp_path / "p")})
    columns = ["round", "client", "correct", "loss", "train_loss"]
    assert spread.metrics[columns].equals(sequential.metrics[columns])  # same GPU, same kernels
    assert spread.summary["device"].startswith("cuda:0 (")


@needs_cuda
def test_processes_over_every_gpu_repeat_bit_for_bit(small_config, tmp_path):
    config = {**small_config, "algorithm": "ditto", "device": "cuda", "backend": "processes",
              "workers": 2 * torch.cuda.device_count()}
    first = pfedkit.run({**config, "out_dir": str(tmp_path / "a")})
    second = pfedkit.run({**config, "out_dir": str(tmp_path / "b")})
    columns = ["correct", "loss", "train_loss"]
    assert first.metrics[columns].equals(second.metrics[columns])
    assert first.summary["device"].startswith("cuda (")


@needs_cuda
def test_ray_on_the_gpu_gives_the_processes_metrics(small_config, tmp_path):
    pytest.importorskip("ray")
    config = {**small_config, "algorithm": "fedper", "device": "cuda", "workers": 1}
    on_processes = pfedkit.run({**config, "backend": "processes", "out_dir": str(tmp_path / "p")})
    on_ray = pfedkit.run({**config, "backend": "ray", "ray": {"gpus_per_worker": 0.5}, "out_dir": str(tmp_path / "r")})
    columns = ["round", "client", "correct", "loss", "train_loss"]
    # one GPU kind per machine: processes on cuda:0, the actor on the GPU Ray gave it
    assert on_ray.metrics[columns].equals(on_processes.metrics[columns])


def test_flower_simulation_asks_ray_for_the_configured_gpus_per_virtual_node(monkeypatch):
    """`flower.client_gpus` reaches Ray's client resources (0 by default: CPU nodes)."""
    import flwr.simulation

    from pfedkit.config import load_config
    from pfedkit.flower import app

    asked = []
    monkeypatch.setattr(flwr.simulation, "run_simulation",
                        lambda *args, backend_config, **kw: asked.append(backend_config["client_resources"]))
    for gpus in (None, 0.5):
        overrides = {"flower": {"client_gpus": gpus}} if gpus is not None else {}
        config = load_config({"dataset": "digits", "num_clients": 2, "device": "cpu", **overrides})
        with pytest.raises(RuntimeError, match="without a result"):
            app.simulate(config)
    assert [resources["num_gpus"] for resources in asked] == [0.0, 0.5]
