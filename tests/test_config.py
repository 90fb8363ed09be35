"""Configuration: overrides, YAML files, and every bad-config case ending with exit 2, a message
naming the key, and no run directory."""
from __future__ import annotations

import pytest
import yaml

from pfedkit.cli import main
from pfedkit.config import load_config, parse_overrides
from pfedkit.core.errors import ConfigError


def test_overrides_are_typed_and_nested():
    tree = parse_overrides(["lr=0.1", "rounds=3", "drop_last=true", "partition.alpha=0.3", "fedprox.mu=1"])
    assert tree == {"lr": 0.1, "rounds": 3, "drop_last": True, "partition": {"alpha": 0.3}, "fedprox": {"mu": 1}}


def test_yaml_file_plus_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"algorithm": "fedprox", "rounds": 7, "partition": {"scheme": "iid"},
                                    "fedprox": {"mu": 0.5}}))
    config = load_config(path, ["rounds=9", "fedprox.mu=0.25"])
    assert config.rounds == 9 and config.partition.scheme == "iid"
    assert config.hyper().mu == 0.25


def test_resolved_config_contains_algorithm_defaults():
    data = load_config({"algorithm": "fedprox"}).to_dict()
    assert data["fedprox"] == {"mu": 0.01}


BAD_CASES = [
    (["partition.alpha=0"], "partition.alpha"),
    (["partition.alpha=-1"], "partition.alpha"),
    (["partition.scheme=pathological", "partition.classes_per_client=11"], "partition.classes_per_client"),
    (["num_clients=5000"], "num_clients"),
    (["algorithm=nosuch"], "algorithm"),
    (["dataset=nosuch"], "dataset"),
    (["model=nosuch"], "model"),
    (["colour=blue"], "colour"),
    (["partition.colour=blue"], "partition.colour"),
    (["fedprox.mu=-1"], "fedprox.mu"),
    (["algorithm=fedprox", "fedprox.nu=1"], "fedprox.nu"),
    (["rounds=0"], "rounds"),
    (["join_ratio=1.5"], "join_ratio"),
    (["backend=gpu"], "backend"),
    (["lr"], "lr"),
    (['client_model_options={"0-3": {}}'], "client_model_options: algorithm fedavg averages"),
    (["algorithm=local", 'client_model_options={"0-5": {}, "5-9": {}}'], "client_model_options.5-9"),
    (["algorithm=local", 'client_model_options={"3-12": {}}'], "client_model_options.3-12"),
    (["algorithm=local", 'client_model_options={"a-b": {}}'], "client_model_options.a-b"),
    (["algorithm=local", 'client_model_options={"6-2": {}}'], "client_model_options.6-2"),
    # algorithm options checked against the model and clients (Algorithm.check), before the run directory
    (["algorithm=cwfedavg", "cwfedavg.class_wise_layers=9"], "cwfedavg.class_wise_layers: 9 but MLP has only 3"),
    (["algorithm=pfedcs", "num_clients=1"], "pfedcs.beta"),
    (["algorithm=fedrema", "fedrema.variant=AF"], "fedrema.variant=AF"),
    (["algorithm=fedrema", "fedrema.head_epochs=2"], "fedrema.head_epochs=2"),
    (["preset=nope"], "preset: unknown preset 'nope'"),
    (["participants=ceil"], "participants"),
]


@pytest.mark.parametrize("overrides,key", BAD_CASES, ids=[c[1] + "-" + "-".join(c[0])[:30] for c in BAD_CASES])
def test_bad_config_exits_2_names_key_and_creates_no_run_directory(overrides, key, tmp_path, capsys):
    out = tmp_path / "runs"
    status = main(["run", "-q", *overrides, f"out_dir={out}"])
    err = capsys.readouterr().err.strip()
    assert status == 2
    assert len(err.splitlines()) == 1 and err.startswith("error: ")
    assert key in err
    assert not out.exists()


def test_impossible_partition_exits_2_without_run_directory(tmp_path, capsys):
    out = tmp_path / "runs"
    status = main(["run", "-q", "num_clients=200", "partition.alpha=0.01", "partition.least=40", f"out_dir={out}"])
    assert status == 2
    assert "least" in capsys.readouterr().err
    assert not out.exists()


def test_missing_config_file_is_reported(tmp_path, capsys):
    assert main(["run", str(tmp_path / "nope.yaml")]) == 2
    assert "nope.yaml" in capsys.readouterr().err


def test_config_error_is_one_line():
    with pytest.raises(ConfigError) as err:
        load_config({"rounds": -1, "lr": 0})
    assert "\n" not in str(err.value) and "rounds" in str(err.value) and "lr" in str(err.value)


def test_pfllib_preset_sets_pfllib_values_and_overrides_win():
    config = load_config(None, ["preset=pfllib", "lr=0.02"])
    assert (config.drop_last, config.participants, config.partition.stratified, config.keep_optimizer_state) == \
        (True, "floor", False, True)
    assert config.lr == 0.02 and config.batch_size == 10
    assert load_config(None, ["preset=pfllib"]).lr == 0.005
    assert load_config(None, ["preset=pfllib", "partition.alpha=0.1"]).partition.stratified is False  # merged


def test_participant_rounding_round_or_floor():
    from pfedkit.core.seeds import sample_clients
    assert len(sample_clients(0, 1, 20, 0.33)) == 7 and len(sample_clients(0, 1, 20, 0.33, "floor")) == 6
    assert len(sample_clients(0, 1, 10, 0.15)) == 2 and len(sample_clients(0, 1, 10, 0.15, "floor")) == 1
    assert len(sample_clients(0, 1, 10, 0.05, "floor")) == 1  # at least one
    floor = sample_clients(3, 2, 20, 0.33, "floor")
    assert floor == sorted(set(floor)) and all(0 <= c < 20 for c in floor)


def test_list_shows_every_algorithms_options_with_defaults(capsys):
    from pfedkit.algorithms import algorithm_names, get_algorithm

    assert main(["list"]) == 0
    listing = capsys.readouterr().out
    for name in algorithm_names():
        for key, field in get_algorithm(name).Hyper.model_fields.items():
            assert f"{key}={field.default}" in listing, (name, key)
    assert main(["list", "ditto"]) == 0
    detail = capsys.readouterr().out
    assert "ditto.lam=1.0" in detail and "proximal" in detail
    assert "(tune: [0.01, 10] log)" in detail and "ditto.personal_epochs" in detail  # the range declared on lam
    assert main(["list", "pfedme"]) == 0
    detail = capsys.readouterr().out
    assert "(tune: {1, 2})" in detail and "(tune: [1, 30] log)" in detail
    assert main(["list", "pfedcs"]) == 0
    assert "(tune: 1..5)" in capsys.readouterr().out
    assert main(["list", "nosuch"]) == 2
