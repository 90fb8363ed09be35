"""Client states on disk (`client_states=disk`): the same numbers as in memory, bounded windows,
checkpoints that name files which stay valid, resume after a crash mid-round, and the choice and
refusals of `auto` / `memory` / `disk`."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import interrupt_and_resume, quick_options

import pfedkit
from pfedkit.algorithms import algorithm_names
from pfedkit.core.errors import ConfigError
from pfedkit.engine import client_states, local_clients
from pfedkit.engine.client_states import STATES_DIR, DiskStates, choose_placement
from pfedkit.engine.state import read_checkpoint
from pfedkit.run_files import RunFileError, read_data, write_data
from pfedkit.runs import CHECKPOINT


def _run(config: dict, mode: str, name: str, **extra):
    return pfedkit.run({**config, **extra, "client_states": mode, "name": name})


def _final_states(run_dir) -> list:
    state = read_checkpoint(run_dir / CHECKPOINT).state
    if isinstance(state.clients, DiskStates):
        state.clients.reopen(run_dir / STATES_DIR)
    return list(state.clients)


def _equal_states(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.stride() == b.stride() and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b, equal_nan=True)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal_states(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal_states(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("algorithm, extra", [
    ("local", {}),
    ("ditto", {"momentum": 0.9, "keep_optimizer_state": True}),  # optimizer states on disk too
    ("fedbabu", {}),  # evaluation-time adaptation reads the states
    ("apfl", {}),  # a custom predict reads the states
])
def test_states_on_disk_give_the_numbers_of_states_in_memory(small_config, algorithm, extra):
    config = {**small_config, "algorithm": algorithm, "num_clients": 5, **extra}
    memory, disk = _run(config, "memory", "memory"), _run(config, "disk", "disk")
    pd.testing.assert_frame_equal(memory.metrics, disk.metrics)
    assert not (memory.run_dir / STATES_DIR).exists()
    assert _equal_states(_final_states(memory.run_dir), _final_states(disk.run_dir))
    kinds = 2 if extra.get("keep_optimizer_state") else 1
    assert len(list((disk.run_dir / STATES_DIR).iterdir())) == kinds * 5  # one file per client and kind


@pytest.mark.parametrize("algorithm", algorithm_names())
def test_every_algorithm_resumed_after_a_crash_ends_as_uninterrupted(algorithm, small_config, tmp_path, monkeypatch):
    """Killed after round 2 of 3 and resumed from its checkpoint (client states on disk): the same
    metrics.csv, byte for byte, and the same final client states as the uninterrupted run, so
    nothing a method needs between rounds lives outside its checkpointed state."""
    config = {**small_config, "algorithm": algorithm, "join_ratio": 0.75, "client_states": "disk",
              **quick_options(algorithm)}
    reference, run_dir, done, _ = interrupt_and_resume(config, tmp_path, monkeypatch, after_round=2)
    assert done == 2
    assert (run_dir / "metrics.csv").read_bytes() == (reference.run_dir / "metrics.csv").read_bytes()
    assert _equal_states(_final_states(run_dir), _final_states(reference.run_dir))


def test_disk_states_train_in_windows_with_the_same_results(small_config, monkeypatch):
    config = {**small_config, "algorithm": "local", "num_clients": 7, "rounds": 2}
    reference = _run(config, "memory", "memory")
    monkeypatch.setattr(local_clients, "DISK_WINDOW", 3)
    waves = []
    original = local_clients.drive_clients

    def counting(updates, *args, **kwargs):
        waves.append(sorted(updates))
        return original(updates, *args, **kwargs)

    monkeypatch.setattr(local_clients, "drive_clients", counting)
    windowed = _run(config, "disk", "disk", backend="processes", workers=2)
    pd.testing.assert_frame_equal(reference.metrics, windowed.metrics, check_like=True)
    assert waves == [[0, 1, 2], [3, 4, 5], [6]] * 2  # at most 3 clients' states read at once, in client order


def test_crash_mid_round_resumes_to_the_uninterrupted_numbers(small_config, tmp_path, monkeypatch):
    config = {**small_config, "algorithm": "ditto", "num_clients": 4, "rounds": 4, "client_states": "disk"}
    reference = pfedkit.run({**config, "out_dir": str(tmp_path / "ref")})
    original, writes = DiskStates.__setitem__, []

    def crash_in_round_three(self, cid, value):
        writes.append(cid)
        if self.prefix == "client" and len(writes) == 4 + 2 * 4 + 2:  # initial states, two rounds, then two more
            raise KeyboardInterrupt
        original(self, cid, value)

    monkeypatch.setattr(DiskStates, "__setitem__", crash_in_round_three)
    with pytest.raises(KeyboardInterrupt):
        pfedkit.run({**config, "out_dir": str(tmp_path / "killed")})
    monkeypatch.setattr(DiskStates, "__setitem__", original)
    (run_dir,) = (tmp_path / "killed").iterdir()
    written = {path.name for path in (run_dir / STATES_DIR).iterdir()}
    assert len(written) == 4 + 1  # round 2's four files (the checkpoint's) and one of round 3's
    resumed = pfedkit.run(resume=run_dir)
    assert (run_dir / "metrics.csv").read_bytes() == (reference.run_dir / "metrics.csv").read_bytes()
    assert resumed.summary["final_acc"] == reference.summary["final_acc"]
    assert _equal_states(_final_states(run_dir), _final_states(reference.run_dir))
    named = set(read_checkpoint(run_dir / CHECKPOINT).state.clients.names)
    assert {path.name for path in (run_dir / STATES_DIR).iterdir()} == named  # nothing stray left


def _checkpointed(states: DiskStates, path) -> None:
    """`states` as a checkpoint stores them (a plain-data file: their names)."""
    write_data(path, states, {"DiskStates": DiskStates})


def _from_checkpoint(path) -> DiskStates:
    return read_data(path, "checkpoint", "start a new run", {"DiskStates": DiskStates})


def test_files_a_checkpoint_names_are_kept_until_the_next_one(tmp_path):
    states = DiskStates(tmp_path / "states", "client", [{"w": torch.zeros(3)}, {"w": torch.ones(3)}])
    _checkpointed(states, tmp_path / "latest.pt")
    states.pin()
    first = set(states.names)
    states[0] = {"w": torch.full((3,), 5.0)}
    states[0] = {"w": torch.full((3,), 6.0)}  # the middle version was never checkpointed: deleted
    on_disk = {path.name for path in (tmp_path / "states").iterdir()}
    assert on_disk == first | {states.names[0]}
    assert torch.equal(states[0]["w"], torch.full((3,), 6.0))
    restored = _from_checkpoint(tmp_path / "latest.pt")
    restored.reopen(tmp_path / "states")  # the checkpoint's view: version 1 of both, the newer file deleted
    assert torch.equal(restored[0]["w"], torch.zeros(3)) and torch.equal(restored[1]["w"], torch.ones(3))
    assert {path.name for path in (tmp_path / "states").iterdir()} == first


def test_a_checkpoint_holds_only_file_names(tmp_path):
    states = DiskStates(tmp_path / "states", "client", [{"w": torch.zeros(10_000)} for _ in range(3)])
    _checkpointed(states, tmp_path / "latest.pt")
    assert (tmp_path / "latest.pt").stat().st_size < 2_000  # 3 x 40 KB of states, named only
    (tmp_path / "states" / states.names[1]).unlink()
    with pytest.raises(RunFileError, match="not there"):
        _from_checkpoint(tmp_path / "latest.pt").reopen(tmp_path / "states")
    with pytest.raises(IndexError):
        states[3]


def test_auto_chooses_disk_when_states_would_take_half_the_memory(small_config, monkeypatch):
    config = {**small_config, "algorithm": "local", "num_clients": 4, "rounds": 1}
    monkeypatch.setattr(client_states, "available_memory", lambda: 10**12)
    assert not (_run(config, "auto", "plenty").run_dir / STATES_DIR).exists()
    monkeypatch.setattr(client_states, "available_memory", lambda: 100 * 1024)  # 100 KB left
    assert (_run(config, "auto", "scarce").run_dir / STATES_DIR).is_dir()


def test_placement_choice_and_refusals():
    assert choose_placement("auto", 10, 10, 1000) == "memory"
    assert choose_placement("auto", 10, 60, 1000) == "disk"  # 600 bytes > half of 1000
    assert choose_placement("auto", 10, 60, None) == "memory"  # unknown memory: as before
    assert choose_placement("disk", 10, 1, 10**9) == "disk"
    with pytest.raises(ConfigError, match="client_states=disk"):
        choose_placement("memory", 10, 95, 1000)


def test_states_that_cannot_fit_on_disk_are_refused_without_a_run_directory(small_config, tmp_path, monkeypatch):
    class Tiny:
        free = 1000

    monkeypatch.setattr(client_states.shutil, "disk_usage", lambda path: Tiny)
    with pytest.raises(ConfigError, match="GB free"):
        pfedkit.run({**small_config, "algorithm": "local", "client_states": "disk"})
    assert not list((tmp_path / "runs").glob("*"))


def test_a_run_without_a_run_directory_keeps_disk_states_in_a_scratch_directory(small_config, tmp_path):
    from pfedkit.config import load_config
    from pfedkit.runs import prepare

    prepared = prepare(load_config({**small_config, "algorithm": "local", "client_states": "disk"}))
    prepared.simulation.run_round(prepared.state)
    prepared.runtime.close()
    (scratch,) = (tmp_path / "runs").iterdir()
    assert scratch.name.startswith(f".{STATES_DIR}-") and len(list(scratch.iterdir())) == 4
    del prepared
    import gc
    gc.collect()
    assert not scratch.exists()  # deleted with the states


def test_state_files_keep_values_dtypes_and_exact_strides(tmp_path):
    conv = torch.randn(32, 1, 5, 5).to(memory_format=torch.channels_last)  # C=1: strides no order fixes
    state = {"conv": conv, "nhwc": torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
             "transposed": torch.randn(3, 4).t(), "bf16": torch.randn(4, 4).bfloat16(),
             "grad": torch.randn(3, requires_grad=True), "empty": torch.empty(0, 3),
             "meta": {"alpha": 0.25, "counts": [1, 2]}}
    back = DiskStates(tmp_path, "client", [state])[0]
    assert _equal_states(back, state)
    assert back["grad"].requires_grad and not back["conv"].requires_grad
    assert back["conv"].stride() == conv.stride() != torch.randn(32, 1, 5, 5).stride()
    sliced = DiskStates(tmp_path, "view", [torch.arange(10.0)[::2]])[0]  # a view that skips elements: compact
    assert torch.equal(sliced, torch.arange(0.0, 10.0, 2.0)) and sliced.is_contiguous()
