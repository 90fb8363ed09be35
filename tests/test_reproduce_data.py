"""The papers' FEMNIST / CIFAR-100 tables: `reproduce PAPER --list` says whether each table's data is
present, and a FEMNIST cell runs end to end on a small synthetic femnist file (writers included)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from pfedkit.cli import main
from pfedkit.data import fetch as fetch_module
from pfedkit.experiments.paper_presets import load_paper
from pfedkit.experiments.reproduce import data_status, plan_table

RNG = np.random.default_rng(3)


def _install_femnist(root, per_class: int = 30, writers: int = 7):
    """A small femnist file in the fetched format: 62 classes, writer ids, no official test split."""
    y = np.repeat(np.arange(62, dtype=np.uint8), per_class)
    arrays = {"x": RNG.integers(0, 256, (len(y), 28, 28), dtype=np.uint8), "y": y, "test": np.zeros(len(y), bool),
              "writer": RNG.integers(0, writers, len(y)).astype(np.int32),
              "writer_names": np.array([f"f{w:04d}_00" for w in range(writers)])}
    (root / "femnist").mkdir(parents=True)
    (root / "femnist" / "femnist.npz.xz").write_bytes(fetch_module._encode(arrays))
    return arrays


def test_list_names_the_fetch_command_for_missing_data(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PFEDKIT_DATA", str(tmp_path))
    assert main(["reproduce", "dapfl", "--list"]) == 0
    out = capsys.readouterr().out
    assert "--table 2: Table II" in out and "--table 3: Table III" in out
    assert "data: cifar100 missing -> pfedkit data fetch cifar100" in out  # cifar100_first20 reads cifar100
    assert "data: femnist missing -> pfedkit data fetch femnist" in out
    assert "(not rebuilt) 3:" not in out and "(not rebuilt) 2:" not in out

    _install_femnist(tmp_path)
    assert main(["reproduce", "pfedpm", "--list", f"data_dir={tmp_path}"]) == 0
    out = capsys.readouterr().out
    assert "data: femnist present" in out and "data: mnist missing -> pfedkit data fetch mnist" in out
    assert "(not rebuilt) 1-femnist" not in out


def test_data_status_per_table(tmp_path):
    paper = load_paper("dapfl")
    tables = {table.id: table for table in paper.tables}
    assert data_status(paper, tables["3"], str(tmp_path)) == "data: femnist missing -> pfedkit data fetch femnist"
    _install_femnist(tmp_path)
    assert data_status(paper, tables["3"], str(tmp_path)) == "data: femnist present"


def test_femnist_presets_express_the_papers_settings():
    pfedpm = load_paper("pfedpm")
    plan = plan_table(pfedpm, pfedpm.table("1-femnist"), "paper")
    cell = next(e.config for e in plan.entries if e.label == "pFedPM" and e.group == "n=3")
    assert cell["dataset"] == "femnist" and cell["model"] == "cnn_proto" and cell["model_options"] == {"kernel": 3}
    assert cell["partition"]["test_split"] == "per_client" and cell["partition"]["scheme"] == "nway_kshot"
    assert cell["rounds"] == 120 and cell["pfedpm"]["a"] == 0.6
    dapfl = load_paper("dapfl")
    plan = plan_table(dapfl, dapfl.table("3"), "paper")
    cell = next(e.config for e in plan.entries if e.label == "DA-PFL" and e.group.startswith("100 clients, high"))
    assert (cell["dataset"], cell["model"], cell["lr"], cell["num_clients"]) == ("femnist_lower10", "mlp", 0.01, 100)
    assert cell["partition"]["train_ratio"] == 0.9 and cell["partition"]["alpha"] == 0.5
    plan = plan_table(dapfl, dapfl.table("2"), "paper")
    cell = plan.entries[0].config
    assert (cell["dataset"], cell["model"], cell["lr"]) == ("cifar100_first20", "cnn_cifar100", 0.001)


@pytest.mark.parametrize("extra", [["partition.scheme=natural", "num_clients=5", "model=mlp"],
                                   ["preset_cell"]])
def test_femnist_runs_end_to_end(extra, tmp_path, capsys):
    arrays = _install_femnist(tmp_path / "data")
    if extra == ["preset_cell"]:  # the pFedPM FEMNIST cell at its smoke budget, on 20 clients
        paper = load_paper("pfedpm")
        plan = plan_table(paper, paper.table("1-femnist"), "smoke")
        cell = next(e.config for e in plan.entries if e.label == "pFedPM" and e.group == "n=3")
        cell = {**cell, "rounds": 1, "backend": "sequential"}
        (tmp_path / "cell.yaml").write_text(json.dumps(cell))
        extra = [str(tmp_path / "cell.yaml")]
    args = ["run", "-q", *extra, "dataset=femnist", "rounds=1", f"data_dir={tmp_path / 'data'}",
            f"out_dir={tmp_path / 'runs'}", "name=r"]
    assert main(args) == 0, capsys.readouterr().err
    with np.load(tmp_path / "runs" / "r" / "partition.npz") as saved:
        count = int(saved["num_clients"])
        trains = [saved[f"train_{c}"] for c in range(count)]
    if "partition.scheme=natural" in extra:
        assert count == 5
        for part in trains:
            assert len(np.unique(arrays["writer"][part])) == 1, "natural: each client is one writer"
    assert len(np.unique(np.concatenate(trains))) == sum(len(t) for t in trains)
