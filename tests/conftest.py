"""Shared test fixtures: small fast configs and the path of the shared datasets."""
from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
import torch
from torch import nn

SHARED_DATASETS = Path(__file__).resolve().parents[2] / "shared" / "datasets"


@pytest.fixture(scope="session", autouse=True)
def temporary_decode_cache(tmp_path_factory):
    """Every test (and every process a test starts) decodes dataset files into a temporary cache:
    a file written by a test has no SHA256SUMS entry, so its cache name holds its size and mtime
    and each suite run would add new files to ~/.cache/pfedkit. The shared datasets are decoded
    once per session here instead of being reused from the home cache: MNIST 1 s, Fashion-MNIST 2 s,
    CIFAR-10 10 s, each only when a test of the session reads it."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PFEDKIT_CACHE", str(tmp_path_factory.mktemp("decode-cache")))
        yield


@pytest.fixture
def small_config(tmp_path):
    """FedAvg on digits, 4 clients, 3 rounds, one torch thread (more threads only contend on this
    size): a run takes about a second."""
    return {"algorithm": "fedavg", "dataset": "digits", "num_clients": 4, "rounds": 3, "threads": 1,
            "batch_size": 20, "lr": 0.05, "seed": 3, "out_dir": str(tmp_path / "runs"),
            "partition": {"scheme": "dirichlet", "alpha": 0.5}}


@pytest.fixture
def one_torch_thread():
    """Tiny tensors: one torch thread avoids thread contention on a shared machine (40x slower here).
    Use with `pytestmark = pytest.mark.usefixtures("one_torch_thread")`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def needs_dataset(name: str):
    return pytest.mark.skipif(not (SHARED_DATASETS / name / f"{name}.npz.xz").is_file(),
                              reason=f"../shared/datasets/{name} not present")


def quick_options(algorithm: str) -> dict:
    """`algorithm`'s config section of its `quick_test_options` (short test runs through the same
    code paths), {} when it declares none: add it to every config a generic test runs."""
    from pfedkit.algorithms import get_algorithm

    options = get_algorithm(algorithm).quick_test_options
    return {algorithm: dict(options)} if options else {}


def interrupt_and_resume(config: dict, tmp_path, monkeypatch, after_round: int = 2):
    """Run `config` uninterrupted, then again with a crash after `after_round` rounds, then resume
    the crashed run. Returns (uninterrupted result, crashed run directory, rounds done before the
    crash, resumed result)."""
    import pfedkit
    from pfedkit.engine.simulate import Simulation

    reference = pfedkit.run({**config, "out_dir": str(tmp_path / "ref")})
    original = Simulation.run_round

    def crash(self, state):
        if state.round == after_round:
            raise KeyboardInterrupt
        return original(self, state)

    monkeypatch.setattr(Simulation, "run_round", crash)
    with pytest.raises(KeyboardInterrupt):
        pfedkit.run({**config, "out_dir": str(tmp_path / "killed")})
    monkeypatch.setattr(Simulation, "run_round", original)
    (run_dir,) = (tmp_path / "killed").iterdir()
    completed_rounds = pd.read_csv(run_dir / "metrics.csv")["round"].max()
    return reference, run_dir, completed_rounds, pfedkit.run(resume=run_dir)


def final_state(result):
    """The SimState saved with a finished run (server, clients, buffers...)."""
    from pfedkit.engine.state import read_checkpoint
    from pfedkit.runs import CHECKPOINT

    return read_checkpoint(result.run_dir / CHECKPOINT).state


def learned_run(config: dict):
    """Run `config` and check it learned (mean accuracy > 0.3 at the last round, 10 classes):
    (result, metrics, final state) for the test's own checks of bytes and states."""
    import pfedkit

    result = pfedkit.run(config)
    metrics = result.metrics
    assert metrics[metrics["round"] == metrics["round"].max()]["accuracy"].mean() > 0.3
    return result, metrics, final_state(result)


def switched_off_is_fedavg(config: dict, algorithm: str, off: dict, out_dir) -> tuple:
    """Run FedAvg and `algorithm` with the options `off` that switch its change off (FedLC tau = 0,
    FedRS alpha = 1...) on `config`, check that every metric of the two runs is the same to the bit,
    then run `algorithm` at its defaults and check it learned (`learned_run`): (FedAvg's result,
    the default run's result), to compare the two."""
    import pfedkit

    columns = ["round", "client", "accuracy", "loss", "train_loss", "bytes_up", "bytes_down"]
    fedavg = pfedkit.run({**config, "algorithm": "fedavg", "out_dir": str(out_dir / "fedavg")})
    plain = pfedkit.run({**config, "algorithm": algorithm, algorithm: off, "out_dir": str(out_dir / "off")})
    pd.testing.assert_frame_equal(plain.metrics[columns], fedavg.metrics[columns])
    result, _, _ = learned_run({**config, "algorithm": algorithm, "out_dir": str(out_dir / algorithm)})
    return fedavg, result


def refusal(call, *args) -> str:
    """The message of the ConfigError that `call(*args)` raises, checked to be one line."""
    from pfedkit.core.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        call(*args)
    assert "\n" not in str(err.value)
    return str(err.value)


def num_parameters(params: dict) -> int:
    """Entries in a parameter dict: the tests' own count for expected message sizes (4 bytes each
    in float32), independent of `message_bytes`, the code under test."""
    return sum(value.numel() for value in params.values())


class TinyNet(nn.Module):
    """A 3 -> 4 -> 3 body/head model for exact hand computations of local steps; pass
    `activation=nn.Tanh` where finite differences of the gradient must be accurate."""

    def __init__(self, activation: type[nn.Module] = nn.ReLU):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(3, 4), activation())
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        return self.head(self.body(x))


def tiny_params(seed: int = 0, dtype=None, activation: type[nn.Module] = nn.ReLU) -> dict:
    """TinyNet's parameters initialised from `seed` (the global torch RNG is left as it was)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        params = {k: v.detach().clone() for k, v in TinyNet(activation).named_parameters()}
    return {k: v.to(dtype) for k, v in params.items()} if dtype is not None else params


class BatchNormNet(nn.Module):
    """Linear + BatchNorm1d over digits' 64 features (the image model cnn_bn needs larger images):
    a model with buffers, which the vectorized runtime's training and evaluation hand back."""

    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.body = nn.Sequential(nn.Linear(64, 16), nn.BatchNorm1d(16), nn.ReLU())
            self.head = nn.Sequential(nn.Linear(16, 10))

    def forward(self, x):
        return self.head(self.body(x))


def fit_reference(build, settings, data, jobs) -> dict:
    """{cid: FitOutcome} of the sequential trainer for each job: what a runtime must give."""
    from pfedkit.engine.trainer import LocalTrainer
    trainer = LocalTrainer(build, settings)
    return {job.cid: trainer.fit(job, data.clients[job.cid].x_train, data.clients[job.cid].y_train) for job in jobs}


def assert_outcomes_close(got, want, atol=1e-5) -> None:
    """The same clients, steps and samples; losses and host-side contiguous parameters within atol."""
    assert set(got) == set(want)
    for cid in want:
        assert (got[cid].steps, got[cid].samples) == (want[cid].steps, want[cid].samples)
        assert got[cid].mean_loss == pytest.approx(want[cid].mean_loss, abs=atol)
        for name, tensor in want[cid].params.items():
            assert got[cid].params[name].is_contiguous() and got[cid].params[name].device.type == "cpu"
            torch.testing.assert_close(got[cid].params[name], tensor, atol=atol, rtol=0)


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch thread for a module's tests: the machine is shared, and threads do not change
    what they compare. Modules use it with `pytestmark = pytest.mark.usefixtures("one_torch_thread")`."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
