"""One setting, one meaning, whichever spelling: `data fetch NAME data_dir=DIR` and `--data-dir`,
`tune --algorithms` and `--algorithm` (several tuned in turn), `bench rounds=N num_clients=N`
and `--rounds/--clients`; and `pfedkit config`, every config key with its
default and description, read from the Config itself."""
from __future__ import annotations

import argparse
import json
import re
from typing import Literal

import pytest
from pydantic import BaseModel, Field

from pfedkit.cli import BENCH_DEFAULTS, BENCH_FLAGS, flag_settings, main
from pfedkit.config import Config, config_keys


def _fields(model: type[BaseModel], prefix: str = "") -> dict[str, object]:
    """Every (dotted) key of `model` and its default, sections expanded."""
    found = {}
    for name, field in model.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            found |= _fields(field.annotation, f"{prefix}{name}.")
        else:
            found[prefix + name] = field.get_default(call_default_factory=True)
    return found


def test_pfedkit_config_lists_every_key_of_the_config_with_its_default(capsys):
    assert main(["config"]) == 0
    out = capsys.readouterr().out
    keys = _fields(Config)
    assert len(keys) > 70 and "dp.target_epsilon" in keys and "partition.alpha" in keys
    for key, default in keys.items():
        assert re.search(rf"^  {re.escape(f'{key}={default}')} ", out, re.M), key


def test_every_config_key_has_a_description():
    assert [key for key, _, description in config_keys() if not description] == []


def test_a_new_key_and_its_choices_are_listed_without_other_change():
    class Section(BaseModel):
        mode: Literal["fast", "exact"] = Field("fast", description="how")

    class Model(BaseModel):
        colour: str = Field("red", description="the colour")
        section: Section = Field(default_factory=Section)
        limit: int | None = None

    assert config_keys(Model) == [("colour", "red", "the colour"), ("section.mode", "fast", "one of fast, exact; how"),
                                  ("limit", "None", "")]


def test_config_shows_one_section_and_refuses_an_unknown_one(capsys):
    assert main(["config", "dp"]) == 0
    lines = capsys.readouterr().out.splitlines()[1:]
    assert lines and all(line.startswith(("  dp.", " " * 10)) for line in lines)
    assert main(["config", "dpp"]) == 2
    assert "did you mean dp?" in capsys.readouterr().err


def test_run_help_points_at_the_keys(capsys):
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    assert "pfedkit config" in capsys.readouterr().out


def test_data_fetch_takes_data_dir_as_a_setting_too(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("PFEDKIT_DATA", raising=False)
    (tmp_path / "mnist").mkdir()
    (tmp_path / "mnist" / "mnist.npz.xz").write_bytes(b"already here")  # present: nothing is downloaded
    assert main(["data", "fetch", "mnist", f"data_dir={tmp_path}", "-q"]) == 0
    assert "already present" in capsys.readouterr().err
    assert main(["data", "fetch", "mnist", f"data_dir={tmp_path}", "--data-dir", str(tmp_path / "other")]) == 2
    assert "two values for one setting" in capsys.readouterr().err
    assert main(["data", "fetch", "mnist", "colour=red"]) == 2
    assert "allowed: data_dir=DIR" in capsys.readouterr().err


def _bench_namespace(**given) -> argparse.Namespace:
    return argparse.Namespace(**{dest: None for dest in BENCH_FLAGS.values()} | given)


def test_bench_keys_set_its_flags():
    ns = _bench_namespace(rounds=None, clients=None)
    rest = flag_settings(ns, ["rounds=5", "num_clients=7", "partition.alpha=0.3", "channels_last=false"],
                         BENCH_FLAGS, BENCH_DEFAULTS)
    assert (ns.rounds, ns.clients, ns.alpha) == (5, 7, 0.3) and rest == ["channels_last=false"]
    assert (ns.dataset, ns.backend, ns.compile) == ("mnist", "sequential", False)  # the defaults


def test_bench_refuses_two_values_for_one_setting(capsys):
    assert main(["bench", "--rounds", "2", "rounds=1"]) == 2
    assert "rounds=1 and --rounds 2: two values for one setting" in capsys.readouterr().err


def test_bench_reports_the_settings_given_as_keys(capsys):
    assert main(["bench", "--dataset", "digits", "rounds=1", "num_clients=3", "threads=1"]) == 0
    result = json.loads(next(line for line in capsys.readouterr().out.splitlines() if line.startswith("{")))
    assert (result["rounds"], result["clients"], result["dataset"]) == (1, 3, "digits")


def test_tune_tunes_each_of_several_algorithms(tmp_path, capsys):
    base = ["rounds=1", "num_clients=3", "threads=1", "local_epochs=1"]
    assert main(["tune", "--algorithms", "fedavg,local", "--trials", "1", "--out", str(tmp_path), *base]) == 0
    out = capsys.readouterr().out
    assert (tmp_path / "fedavg" / "best.yaml").is_file() and (tmp_path / "local" / "best.yaml").is_file()
    assert "fedavg: best of 1 trials" in out and "local: best of 1 trials" in out


def test_tune_without_a_flag_tunes_the_configs_algorithm(tmp_path):
    assert main(["tune", "--trials", "1", "--out", str(tmp_path), "algorithm=local", "rounds=1", "num_clients=3",
                 "threads=1"]) == 0
    assert [path.name for path in tmp_path.iterdir() if path.is_dir()] == ["local"]

