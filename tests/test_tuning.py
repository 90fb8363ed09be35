"""`pfedkit tune` and `compare --tuned` (issue 27, part 2): validation split, no test reads,
determinism, resume, best config, errors. Small: digits, 3 clients, 2 rounds, 2-3 trials."""
from __future__ import annotations

import json
import math

import numpy as np
import optuna
import pytest
import yaml

from pfedkit.algorithms import algorithm_names, get_algorithm
from pfedkit.cli import main
from pfedkit.config import load_config
from pfedkit.core.search import declared_ranges
from pfedkit.data.datasets import Dataset, load_dataset
from pfedkit.data.federated import split_indices
from pfedkit.data.validation import carve_validation, validation_size
from pfedkit.experiments.tuning import BEST, BEST_CONFIG, STUDY_DB, read_tuned, tune
from pfedkit.federation import split_plan
from pfedkit.run_identity import flatten

BASE = {"dataset": "digits", "num_clients": 3, "rounds": 2, "threads": 1, "seed": 0,
        "partition": {"scheme": "dirichlet", "alpha": 0.5}}


def base_config(**changes):
    return load_config({**BASE, "algorithm": "fedprox", **changes})


def trials_of(directory):
    study = optuna.load_study(study_name=directory.name, storage=f"sqlite:///{directory / STUDY_DB}")
    return study, [(t.params, t.value, t.state.name) for t in study.get_trials()
                   if t.state.name in ("COMPLETE", "PRUNED")]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """One 3-trial study, run straight through (shared by the tests that read a finished study)."""
    out = tmp_path_factory.mktemp("tune-a")
    result = tune(base_config(), 3, out, log=lambda text: None)
    return out, result


# ---- the validation split ---------------------------------------------------------------------

def test_validation_split_disjoint_from_training_and_test_and_covers_fraction():
    config = base_config(num_clients=5)
    dataset = load_dataset("digits")
    train, test = split_indices(split_plan(config), dataset)
    remaining, validation = carve_validation(train, dataset.y, 0.2, seed=0)
    for cid in range(5):
        assert len(np.intersect1d(validation[cid], remaining[cid])) == 0
        assert len(np.intersect1d(validation[cid], np.concatenate(test))) == 0
        np.testing.assert_array_equal(np.sort(np.concatenate([remaining[cid], validation[cid]])), train[cid])
        assert len(validation[cid]) == validation_size(len(train[cid]), 0.2) == math.floor(0.2 * len(train[cid]) + 0.5)
        # stratified: every class gives its share up to one whole sample
        own = dataset.y[train[cid]]
        for label in np.unique(own):
            taken = np.sum(dataset.y[validation[cid]] == label)
            assert abs(taken - 0.2 * np.sum(own == label)) < 1
    # seeded: the same seed carves the same samples, another seed others
    again = carve_validation(train, dataset.y, 0.2, seed=0)[1]
    other = carve_validation(train, dataset.y, 0.2, seed=1)[1]
    assert all(np.array_equal(a, b) for a, b in zip(validation, again))
    assert not all(np.array_equal(a, b) for a, b in zip(validation, other))


def test_validation_size_keeps_a_training_sample():
    assert [validation_size(n, 0.5) for n in (0, 1, 2, 3, 4)] == [0, 0, 1, 2, 2]  # round half up, one left to train
    assert validation_size(10, 0.01) == 1  # every client with 2+ samples gets a validation sample
    assert validation_size(10, 0.99) == 9


# ---- tuning never reads the test split --------------------------------------------------------

def test_tuning_never_reads_the_test_split(tmp_path, monkeypatch):
    config = base_config()
    dataset = load_dataset("digits")
    train, test = split_indices(split_plan(config), dataset)
    test_rows = np.concatenate(test)
    read: list[np.ndarray] = []
    original_rows = Dataset.rows

    def recording_rows(self, index):
        read.append(np.arange(len(self.y))[index] if isinstance(index, slice) else np.asarray(index).copy())
        return original_rows(self, index)

    monkeypatch.setattr(Dataset, "rows", recording_rows)
    # `input_shape` reads row 0 for its shape only (no value reaches a model): not recorded
    monkeypatch.setattr(Dataset, "input_shape", property(lambda self: tuple(original_rows(self, slice(0, 1)).shape[1:])))
    monkeypatch.setattr(Dataset, "x", property(lambda self: pytest.fail("the whole dataset was read")))
    evaluated: list[int] = []
    import pfedkit.experiments.tuning as tuning
    original_trial = tuning.run_trial

    def recording_trial(trial_config, report):
        value, metrics = original_trial(trial_config, report)
        last = metrics[metrics["round"] == metrics["round"].max()].sort_values("client")
        evaluated.append(tuple(last["n_test"].astype(int)))
        return value, metrics

    monkeypatch.setattr(tuning, "run_trial", recording_trial)
    tune(config, 2, tmp_path, log=lambda text: None)
    touched = np.unique(np.concatenate(read))
    assert len(np.intersect1d(touched, test_rows)) == 0, "a test row was read while tuning"
    assert set(touched) == set(np.concatenate(train).tolist())  # training rows only, all of them
    _, validation = carve_validation(train, dataset.y, 0.2, seed=0)
    assert evaluated == [tuple(len(v) for v in validation)] * 2  # each trial evaluated on validation


# ---- the study --------------------------------------------------------------------------------

def test_same_seed_same_trials_and_a_killed_study_resumes_with_the_lost_trial(tmp_path, uninterrupted):
    straight_dir, _ = uninterrupted
    _, straight = trials_of(straight_dir / "fedprox")
    first = tune(base_config(), 2, tmp_path, log=lambda text: None)
    study, two = trials_of(tmp_path / "fedprox")
    assert two == straight[:2]  # same seed: same parameters and the same values
    study.ask()  # a trial left RUNNING, as by a killed `pfedkit tune`
    lines = []
    resumed = tune(base_config(), 3, tmp_path, log=lines.append)
    assert (first.new_trials, resumed.new_trials, resumed.finished) == (2, 1, 3)
    study, three = trials_of(tmp_path / "fedprox")
    assert three == straight  # the lost trial is rerun with its parameters: as if never killed
    assert [t.state.name for t in study.get_trials()] == ["COMPLETE", "COMPLETE", "FAIL", "COMPLETE"]
    assert sum(line.startswith("[trial ") for line in lines) == 1  # one progress line per trial
    assert tune(base_config(), 3, tmp_path, log=lambda text: None).new_trials == 0


def test_another_seed_gives_other_trials(tmp_path, uninterrupted):
    straight_dir, _ = uninterrupted
    _, straight = trials_of(straight_dir / "fedprox")
    tune(base_config(seed=1), 1, tmp_path, log=lambda text: None)
    _, other = trials_of(tmp_path / "fedprox")
    assert other[0][0] != straight[0][0]


def test_each_evaluated_round_is_reported_and_the_objective_is_the_validation_headline(uninterrupted):
    out, _ = uninterrupted
    study, _ = trials_of(out / "fedprox")
    for trial in study.get_trials():
        assert sorted(trial.intermediate_values) == [1, 2]
        assert trial.value == max(trial.intermediate_values.values())  # headline: weighted, best round


def test_best_yaml_holds_the_best_trial(uninterrupted):
    out, result = uninterrupted
    study, _ = trials_of(out / "fedprox")
    best = study.best_trial
    assert (result.best_trial, result.best_value) == (best.number, best.value)
    written = yaml.safe_load((out / "fedprox" / BEST).read_text())
    assert written.pop("algorithm") == "fedprox"
    assert flatten(written) == best.params
    assert read_tuned(out, "fedprox").params == best.params
    final = load_config(out / "fedprox" / BEST_CONFIG)
    assert final.validation_fraction == 0.0  # the final runs train on all training data, report on test
    assert (final.lr, final.hyper().mu, final.rounds) == (best.params["lr"], best.params["fedprox.mu"], 2)


def test_a_changed_config_is_refused_on_resume(tmp_path, uninterrupted, capsys):
    out, _ = uninterrupted
    config_file = tmp_path / "c.yaml"
    config_file.write_text(yaml.safe_dump({**BASE, "rounds": 3}))
    code = main(["tune", str(config_file), "--algorithm", "fedprox", "--trials", "4", "--out", str(out)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and "rounds: 2 -> 3" in err


# ---- errors -----------------------------------------------------------------------------------

@pytest.mark.parametrize("space, expected", [
    ("fedprox: {fedprox.mu: {type: float, low: 1.0, high: 0.1}}", "low < high"),
    ("fedprox: {fedprox.mu: {type: float, low: 0.0, high: 0.1, log: true}}", "low > 0"),
    ("fedprox: {fedprox.muu: {type: float, low: 0.01, high: 0.1}}", "fedprox.muu"),
    ("fedprox: {mu: {type: float, low: 0.01, high: 0.1}}", "mu"),
    ("fedprox: {fedprox.mu: {type: gaussian, low: 0.01, high: 0.1}}", "fedprox.mu"),
    ("fedprox: {ditto.lam: {type: float, low: 0.01, high: 0.1}}", "put it under ditto"),
    ("fedproxx: {}", "did you mean fedprox"),
    ("common: {lr: {type: float, low: -1.0, high: 0.1}}", "lr"),
    ("common: [lr", "not valid YAML"),
])
def test_a_bad_space_file_is_one_line_exit_2(tmp_path, capsys, space, expected):
    space_file = tmp_path / "space.yaml"
    space_file.write_text(space)
    code = main(["tune", "--algorithm", "fedprox", "--trials", "1", "--space", str(space_file),
                 "--out", str(tmp_path / "t"), "dataset=digits"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("error: ") and "\n" not in err and expected in err
    assert not (tmp_path / "t" / "fedprox" / STUDY_DB).exists()


def test_unknown_algorithm_and_bad_trials_are_one_line_exit_2(tmp_path, capsys):
    assert main(["tune", "--algorithm", "fedprx", "--trials", "1", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "did you mean fedprox" in err
    assert main(["tune", "--algorithm", "fedprox", "--trials", "0", "--out", str(tmp_path)]) == 2
    assert "--trials 0" in capsys.readouterr().err


def test_an_algorithm_without_a_space_tunes_lr_only_with_a_note(tmp_path, monkeypatch):
    import pfedkit.experiments.tuning as tuning

    monkeypatch.setattr(tuning, "run_trial", lambda config, report: (config.lr, None))  # no training
    space_file = tmp_path / "space.yaml"
    space_file.write_text("common: {lr: {type: float, low: 0.01, high: 0.1, log: true}}\n")
    lines = []
    result = tune(base_config(algorithm="ditto"), 2, tmp_path, space_file, log=lines.append)
    assert set(result.best_params) == {"lr"}
    assert any(line.startswith("note: no search space for ditto") for line in lines)


# ---- compare --tuned --------------------------------------------------------------------------

def test_compare_tuned_uses_tuned_params_where_tuned_and_defaults_elsewhere(tmp_path, uninterrupted, capsys):
    tuned_dir, result = uninterrupted
    config_file = tmp_path / "c.yaml"
    config_file.write_text(yaml.safe_dump({**BASE, "rounds": 1}))
    out = tmp_path / "cmp"
    code = main(["compare", str(config_file), "--algorithms", "fedavg,fedprox", "--tuned", str(tuned_dir),
                 "--out", str(out), "-q"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    manifest = json.loads((out / "comparison.json").read_text())
    runs = {entry["label"]: out / entry["runs"]["0"] for entry in manifest["entries"]}
    assert set(runs) == {"fedavg", "fedprox (tuned)"}
    tuned = load_config(runs["fedprox (tuned)"] / "config.yaml")
    default = load_config(runs["fedavg"] / "config.yaml")
    assert (tuned.lr, tuned.hyper().mu) == (result.best_params["lr"], result.best_params["fedprox.mu"])
    assert default.lr == load_config({}).lr
    assert manifest["tuned"]["algorithms"]["fedprox"]["params"] == result.best_params
    assert "defaults: fedavg" in captured.err
    assert "fedprox was tuned with other settings" in captured.err and "rounds: 2 -> 1" in captured.err


@pytest.mark.parametrize("algorithm", algorithm_names())
def test_the_shipped_space_is_lr_and_the_ranges_declared_on_the_algorithm_s_options(algorithm):
    """Each declared range is a valid spec whose two ends the config accepts and which holds its
    option's default (the setting the range is centred on). An algorithm with options but no range
    tunes lr only, and tune says so; one without options has nothing of its own to tune."""
    from pfedkit.experiments.tuning import COMMON_SPACE, check_space, read_spaces, space_for

    hyper = get_algorithm(algorithm).Hyper
    declared = declared_ranges(hyper)
    space, note = space_for(read_spaces(), algorithm)
    assert set(space) == set(COMMON_SPACE) | {f"{algorithm}.{option}" for option in declared}
    assert (note is not None) == bool(hyper.model_fields and not declared)
    check_space(base_config(algorithm=algorithm), space, "shipped")  # ConfigError if a key or an end is refused
    for option in declared:
        spec, default = space[f"{algorithm}.{option}"], hyper.model_fields[option].default
        if spec.type == "categorical":
            assert default in spec.choices, (option, default, spec)
        else:
            assert spec.low <= default <= spec.high, (option, default, spec)


def test_a_space_file_replaces_every_shipped_range(tmp_path):
    """--space FILE is the whole space: an algorithm's declared ranges do not come back beside it."""
    from pfedkit.experiments.tuning import read_spaces, space_for

    space_file = tmp_path / "space.yaml"
    space_file.write_text("common:\n  lr: {type: float, low: 0.01, high: 0.1}\n"
                          "fedprox:\n  fedprox.mu: {type: float, low: 0.001, high: 0.1, log: true}\n")
    space, note = space_for(read_spaces(space_file), "fedprox")
    assert set(space) == {"lr", "fedprox.mu"} and note is None
    assert (space["lr"].low, space["fedprox.mu"].low) == (0.01, 0.001)
    space, note = space_for(read_spaces(space_file), "ditto")  # ditto.lam declares a range, not used here
    assert set(space) == {"lr"} and "no search space for ditto" in note


# ---- pruning and Flower --------------------------------------------------------------------------

def test_the_median_pruner_stops_a_trial_below_the_median_of_earlier_trials(tmp_path, monkeypatch):
    """The real MedianPruner: after PRUNER_STARTUP_TRIALS trials reporting 0.5 each round (stand-ins,
    for speed), a real simulation whose validation accuracy is reported as 0 is pruned at the first
    round the pruner may act on (its simulation stops there), and a next trial above the median
    completes."""
    from pfedkit.experiments import tuning

    space = tmp_path / "space.yaml"
    space.write_text("common:\n  lr: {type: categorical, choices: [0.05]}\n")
    real_run_trial, calls = tuning.run_trial, []
    hopeless = tuning.PRUNER_STARTUP_TRIALS  # the trial after the startup ones

    def run_trial(config, report):
        calls.append(config.rounds)
        if len(calls) == hopeless + 1:  # a real simulation, reported hopeless: stopped after round 1
            return real_run_trial(config, lambda rnd, accuracy: report(rnd, 0.0))
        value = 0.5 if len(calls) <= hopeless else 0.6  # the startup trials, then one above their median
        for rnd in range(1, config.rounds + 1):
            report(rnd, value)
        return value, None

    monkeypatch.setattr(tuning, "run_trial", run_trial)
    config = load_config({**BASE, "algorithm": "fedavg", "rounds": 4, "num_clients": 2})
    lines = []
    tune(config, hopeless + 2, tmp_path / "out", space, log=lines.append)
    study = optuna.load_study(study_name="fedavg", storage=f"sqlite:///{tmp_path / 'out' / 'fedavg' / STUDY_DB}")
    states = [trial.state.name for trial in study.get_trials()]
    assert states == ["COMPLETE"] * hopeless + ["PRUNED", "COMPLETE"]
    pruned = study.get_trials()[hopeless]
    assert sorted(pruned.intermediate_values) == [max(1, config.rounds // 4)]  # stopped there, not run to the end
    assert len(study.get_trials()[0].intermediate_values) == config.rounds
    assert any("pruned at round 1" in line for line in lines)
    assert study.get_trials()[-1].value == 0.6 and len(calls) == hopeless + 2


@pytest.mark.parametrize("command", ["simulate", "app"])
def test_flower_refuses_a_validation_split_in_one_line(tmp_path, capsys, command):
    pytest.importorskip("flwr")
    args = ["flower", command] + ([str(tmp_path / "app")] if command == "app" else [])
    code = main(args + ["dataset=digits", "num_clients=2", "validation_fraction=0.2", f"out_dir={tmp_path / 'runs'}"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and "validation_fraction" in err and "allowed" in err
    assert not (tmp_path / "runs").exists() and not (tmp_path / "app").exists()
    from pfedkit.core.errors import ConfigError
    from pfedkit.flower.server import serve

    with pytest.raises(ConfigError, match="validation_fraction"):  # a ServerApp started by hand refuses too
        serve(None, load_config({**BASE, "validation_fraction": 0.2}))
