"""Runs a user can trust: resume refuses an edited config, run directories are never shared or
outside out_dir, compare reruns keep finished cells, every JSON file is strict, and a run whose
training loss becomes NaN stops with one line and keeps what it wrote."""
from __future__ import annotations

import json
import math
import threading
from datetime import datetime
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

import pfedkit
from pfedkit import runs
from pfedkit.atomic import strict_json
from pfedkit.cli import EXIT_BAD_INPUT, EXIT_DIVERGED, main
from pfedkit.config import load_config
from pfedkit.core.errors import ConfigError
from pfedkit.engine.runtimes.sequential import SequentialRuntime
from pfedkit.engine.simulate import Simulation
from pfedkit.experiments.comparison import MANIFEST, Entry, run_comparison

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def as_overrides(config: dict) -> list[str]:
    """The command-line form of a flat config (its partition section as dotted keys)."""
    items = [f"{key}={value}" for key, value in config.items() if key != "partition"]
    return items + [f"partition.{key}={value}" for key, value in config.get("partition", {}).items()]


def strict_load(text: str):
    """json.loads that refuses NaN, Infinity and -Infinity, as JavaScript, jq or Go would."""
    def refuse(constant: str):
        raise ValueError(f"not strict JSON: {constant}")
    return json.loads(text, parse_constant=refuse)


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    return err


# ---- resume ----------------------------------------------------------------------------------

def killed_after_rounds(config: dict, monkeypatch, rounds_done: int = 1) -> Path:
    """A run of `config` killed after `rounds_done` rounds; returns its run directory."""
    original = Simulation.run_round

    def crash(self, state):
        if state.round == rounds_done:
            raise KeyboardInterrupt
        return original(self, state)

    monkeypatch.setattr(Simulation, "run_round", crash)
    with pytest.raises(KeyboardInterrupt):
        pfedkit.run(config)
    monkeypatch.setattr(Simulation, "run_round", original)
    (run_dir,) = Path(config["out_dir"]).iterdir()
    return run_dir


def edit_config_file(run_dir: Path, **changes) -> None:
    stored = yaml.safe_load((run_dir / "config.yaml").read_text())
    stored.update(changes)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(stored, sort_keys=False))


def test_resume_refuses_a_config_edited_in_what_changes_numbers(small_config, monkeypatch, capsys):
    run_dir = killed_after_rounds(small_config, monkeypatch)
    metrics_before = (run_dir / "metrics.csv").read_bytes()
    edit_config_file(run_dir, lr=0.1, seed=4)
    assert main(["run", "--resume", str(run_dir)]) == EXIT_BAD_INPUT
    err = one_line_error(capsys)
    assert "lr: 0.05 -> 0.1" in err and "seed: 3 -> 4" in err
    assert (run_dir / "metrics.csv").read_bytes() == metrics_before  # nothing ran
    assert not (run_dir / "summary.json").exists()


def test_resume_accepts_edited_execution_keys_and_ends_as_uninterrupted(small_config, monkeypatch, tmp_path):
    reference = pfedkit.run({**small_config, "out_dir": str(tmp_path / "reference")})
    run_dir = killed_after_rounds(small_config, monkeypatch)
    edit_config_file(run_dir, checkpoint_every=2, name="renamed")  # where and how often it saves, not what
    resumed = pfedkit.run(resume=run_dir)
    assert resumed.summary["rounds_done"] == small_config["rounds"]
    pd.testing.assert_frame_equal(resumed.metrics, reference.metrics)


def test_a_run_killed_between_checkpoints_keeps_every_finished_rounds_metrics(small_config, monkeypatch, tmp_path):
    """metrics.csv follows every round; the checkpoint only every `checkpoint_every` rounds, and a
    resume from it repeats the rounds after it to the same numbers."""
    config = {**small_config, "rounds": 4, "checkpoint_every": 3}
    reference = pfedkit.run({**config, "out_dir": str(tmp_path / "reference")})
    run_dir = killed_after_rounds(config, monkeypatch, rounds_done=2)
    assert sorted(pd.read_csv(run_dir / "metrics.csv")["round"].unique()) == [1, 2]
    assert not (run_dir / runs.CHECKPOINT).exists()  # round 3 was the first due
    resumed = pfedkit.run(resume=run_dir)
    pd.testing.assert_frame_equal(resumed.metrics, reference.metrics)


# ---- run directories ---------------------------------------------------------------------------

class FrozenClock(datetime):
    """Every run starts in the same second."""

    @classmethod
    def now(cls, tz=None):
        return datetime(2026, 1, 2, 3, 4, 5)


def test_two_runs_started_in_the_same_second_get_their_own_directories(small_config, monkeypatch):
    monkeypatch.setattr(runs, "datetime", FrozenClock)
    original_prepare, second = runs.prepare, {}

    def prepare_while_another_run_starts(config, **options):
        # The second run starts (and ends) while the first is being set up, after the first
        # picked its directory's name: the window in which two runs used to collide.
        if not second:
            second["started"] = True
            second["result"] = pfedkit.run({**small_config, "rounds": 1, "seed": 1})
        return original_prepare(config, **options)

    monkeypatch.setattr(runs, "prepare", prepare_while_another_run_starts)
    first = pfedkit.run({**small_config, "rounds": 1})
    other = second["result"]
    assert first.run_dir != other.run_dir
    assert {first.run_dir.name, other.run_dir.name} == {"fedavg-digits-20260102-030405",
                                                         "fedavg-digits-20260102-030405-2"}
    seeds = {yaml.safe_load((r.run_dir / "config.yaml").read_text())["seed"] for r in (first, other)}
    assert seeds == {small_config["seed"], 1}
    assert all((r.run_dir / "summary.json").is_file() for r in (first, other))


def test_concurrent_claims_of_one_name_never_share_a_directory(small_config, monkeypatch):
    monkeypatch.setattr(runs, "datetime", FrozenClock)
    config = load_config(small_config)
    barrier, claimed = threading.Barrier(8), []

    def claim():
        barrier.wait()
        claimed.append(runs.claim_run_dir(config))

    threads = [threading.Thread(target=claim) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(set(claimed)) == 8 and all(path.is_dir() for path in claimed)


@pytest.mark.parametrize("name", ["../../escape", "../escape", "a/b", "..", ".", "", "  ", "a\\b"])
def test_a_run_name_that_leaves_out_dir_is_refused(small_config, tmp_path, name):
    with pytest.raises(ConfigError, match=r"^name: .*not a plain directory name"):
        pfedkit.run({**small_config, "name": name})
    assert not Path(small_config["out_dir"]).exists()
    assert not (tmp_path / "escape").exists() and not (tmp_path.parent / "escape").exists()


def test_a_run_name_that_leaves_out_dir_exits_2_on_the_command_line(small_config, tmp_path, capsys):
    assert main(["run", "-q", *as_overrides(small_config), "name=../../escape"]) == EXIT_BAD_INPUT
    assert one_line_error(capsys).startswith("error: name: '../../escape'")
    assert not (tmp_path / "escape").exists() and not (tmp_path.parent / "escape").exists()


# ---- compare reruns ----------------------------------------------------------------------------

def test_compare_rerun_with_a_subset_keeps_every_finished_cell(small_config, tmp_path):
    out = tmp_path / "cmp"
    base = as_overrides({key: value for key, value in small_config.items() if key != "algorithm"})
    compare = ["compare", "--out", str(out), "-q", *base]
    assert main([*compare, "--algorithms", "fedavg,local", "--seeds", "0"]) == 0
    first = pd.read_csv(out / "table.csv").set_index("label")
    assert main([*compare, "--algorithms", "fedprox", "--seeds", "0"]) == 0  # a new method only
    assert main([*compare, "--algorithms", "fedavg", "--seeds", "1"]) == 0  # a new seed of one method
    table = pd.read_csv(out / "table.csv").set_index("label")
    assert table.index.tolist() == ["fedavg", "local", "fedprox"]
    assert table["seeds"].to_dict() == {"fedavg": 2, "local": 1, "fedprox": 1}
    assert table.loc["local", "best_mean"] == first.loc["local", "best_mean"]  # kept as it was
    assert table.loc["fedavg", "best_mean"] != first.loc["fedavg", "best_mean"]  # now the mean of 2 seeds
    markdown = (out / "table.md").read_text()
    assert all(f"| {name} |" in markdown for name in ("fedavg", "local", "fedprox"))
    manifest = strict_load((out / MANIFEST).read_text())
    assert {entry["label"]: sorted(entry["runs"]) for entry in manifest["entries"]} == {
        "fedavg": ["0", "1"], "local": ["0"], "fedprox": ["0"]}
    assert manifest["seeds"] == [0, 1]


def test_compare_rerun_refuses_to_mix_settings_into_one_table(small_config, tmp_path):
    out = tmp_path / "cmp"
    run_comparison(out, [Entry("fedavg", small_config)], [0], log=lambda _: None)
    other = [Entry("local", {**small_config, "algorithm": "local", "rounds": 2})]
    with pytest.raises(ConfigError, match=r"runs/fedavg-s0 was made with other settings \(rounds: 3 -> 2\)"):
        run_comparison(out, other, [0], log=lambda _: None)
    assert not (out / "runs" / "local-s0").exists()  # refused before running anything


# ---- strict JSON -------------------------------------------------------------------------------

def test_every_json_file_of_a_run_and_a_comparison_is_strict(small_config, tmp_path):
    records = run_comparison(tmp_path / "cmp", [Entry("fedavg", small_config)], [0], log=lambda _: None)
    run_dir = records[0].run_dir
    summary = strict_load((run_dir / "summary.json").read_text())
    # this run has no class absent from every client's training data: its `absent` group is empty,
    # which Python's json wrote as a bare NaN
    assert "absent" in summary["final_group_acc"] and summary["final_group_acc"]["absent"] is None
    strict_load((tmp_path / "cmp" / MANIFEST).read_text())
    strict_load((run_dir / runs.RUN_IDENTITY).read_text())
    written = sorted(path.relative_to(tmp_path) for path in tmp_path.rglob("*.json"))
    assert len(written) == 3, written  # every JSON file there is, was read above


def test_strict_json_writes_non_finite_numbers_as_null():
    value = {"a": float("nan"), "b": [np.float64("inf"), 1.5, (float("-inf"), 2)], "c": {"d": None, "e": "x"}}
    assert strict_load(strict_json(value, indent=None)) == {"a": None, "b": [None, 1.5, [None, 2]],
                                                            "c": {"d": None, "e": "x"}}


# ---- non-finite input and divergence -------------------------------------------------------------

@pytest.mark.parametrize("override, key", [("lr=inf", "lr"), ("lr=.inf", "lr"), ("momentum=.nan", "momentum"),
                                           ("weight_decay=-.inf", "weight_decay"),
                                           ("grad_clip=inf", "grad_clip"), ("fedprox.mu=.inf", "fedprox.mu")])
def test_non_finite_numbers_in_the_config_are_refused(small_config, capsys, override, key):
    algorithm = ["algorithm=fedprox"] if override.startswith("fedprox") else []
    assert main(["run", "-q", *as_overrides(small_config), *algorithm, override]) == EXIT_BAD_INPUT
    assert one_line_error(capsys).startswith(f"error: {key}:")
    assert not Path(small_config["out_dir"]).exists()


def test_a_diverging_run_stops_with_one_line_and_exit_3(small_config, capsys):
    assert main(["run", "-q", *as_overrides(small_config), "lr=1e6"]) == EXIT_DIVERGED
    err = one_line_error(capsys)
    assert err.startswith("error: training diverged in round 1: client 0's training loss is nan")
    assert "lower lr (now 1000000.0) or set grad_clip=1.0" in err
    (run_dir,) = Path(small_config["out_dir"]).iterdir()
    assert (run_dir / "config.yaml").is_file() and (run_dir / "partition.npz").is_file()
    assert not (run_dir / "summary.json").exists()


def test_divergence_in_a_later_round_keeps_the_rounds_before_it(small_config, monkeypatch, capsys):
    original = SequentialRuntime.fit_stream

    def nan_for_client_2_in_round_2(self, jobs):
        rounds = {job.cid: job.rnd for job in jobs}  # read first: the runtime empties the list
        for cid, outcome in original(self, jobs):
            if (cid, rounds[cid]) == (2, 2):
                outcome.mean_loss = math.nan
            yield cid, outcome

    monkeypatch.setattr(SequentialRuntime, "fit_stream", nan_for_client_2_in_round_2)
    # checkpoints every 2 rounds: round 1's metrics exist only because the divergence wrote them
    assert main(["run", "-q", *as_overrides(small_config), "grad_clip=5", "checkpoint_every=2"]) == EXIT_DIVERGED
    err = one_line_error(capsys)
    assert "round 2: client 2's training loss is nan" in err and "a smaller grad_clip (now 5.0)" in err
    (run_dir,) = Path(small_config["out_dir"]).iterdir()
    assert f"{run_dir} keeps the metrics of round 1" in err
    metrics = pd.read_csv(run_dir / "metrics.csv")
    assert sorted(metrics["round"].unique()) == [1]
    assert not (run_dir / runs.CHECKPOINT).exists()  # round 2's state is half updated: never checkpointed
