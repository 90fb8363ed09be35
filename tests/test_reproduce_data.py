"""The papers' FEMNIST / CIFAR-100 tables: `reproduce PAPER --list` says whether each table's data is
present, and a FEMNIST cell runs end to end on a small synthetic femnist file (writers included)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from pfedkit.cli import main
from pfedkit.data.store import encode_xz
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
    (root / "femnist" / "femnist.npz.xz").write_bytes(encode_xz(arrays))
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


# ---------------------------------------------------------------------------------------------
# cwFedAvg / PFedCS tables on fetched data (CIFAR-100, Tiny-ImageNet, AG News)
# ---------------------------------------------------------------------------------------------

FETCHED_TABLES = {  # (paper, table): the files it reads
    ("cwfedavg", "1-cifar100"): ["cifar100"], ("cwfedavg", "1-tiny"): ["tiny_imagenet"],
    ("cwfedavg", "2"): ["cifar100"], ("cwfedavg", "3-cifar100-tiny"): ["cifar100", "tiny_imagenet"],
    ("cwfedavg", "4"): ["cifar100", "tiny_imagenet"], ("cwfedavg", "6"): ["ag_news"],
    ("pfedcs", "1-cifar100"): ["cifar100"], ("pfedcs", "1-tiny"): ["tiny_imagenet"],
    ("pfedcs", "2-cifar100"): ["cifar100"], ("pfedcs", "2-tiny"): ["tiny_imagenet"],
    ("pfedcs", "3"): ["cifar100"], ("pfedcs", "4-cifar100"): ["cifar100"],
    ("pfedcs", "4-tiny"): ["tiny_imagenet"], ("pfedcs", "5"): ["cifar100"],
}


def _install_cifar100(root, per_class: int = 4):
    """A small cifar100 file in the fetched format (N, 32, 32, 3) uint8, 100 fine labels, a class
    pattern plus noise so that the CNN has something to learn."""
    y = np.repeat(np.arange(100, dtype=np.uint8), per_class)
    x = (np.arange(100, dtype=np.uint8)[:, None, None, None] * 2 + RNG.integers(0, 8, (100, 32, 32, 3), dtype=np.uint8))
    x = np.repeat(x, per_class, axis=0)
    test = np.tile(np.arange(per_class) >= per_class - 1, 100)  # 1 official test image a class
    (root / "cifar100").mkdir(parents=True)
    (root / "cifar100" / "cifar100.npz.xz").write_bytes(encode_xz({"x": x, "y": y, "test": test}))


def _install_ag_news(root, per_class: int = 40):
    """A small ag_news file in the fetched format: token ids (N, 200) int32, topic words per class."""
    from pfedkit.data import text

    vocab = ["<pad>", "<unk>"] + [f"w{i}" for i in range(40)]
    y = np.repeat(np.arange(4, dtype=np.uint8), per_class)
    x = np.zeros((len(y), text.MAX_LENGTH), np.int32)
    for row, label in enumerate(y):  # 12 words from the class's own ten (ids 2 + 10 * label ...)
        x[row, :12] = 2 + 10 * int(label) + RNG.integers(0, 10, 12)
    arrays = {"x": x, "y": y, "test": np.tile(np.arange(per_class) >= per_class - 5, 4),
              "vocab": np.array(vocab, dtype=str), "class_names": np.array(["World", "Sports", "Business", "Sci/Tech"])}
    (root / "ag_news").mkdir(parents=True)
    (root / "ag_news" / "ag_news.npz.xz").write_bytes(encode_xz(arrays))


def test_fetched_data_tables_are_ordinary_tables_that_name_their_fetch(tmp_path, monkeypatch, capsys):
    for (name, table_id), files in FETCHED_TABLES.items():
        paper = load_paper(name)
        table = paper.table(table_id)  # an ordinary table (ConfigError for an unavailable one)
        assert {"smoke", "cpu"} <= set(paper.budget_names(table)), (name, table_id)
        status = data_status(paper, table, str(tmp_path))
        assert status == "data: " + "; ".join(f"{f} missing -> pfedkit data fetch {f}" for f in files), status
        assert f"pfedkit data fetch {files[0]}" in table.caption  # the caption says it too
    monkeypatch.setenv("PFEDKIT_DATA", str(tmp_path))
    for name in ("cwfedavg", "pfedcs"):
        assert main(["reproduce", name, "--list"]) == 0
        out = capsys.readouterr().out
        for (paper_name, table_id), files in FETCHED_TABLES.items():
            if paper_name == name:
                assert f"--table {table_id}: " in out and f"(not rebuilt) {table_id}:" not in out
                assert f"data: {files[0]} missing -> pfedkit data fetch {files[0]}" in out
    _install_cifar100(tmp_path)
    paper = load_paper("cwfedavg")
    assert data_status(paper, paper.table("3-cifar100-tiny"), str(tmp_path)) == \
        "data: cifar100 present; tiny_imagenet missing -> pfedkit data fetch tiny_imagenet"


def test_fetched_data_tables_express_the_papers_settings():
    cwfedavg = load_paper("cwfedavg")
    cells = {(e.label, e.group): e.config for e in plan_table(cwfedavg, cwfedavg.table("1-cifar100"), "paper").entries}
    cell = cells[("cwFedAvg (Output)", "pathological")]
    assert (cell["dataset"], cell["model"], cell["num_clients"], cell["rounds"], cell["lr"]) == ("cifar100", "cnn", 20, 1000, 0.005)
    assert cell["partition"]["classes_per_client"] == 10 and cell["cwfedavg"]["wdr_lambda"] == 1000
    assert cells[("IFCA", "practical")]["ifca"]["k"] == 8 and cells[("IFCA", "practical")]["partition"]["alpha"] == 0.1
    cells = {(e.label, e.group): e.config for e in plan_table(cwfedavg, cwfedavg.table("1-tiny"), "paper").entries}
    resnet = cells[("cwFedAvg (Output)", "Tiny ImageNet* (ResNet-18)")]
    assert (resnet["model"], resnet["model_options"], resnet["cwfedavg"]["wdr_lambda"]) == ("resnet18", {"stem": "imagenet"}, 2000)
    cells = {e.label: e.config for e in plan_table(cwfedavg, cwfedavg.table("4"), "paper").entries if e.group == "CIFAR-100"}
    assert (cells["empirical p, no WDR"]["cwfedavg"]["distribution"], cells["empirical p, no WDR"]["cwfedavg"]["wdr"]) == ("empirical", False)
    assert cells["p~ with WDR"]["cwfedavg"]["class_wise_layers"] == "all"
    text_cell = plan_table(cwfedavg, cwfedavg.table("6"), "paper").entries[-1].config
    assert (text_cell["dataset"], text_cell["model"], text_cell["algorithm"]) == ("ag_news", "fasttext", "cwfedavg")
    pfedcs = load_paper("pfedcs")
    cells = {(e.label, e.group): e.config for e in plan_table(pfedcs, pfedcs.table("2-tiny"), "paper").entries}
    cell = cells[("PFedCS", "alpha=0.01")]
    assert (cell["dataset"], cell["model"], cell["lr"], cell["local_epochs"], cell["batch_size"]) == \
        ("tiny_imagenet", "resnet18", 0.1, 5, 100)
    for table in pfedcs.tables:  # every Tiny-ImageNet cell: ResNet-18 at eta_w = 0.1; CIFAR: the CNN at 0.005
        for entry in plan_table(pfedcs, table, "paper").entries:
            tiny = entry.config["dataset"] == "tiny_imagenet"
            assert (entry.config["model"], entry.config["lr"]) == (("resnet18", 0.1) if tiny else ("cnn", 0.005)), \
                (table.id, entry.label)
    rhos = [e.config["pfedcs"]["rho"] for e in plan_table(pfedcs, pfedcs.table("5"), "paper").entries]
    assert rhos == [0, 1, 2, 3, 5, 10]
    # Table 3: only the rows pfedkit implements run
    assert [e.label for e in plan_table(pfedcs, pfedcs.table("3"), "smoke").entries][:2] == ["FedPer", "Adaptive Selection (PFedCS)"]


def _run_smoke_table(paper_name, table_id, rows, data_dir, out, extra=()):
    """The table's smoke budget, its cells limited to `rows` (to keep the test short), run through
    the same run_plan as `pfedkit reproduce`; returns the paper-beside-ours frame."""
    import dataclasses

    from pfedkit.experiments.reproduce import run_plan

    paper = load_paper(paper_name)
    plan = plan_table(paper, paper.table(table_id), "smoke", [f"data_dir={data_dir}", *extra])
    plan = dataclasses.replace(plan, entries=[e for e in plan.entries if e.label in rows])
    assert {e.label for e in plan.entries} == set(rows)
    return plan, run_plan(plan, out)


@pytest.mark.usefixtures("one_torch_thread")
def test_a_cifar100_table_runs_end_to_end_at_the_smoke_budget(tmp_path):
    _install_cifar100(tmp_path / "data")
    # the synthetic file is 1/150 of CIFAR-100: the smoke budget's 2 % pool would leave 8 images;
    # batch 50 instead of 10 keeps the test short (this checks the table runs, not what it learns)
    plan, frame = _run_smoke_table("cwfedavg", "1-cifar100", ["FedAvg", "cwFedAvg (Output)"], tmp_path / "data",
                                   tmp_path / "out", ["partition.pool_fraction=1.0", "batch_size=50"])
    assert len(plan.entries) == 4 and all(e.config["rounds"] == 2 and e.config["num_clients"] == 4 for e in plan.entries)
    summaries = sorted((tmp_path / "out").rglob("summary.json"))
    assert len(summaries) == 4
    for path in summaries:
        summary = json.loads(path.read_text())
        assert summary["dataset"] == "cifar100" and 0.0 <= summary["best_acc"] <= 1.0
    with np.load(next((tmp_path / "out").rglob("partition.npz"))) as saved:
        assert int(saved["num_clients"]) == 4
    assert "cwFedAvg (Output)" in frame.to_string() and "67.50" in frame.to_string()


@pytest.mark.usefixtures("one_torch_thread")
def test_the_ag_news_table_runs_end_to_end_at_the_smoke_budget(tmp_path):
    _install_ag_news(tmp_path / "data")
    plan, frame = _run_smoke_table("cwfedavg", "6", ["FedAvg", "cwFedAvg"], tmp_path / "data", tmp_path / "out",
                                   ["partition.pool_fraction=1.0"])
    summaries = [json.loads(p.read_text()) for p in sorted((tmp_path / "out").rglob("summary.json"))]
    assert len(summaries) == 2 and {s["model"] for s in summaries} == {"fasttext"}
    assert "98.19" in frame.to_string()


def test_reproduce_stops_before_anything_when_the_data_is_missing(tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["reproduce", "pfedcs", "--table", "2-tiny", "--budget", "smoke", "--out", str(out),
            f"data_dir={tmp_path / 'data'}"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"error: reproduce pfedcs --table 2-tiny: data tiny_imagenet not in {tmp_path / 'data'}; "
                   "get it with pfedkit data fetch tiny_imagenet --data-dir DIR")
    assert not out.exists()
    # an override that swaps the dataset is what counts (here: to data that is present)
    _install_cifar100(tmp_path / "data")
    from pfedkit.experiments.reproduce import check_data

    paper = load_paper("pfedcs")
    check_data(plan_table(paper, paper.table("2-tiny"), "smoke", [f"data_dir={tmp_path / 'data'}", "dataset=cifar100"]))
