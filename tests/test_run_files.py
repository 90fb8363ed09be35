"""A run directory is data, not code (pfedkit/run_files.py): every file pfedkit reads back from one
loads without unpickling, a planted pickle never runs, and a damaged, missing or foreign file
ends in one `error:` line naming it, exit status 2, with the directory left as it was.

The command line runs in this process (`pfedkit.cli.main`), as in tests/test_bad_inputs.py.
"""
from __future__ import annotations

import json
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

import pfedkit
from pfedkit.cli import main
from pfedkit.engine.client_states import STATES_DIR
from pfedkit.engine.simulate import Simulation
from pfedkit.engine.state import SimState
from pfedkit.run_files import TAG, from_plain, read_data, to_plain, write_data
from pfedkit.runs import CHECKPOINT

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SMALL = {"dataset": "digits", "num_clients": 3, "rounds": 2, "threads": 1, "batch_size": 20, "lr": 0.05,
         "seed": 3, "partition": {"scheme": "dirichlet", "alpha": 0.5}}


# ---- plain data ----------------------------------------------------------------------------------

def _same(a, b) -> bool:
    """Equal values of equal types, tensors with equal dtypes, strides and requires_grad."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.stride(), a.requires_grad) == (b.dtype, b.stride(), b.requires_grad) and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return (a.dtype, a.shape, a.strides) == (b.dtype, b.shape, b.strides) and a.tobytes() == b.tobytes()
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b or (a != a and b != b)  # NaN equals NaN here


def test_every_kind_of_state_value_round_trips_exactly_through_a_file_torch_loads_safely(tmp_path):
    shared = torch.randn(3, 4)
    value = {
        "tensors": {"nhwc": torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
                    "transposed": torch.randn(3, 4).t(), "bf16": torch.randn(4).bfloat16(),
                    "grad": torch.randn(3, requires_grad=True), "empty": torch.empty(0, 3), "bool": torch.ones(2) > 0},
        "arrays": [np.arange(6, dtype=np.int8).reshape(2, 3), np.asfortranarray(np.random.rand(3, 2)),
                   np.array(2.5), np.zeros((0, 4), np.float32), np.array(["a", "bc"]),
                   np.zeros(2, dtype=[("x", "<i4"), ("y", "<f8")])],
        "scalars": [np.float32(1.25), np.int64(-3), np.bool_(True), float("nan"), 7, "text", None, False],
        3: ("a tuple", (1, 2)), (0, 1): "a tuple key", np.int64(5): "a numpy key",
        TAG: "a key that looks like the tag",
        "shared": [shared, shared],
    }
    path = tmp_path / "state.pt"
    write_data(path, value)
    plain = torch.load(path, weights_only=True)  # no allow-list: nothing but tensors and containers
    back = from_plain(plain)
    assert _same(back, value)
    assert back["arrays"][1].flags.f_contiguous and back["arrays"][0].flags.writeable
    assert back["shared"][0] is back["shared"][1]  # one tensor written once stays one tensor


def test_only_the_listed_classes_are_rebuilt_as_objects():
    state = SimState(round=1, server={"w": torch.ones(2)}, clients=[None], buffers=[None],
                     class_correct=np.ones((1, 2), np.int64))
    plain = to_plain(state, {"SimState": SimState})
    assert _same(from_plain(plain, {"SimState": SimState}).__dict__, state.__dict__)
    with pytest.raises(ValueError, match="SimState"):
        from_plain(plain)  # not allowed here: refused, not built
    with pytest.raises(ValueError, match="posix.system"):
        from_plain({TAG: "object", "class": "posix.system", "state": {}}, {"SimState": SimState})
    with pytest.raises(TypeError, match="pathlib"):
        to_plain({"where": Path(".")})  # refused when written, not discovered when read
    with pytest.raises(TypeError, match="Python objects"):
        to_plain(np.array([{"a": 1}], dtype=object))


def test_a_pickle_is_refused_by_the_reader_and_does_not_run(tmp_path):
    marker = tmp_path / "payload-ran"
    torch.save(Payload(marker), tmp_path / "evil.pt")
    with pytest.raises(Exception, match="Python objects .exec.") as refused:
        read_data(tmp_path / "evil.pt", "checkpoint", "start a new run")
    assert "\n" not in str(refused.value) and not marker.exists()


# ---- run directories ---------------------------------------------------------------------------------

class Payload:
    """A pickle that writes `marker` when it is loaded."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').write('ran')",)


def _killed_run(out: Path, **config) -> Path:
    """A run stopped after its first round (checkpointed), like a run killed in round 2."""
    original = Simulation.run_round

    def crash(self, state):
        if state.round == 1:
            raise KeyboardInterrupt
        return original(self, state)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Simulation, "run_round", crash)
        with pytest.raises(KeyboardInterrupt):
            pfedkit.run({**SMALL, "algorithm": "fedavg", "out_dir": str(out), **config})
    (run_dir,) = out.iterdir()
    return run_dir


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Killed runs to damage (copies are made per test): fedavg, local with client states on
    disk, fedrep (another algorithm), each with a checkpoint of round 1; diagnostics (fedamp) and
    clients.npz come from a finished run."""
    root = tmp_path_factory.mktemp("runs")
    finished = pfedkit.run({**SMALL, "algorithm": "fedamp", "out_dir": str(root / "finished")}).run_dir
    return {"fedavg": _killed_run(root / "fedavg"),
            "disk": _killed_run(root / "disk", algorithm="local", client_states="disk"),
            "fedrep": _killed_run(root / "fedrep", algorithm="fedrep"),
            "finished": finished}


def _copy(runs: dict[str, Path], name: str, tmp_path: Path) -> Path:
    return Path(shutil.copytree(runs[name], tmp_path / "run"))


def _one_client_state_file(run_dir: Path) -> Path:
    return sorted((run_dir / STATES_DIR).glob("client-0.*.pt"))[0]


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def _plant_pickle_pt(path: Path, marker: Path) -> None:
    torch.save(Payload(marker), path)  # what torch.load(weights_only=False) would have run


def _plant_raw_pickle(path: Path, marker: Path) -> None:
    path.write_bytes(pickle.dumps(Payload(marker)))  # what the old client state files were


def _plant_pickle_npz(path: Path, marker: Path) -> None:
    with open(path, "wb") as handle:
        np.savez(handle, num_clients=np.array(3), train_0=np.array([Payload(marker)], dtype=object))


# (id, run, file in the run directory (CLIENT: a client state file the checkpoint names), how to
# plant the payload, the command that reads the file; RUN is the run directory, OUT a new folder)
PAYLOADS = [
    ("checkpoint", "fedavg", CHECKPOINT, _plant_pickle_pt, ["run", "-q", "--resume", "RUN"]),
    ("client state file", "disk", "CLIENT", _plant_raw_pickle, ["run", "-q", "--resume", "RUN"]),
    ("client state file in torch's format", "disk", "CLIENT", _plant_pickle_pt, ["run", "-q", "--resume", "RUN"]),
    ("partition on resume", "fedavg", "partition.npz", _plant_pickle_npz, ["run", "-q", "--resume", "RUN"]),
    ("partition on export", "fedavg", "partition.npz", _plant_pickle_npz, ["data", "export", "RUN", "--out", "OUT"]),
    ("diagnostics", "finished", "diagnostics.pt", _plant_pickle_pt, ["report", "RUN"]),
    ("per-client tables", "finished", "clients.npz", _plant_pickle_npz, ["report", "RUN"]),
]


@pytest.mark.parametrize("run, name, plant, argv", [pytest.param(*case[1:], id=case[0]) for case in PAYLOADS])
def test_a_pickle_planted_in_a_file_a_user_receives_never_runs(run, name, plant, argv, runs, tmp_path, capsys):
    if "export" in argv:
        pytest.importorskip("datasets")
    run_dir = _copy(runs, run, tmp_path)
    target = _one_client_state_file(run_dir) if name == "CLIENT" else run_dir / name
    marker = tmp_path / "payload-ran"
    plant(target, marker)
    argv = [str(run_dir) if a == "RUN" else str(tmp_path / "export") if a == "OUT" else a for a in argv]

    status = main(argv)

    line = _one_error_line(capsys)
    assert status == 2
    assert target.name in line
    assert not marker.exists(), "the payload ran"
    assert not (run_dir / "report").exists() and not (tmp_path / "export").exists()  # nothing half-written


# ---- damaged run directories -------------------------------------------------------------------------

def _truncate(path: Path, runs=None) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _empty(path: Path, runs=None) -> None:
    path.write_bytes(b"")


def _from_fedrep(path: Path, runs: dict[str, Path]) -> None:
    shutil.copyfile(runs["fedrep"] / CHECKPOINT, path)


def _old_pickled_state(path: Path, runs=None) -> None:
    torch.save(SimState(round=1, server={}, clients=[{}] * 3, buffers=[None] * 3), path)


def _other_partition(path: Path, runs=None) -> None:
    with open(path, "wb") as handle:
        np.savez(handle, num_clients=np.array(2), train_0=np.arange(3), test_0=np.arange(3),
                 train_1=np.arange(3), test_1=np.arange(3))


def _rows_beyond_the_dataset(path: Path, runs=None) -> None:
    arrays = dict(np.load(path))
    arrays["train_0"] = arrays["train_0"] + 10**6
    with open(path, "wb") as handle:
        np.savez(handle, **arrays)


# (id, run, file (CLIENT: a client state file the checkpoint names), damage(file, runs), culprit in the line)
DAMAGED = [
    ("truncated checkpoint", "fedavg", CHECKPOINT, _truncate, "latest.pt"),
    ("empty checkpoint", "fedavg", CHECKPOINT, _empty, "latest.pt"),
    ("checkpoint of another algorithm", "fedavg", CHECKPOINT, _from_fedrep, "algorithm"),
    ("checkpoint pickled by an older pfedkit", "fedavg", CHECKPOINT, _old_pickled_state, "SimState"),
    ("no partition.npz", "fedavg", "partition.npz", lambda p, r: p.unlink(), "partition.npz"),
    ("truncated partition.npz", "fedavg", "partition.npz", _truncate, "partition.npz"),
    ("partition of another client count", "fedavg", "partition.npz", _other_partition,
     "2 clients"),
    ("partition rows beyond the dataset", "fedavg", "partition.npz", _rows_beyond_the_dataset,
     "train_0"),
    ("garbage checkpoints/config.json", "fedavg", "checkpoints/config.json",
     lambda p, r: p.write_text("{not json"), "config.json"),
    ("checkpoints/config.json of a list", "fedavg", "checkpoints/config.json",
     lambda p, r: p.write_text("[1, 2]"), "config.json"),
    ("missing client state file", "disk", "CLIENT", lambda p, r: p.unlink(), "client_states"),
    ("truncated client state file", "disk", "CLIENT", _truncate, "client-0."),
    ("empty client state file", "disk", "CLIENT", _empty, "client-0."),
]


@pytest.mark.parametrize("run, name, damage, culprit",
                         [pytest.param(*case[1:], id=case[0]) for case in DAMAGED])
def test_resuming_a_damaged_run_directory_is_one_line_exit_2_and_changes_nothing(
        run, name, damage, culprit, runs, tmp_path, capsys):
    run_dir = _copy(runs, run, tmp_path)
    target = _one_client_state_file(run_dir) if name == "CLIENT" else run_dir / name
    damage(target, runs)
    before = _snapshot(run_dir)

    status = main(["run", "-q", "--resume", str(run_dir)])

    line = _one_error_line(capsys)
    assert status == 2
    assert culprit in line
    assert _snapshot(run_dir) == before  # nothing written, nothing deleted


# ---- what a kill -9 leaves behind -----------------------------------------------------------------------

def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_resume_removes_the_temporary_files_of_killed_writes_and_ends_as_uninterrupted(runs, tmp_path):
    reference = pfedkit.run({**SMALL, "algorithm": "fedavg", "out_dir": str(tmp_path / "reference")})
    run_dir = _copy(runs, "fedavg", tmp_path)
    dead = [run_dir / "checkpoints" / f".latest.pt.{pid}.tmp" for pid in (_dead_pid(), _dead_pid())]
    dead.append(run_dir / f".metrics.csv.{_dead_pid()}.tmp")
    live = run_dir / ".metrics.csv.1.tmp"  # pid 1 always runs: another process's write in progress
    for path in [*dead, live]:
        path.write_bytes(b"half a file")

    resumed = pfedkit.run(resume=run_dir)

    assert not any(path.exists() for path in dead)
    assert live.exists()
    pd.testing.assert_frame_equal(resumed.metrics, reference.metrics)


def test_the_checkpoint_and_diagnostics_hold_only_tensors_and_containers(runs):
    """torch's safe loader with no allow-list reads what a run writes (a pickle of any class fails)."""
    checkpoint = torch.load(runs["finished"] / CHECKPOINT, weights_only=True)
    assert checkpoint["state"]["state"]["round"] == SMALL["rounds"]  # SimState's fields, tagged
    assert "xi" in torch.load(runs["finished"] / "diagnostics.pt", weights_only=True)  # FedAMP's records
    client_state = torch.load(_one_client_state_file(runs["disk"]), weights_only=True)
    assert all(isinstance(value, torch.Tensor) for value in client_state["params"].values())
    assert json.loads((runs["fedavg"] / "checkpoints" / "config.json").read_text())["algorithm"] == "fedavg"


def test_two_stores_of_a_checkpoint_keep_their_own_file_names(tmp_path):
    """A state holding two DiskStates (client and optimizer states) stores each one's names: the
    objects built while writing one never stand in for the other's."""
    from pfedkit.engine.client_states import DiskStates
    from pfedkit.engine.state import read_checkpoint, write_checkpoint

    clients = DiskStates(tmp_path / "states", "client", [{"w": torch.ones(2)}] * 3)
    optimizer = DiskStates(tmp_path / "states", "optimizer", [{}] * 3)
    optimizer[1] = {"m": torch.zeros(2)}
    state = SimState(round=1, server=None, clients=clients, buffers=[None] * 3, optimizer_states=optimizer)
    write_checkpoint(tmp_path / "latest.pt", state, {"algorithm": "ditto"})
    back = read_checkpoint(tmp_path / "latest.pt").state
    assert (back.clients.prefix, back.clients.names) == ("client", clients.names)
    assert (back.optimizer_states.prefix, back.optimizer_states.names) == ("optimizer", optimizer.names)


def test_an_atomic_write_never_writes_through_a_link_planted_at_its_temporary_name(tmp_path):
    """The temporary file's name is predictable (.NAME.PID.tmp): a link planted there in a shared
    folder is replaced, and the file it points to is untouched."""
    import os

    from pfedkit.atomic import atomic_write_text

    victim = tmp_path / "victim"
    victim.write_text("precious")
    target = tmp_path / "shared" / "summary.json"
    target.parent.mkdir()
    (target.parent / f".summary.json.{os.getpid()}.tmp").symlink_to(victim)
    atomic_write_text(target, "{}")
    assert victim.read_text() == "precious" and target.read_text() == "{}"
    assert [p.name for p in target.parent.iterdir()] == ["summary.json"]
