"""`pfedkit reproduce`: the paper preset files, the table beside the paper, and the smoke budget."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from pfedkit.cli import main
from pfedkit.core.errors import ConfigError
from pfedkit.experiments.comparison import Entry, RunRecord, plan_runs, run_name
from pfedkit.experiments.paper_presets import (PAPERS, Budget, PaperSays, PaperValue, Table, check_paper, load_paper,
                                               quotes_not_in_text, regime_against_paper)
from pfedkit.experiments.reproduce import NOT_IMPLEMENTED, Plan, paper_markdown, paper_table, plan_table

from conftest import SHARED_DATASETS, needs_dataset

PAPERS_TEXT = SHARED_DATASETS.parent / "papers"  # ../shared/papers: each preset's `file`

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ---- the table beside the paper (synthetic records) -------------------------------------------

def synthetic_table() -> Table:
    return Table(id="1", source="Table 1", caption="test", metric="best_acc", seeds=2,
                 columns=[{"name": "A"}, {"name": "B"}],
                 rows=[{"method": "M1", "algorithm": "fedavg", "paper": ["90.0±1.0", 80.0]},
                       {"method": "M2", "algorithm": "local", "paper": [85.0, 85.0]},
                       {"method": "M3", "algorithm": "fedprox", "paper": [70.0, None]},
                       {"method": "M4", "algorithm": None, "paper": [95.0, 95.0]}])


def record(column: str, method: str, seed: int, best: float) -> RunRecord:
    return RunRecord(Entry(method, {}, group=column), seed, Path("."), {"best_acc": best})


def test_paper_table_puts_our_seed_mean_beside_the_paper():
    records = [record("A", "M1", 0, 0.80), record("A", "M1", 1, 0.84), record("A", "M2", 0, 0.90),
               record("A", "M2", 1, 0.90), record("A", "M3", 0, 0.60), record("A", "M3", 1, 0.62),
               record("B", "M1", 0, 0.70), record("B", "M2", 0, 0.75), record("B", "M3", 0, 0.5)]
    frame = paper_table(synthetic_table(), records).set_index(["column", "method"])
    m1 = frame.loc[("A", "M1")]
    assert (m1["ours"], m1["ours_std"], m1["paper"], m1["paper_std"]) == pytest.approx((82.0, 2.0, 90.0, 1.0))
    assert m1["diff"] == pytest.approx(-8.0)
    # column A: paper order M1 > M2 > M3, ours M2 > M1 > M3 -> M1 and M2 flagged, M3 not
    assert frame.loc[("A", "M1"), "rank_ours"] == 2 and frame.loc[("A", "M1"), "rank_paper"] == 1
    assert frame.loc[("A", "M1"), "order_differs"] and frame.loc[("A", "M2"), "order_differs"]
    assert not frame.loc[("A", "M3"), "order_differs"]
    assert frame.loc[("A", "M1"), "kendall_tau"] == pytest.approx(1 / 3)
    # column B: M3 has no paper number, so it is not ranked; M1 < M2 in both orders
    assert np.isnan(frame.loc[("B", "M3"), "rank_ours"]) and not frame.loc[("B", "M3"), "order_differs"]
    assert not frame.loc[("B", "M1"), "order_differs"] and frame.loc[("B", "M1"), "kendall_tau"] == pytest.approx(1)
    # an unimplemented method keeps its line and the paper's number
    m4 = frame.loc[("A", "M4")]
    assert m4["status"] == NOT_IMPLEMENTED and m4["paper"] == 95.0 and np.isnan(m4["ours"])


@pytest.mark.parametrize("text, mean, std", [("98.4±0.2%", 98.4, 0.2), ("65.40", 65.4, None),
                                              (" 61.9 ± 0.6 ", 61.9, 0.6), (88, 88.0, None)])
def test_paper_values_parse_as_printed(text, mean, std):
    value = PaperValue.parse(text)
    assert (value.mean, value.std) == (mean, std)


def test_a_table_needs_one_value_per_column():
    with pytest.raises(ValueError, match="2 paper values for 1 columns"):
        Table(id="x", source="s", caption="c", metric="best_acc", columns=[{"name": "A"}],
              rows=[{"method": "M", "algorithm": "fedavg", "paper": [1, 2]}])


def test_unknown_paper_and_table_are_config_errors():
    with pytest.raises(ConfigError, match="allowed: fedrema"):
        load_paper("fedfoo")


# ---- the shipped paper files -----------------------------------------------------------------

@pytest.mark.parametrize("name", PAPERS)
def test_every_cell_of_every_budget_is_a_valid_config(name):
    paper = load_paper(name)
    assert paper.tables and check_paper(paper) == []
    assert paper.budget(paper.tables[0], "cpu").reduced  # a cpu budget says what it cut


def paper_number(name: str, table_id: str, method: str, column: str):
    paper = load_paper(name)
    table = paper.table(table_id)
    index = [c.name for c in table.columns].index(column)
    (row,) = [r for r in table.rows if r.method == method]
    value = row.values()[index]
    return value.mean, value.std


# Typed again from the papers' text (not copied from the preset files).
RETYPED = [
    ("fedrema", "1-mnist", "FedAvg", "MNIST", 98.4, 0.1),
    ("fedrema", "1-cifar10", "FedReMa", "CIFAR-10", 65.4, 0.3),
    ("fedrema", "2", "FedAvg", "s=0.8", 45.4, 1.3),
    ("cwfedavg", "1-mnist", "FedAMP", "pathological", 99.26, 0.01),
    ("cwfedavg", "1-cifar10", "FedAvg", "pathological", 60.68, 0.84),
    ("cwfedavg", "1-cifar10", "cwFedAvg (Output)", "practical", 88.65, 0.19),
    ("pfedpm", "1-mnist", "Local", "n=3", 94.05, 2.93),
    ("pfedpm", "1-mnist", "pFedPM", "n=3", 98.50, 0.42),
    ("dapfl", "1", "DA-PFL", "20 clients, low imbalance (alpha=1)", 61.88, None),
    ("dapfl", "1", "FedAMP", "100 clients, high imbalance (alpha=0.5)", 59.48, None),
    ("pfedcs", "2-cifar10", "PFedCS", "alpha=0.1", 91.56, None),
    ("pfedcs", "2-cifar10", "FedAvg", "alpha=0.01", 39.53, None),
    ("pfedcs", "1-cifar10", "PFedCS", "C=2", 90.60, None),
]


@pytest.mark.parametrize("name, table_id, method, column, mean, std", RETYPED)
def test_stored_paper_numbers_match_the_papers(name, table_id, method, column, mean, std):
    assert paper_number(name, table_id, method, column) == (pytest.approx(mean), std)


def test_plan_validates_and_counts_cells():
    paper = load_paper("cwfedavg")
    table = paper.table("1-mnist")
    plan = plan_table(paper, table, "cpu", ["backend=sequential"])
    implemented = [r for r in table.rows if r.algorithm is not None]
    assert len(plan.entries) == len(implemented) * len(table.columns)
    assert len(plan.seeds) == paper.budget(table, "cpu").seeds
    assert all(e.config["backend"] == "sequential" for e in plan.entries)  # overrides apply last


# The CIFAR-10 tables (PFedCS: 39 runs, DA-PFL: 40 runs) take a few minutes even at the smoke budget.
SMOKE = [pytest.param(name, marks=pytest.mark.slow) if name in ("pfedcs", "dapfl") else name for name in PAPERS]


@pytest.mark.skipif(not SHARED_DATASETS.is_dir(), reason="../shared/datasets not present")
@pytest.mark.parametrize("name", SMOKE)
def test_smoke_budget_produces_the_table_beside_the_paper(name, tmp_path, capsys):
    table = load_paper(name).tables[0]
    out = tmp_path / name
    assert main(["reproduce", name, "--table", table.id, "--budget", "smoke", "--out", str(out), "-q",
                 f"data_dir={SHARED_DATASETS}"]) == 0
    result = pd.read_csv(out / "paper.csv")
    assert len(result) == len(table.rows) * len(table.columns)
    typed = [value is not None for row in table.rows for value in row.paper]
    by_cell = result.set_index(["column", "method"])
    for column_index, column in enumerate(table.columns):
        for row in table.rows:
            line = by_cell.loc[(column.name, row.method)]
            assert pd.notna(line["paper"]) == (row.paper[column_index] is not None)
            if row.algorithm is None:
                assert line["status"] == NOT_IMPLEMENTED
            else:
                assert 0 <= line["ours"] <= 100 and line["seeds"] == 1
    assert any(typed)
    assert table.source in capsys.readouterr().out


def test_a_spread_over_clients_is_shown_as_ours_over_clients():
    table = synthetic_table().model_copy(update={"spread": "clients"})
    records = [RunRecord(Entry("M1", {}, group="A"), seed, Path("."), {"best_acc": best, "final_acc_std": spread})
               for seed, best, spread in ((0, 0.8, 0.10), (1, 0.9, 0.20))]
    line = paper_table(table, records).set_index(["column", "method"]).loc[("A", "M1")]
    assert (line["ours"], line["ours_std"]) == pytest.approx((85.0, 15.0))


def test_the_table_shows_each_methods_steps_a_round_and_how_far_its_last_rounds_moved():
    """Means over seeds: steps of the runs' means (range over all), the move of the metric's
    weighting in points; a summary from before these facts shows `-`."""
    def facts(seed: int, steps: tuple, last: float, prev: float) -> RunRecord:
        return RunRecord(Entry("M1", {}, group="A"), seed, Path("."), {
            "best_acc_unweighted": 0.9, "train_steps_mean": steps[0], "train_steps_min": steps[1],
            "train_steps_max": steps[2], "last10_acc_unweighted": last, "prev10_acc_unweighted": prev,
            "last10_acc": 0.5, "prev10_acc": 0.1})
    table = synthetic_table().model_copy(update={"metric": "best_acc_unweighted"})
    records = [facts(0, (100.0, 40, 200), 0.90, 0.88), facts(1, (120.0, 60, 150), 0.85, 0.86),
               RunRecord(Entry("M2", {}, group="A"), 0, Path("."), {"best_acc_unweighted": 0.8})]
    frame = paper_table(table, records).set_index(["column", "method"])
    m1 = frame.loc[("A", "M1")]
    assert (m1["steps"], m1["steps_min"], m1["steps_max"]) == (110.0, 40, 200)
    assert m1["moved"] == pytest.approx((2.0 + 1.0) / 2)  # |0.90 - 0.88| and |0.85 - 0.86|, unweighted
    assert np.isnan(frame.loc[("A", "M2"), "moved"]) and np.isnan(frame.loc[("A", "M2"), "steps"])
    weighted = synthetic_table().model_copy(update={"metric": "best_acc"})
    for r in records[:2]:
        r.summary["best_acc"] = 0.9
    assert paper_table(weighted, records).set_index(["column", "method"]).loc[("A", "M1"), "moved"] == \
        pytest.approx(40.0)  # the weighted means' move, |0.5 - 0.1|
    paper = load_paper("dapfl")
    plan = Plan(paper, table, "cpu", paper.budgets["cpu"], [], [0, 1])
    text = paper_markdown(plan, paper_table(table, records))
    assert "| 110 (40-200) | 1.50 |" in text and "| - | - |" in text


def test_an_unfinished_table_marks_its_missing_cells_pending():
    frame = paper_table(synthetic_table(), [record("A", "M1", 0, 0.8)]).set_index(["column", "method"])
    assert frame.loc[("A", "M1"), "status"] == "ran" and frame.loc[("A", "M2"), "status"] == "pending"
    assert np.isnan(frame.loc[("A", "M1"), "rank_ours"])  # one method with both numbers: nothing to rank


# ---- budgets that keep the paper's regime; the FedReMa split ------------------------------------

def labels_only_dataset(per_class: int, num_classes: int = 10) -> "Dataset":
    """A dataset of labels only (the split needs no pixels): `per_class` samples of each class."""
    from pfedkit.data.datasets import Dataset

    y = np.repeat(np.arange(num_classes), per_class).astype(np.int64)
    return Dataset(name="cifar10", stored=np.zeros((len(y), 1, 1), np.uint8), y=y,
                   official_test=np.zeros(len(y), bool), num_classes=num_classes)


def test_fedrema_table2_test_splits_reach_beyond_the_dominant_classes():
    # s = 0.2, 100 samples per client: 80 samples in 3 dominant classes, 2 in each other class. A
    # class-stratified 4:1 split sends none of the 2 to test, so every test set would be dominant
    # classes only (inflating Local/FedPer/FedReMa); the authors' random split does not.
    from pfedkit.config import load_config
    from pfedkit.data.federated import split_indices
    from pfedkit.federation import split_plan

    paper = load_paper("fedrema")
    table = paper.table("2")
    column = next(c for c in table.columns if c.name == "s=0.2")
    row = next(r for r in table.rows if r.method == "Local")
    config = load_config(paper.cell_config(table, column, row, paper.budget(table, "paper")))
    assert config.partition.samples_per_client == 100 and config.num_clients == 20
    dataset = labels_only_dataset(per_class=400)
    train, test = split_indices(split_plan(config), dataset)
    outside = []
    for train_rows, test_rows in zip(train, test):
        dominant = np.argsort(-np.bincount(dataset.y[train_rows], minlength=10), kind="stable")[:3]
        outside.append(int(np.sum(~np.isin(dataset.y[test_rows], dominant))))
    assert all(len(t) == 20 for t in test)
    assert sum(outside) > 0, "every client's test samples lie in its 3 dominant classes"


# per paper, the per-round training settings the paper does not state (the preset's own choices,
# "[ours]" or "[code]" in the preset): they never pass as the paper's
PRESETS_OWN = {"fedrema": {"momentum"}, "pfedpm": set(), "cwfedavg": {"momentum"}, "pfedcs": {"momentum"},
               "dapfl": {"local_epochs", "momentum"}}


@pytest.mark.parametrize("name", PAPERS)
def test_regime_budget_keeps_the_papers_per_round_regime(name):
    """Every cell of every `regime` budget has the per-round values the paper states, each quoted
    in the preset (`paper_says`) and found in the paper's text; what the paper does not state is
    named as the preset's own choice, not counted as the paper's."""
    paper = load_paper(name)
    regimes = [table for table in paper.tables if "regime" in paper.budget_names(table)]
    assert regimes, f"{name}: no table has a regime budget"
    for table in regimes:
        assert paper.stated(table), f"{name} {table.id}: the regime budget quotes none of the paper's values"
        problems, own = regime_against_paper(paper, table)
        assert problems == []
        assert own == PRESETS_OWN[name], f"{name} {table.id}"
    text = PAPERS_TEXT / paper.file
    if text.is_file():  # ../shared/papers: the quotes are the paper's words
        assert quotes_not_in_text(paper, text.read_text()) == []


def test_regime_check_fails_a_budget_off_the_papers_stated_value():
    paper = load_paper("fedrema")
    table = paper.table("1-mnist")
    off = paper.model_copy(update={"budgets": {**paper.budgets, "regime": Budget(config={"lr": 0.05})}})
    off_table = table.model_copy(update={"budgets": {}})
    problems, _ = regime_against_paper(off.model_copy(update={"tables": [off_table]}), off_table)
    assert problems and all("lr = 0.05, the paper says 0.01" in problem for problem in problems)


def test_a_value_the_paper_does_not_state_never_passes_as_the_papers():
    """DA-PFL's E = 1 is the preset's ("[ours] paper silent"): the regime keeps it, and the check
    names it as ours. A quote that does not state its value, or is the preset's own words, is refused."""
    paper = load_paper("dapfl")
    _, own = regime_against_paper(paper, paper.table("1"))
    assert "local_epochs" in own and "local_epochs" not in paper.stated(paper.table("1"))
    with pytest.raises(ValueError, match="not in its quote"):
        PaperSays(value=1, quote="we adopt SGD as the optimizer")
    with pytest.raises(ValueError, match="not the paper's words"):
        PaperSays(value=1, quote="local_epochs: 1  # [ours] paper silent")
    assert quotes_not_in_text(paper.model_copy(update={"paper_says": {
        "local_epochs": PaperSays(value=1, quote="each client trains for 1 local epoch")}}), "unrelated text")


def test_a_budget_runs_only_its_rows_and_columns():
    paper = load_paper("pfedcs")
    table = paper.table("1-cifar10")
    budget = paper.budget(table, "regime")
    plan = plan_table(paper, table, "regime")
    assert {(e.group, e.label) for e in plan.entries} == {(c, m) for c in budget.columns for m in budget.rows}
    assert len(plan.entries) < len(table.rows) * len(table.columns)
    frame = paper_table(table, [])
    assert set(frame["status"]) == {"pending"}  # paper_table alone knows no budget


def test_a_budget_a_table_does_not_define_is_refused():
    paper = load_paper("pfedcs")
    with pytest.raises(ConfigError, match="regime"):
        paper.budget(paper.table("2-cifar10"), "regime")


def test_fedrema_table1_offers_the_authors_code_variant():
    paper = load_paper("fedrema")
    for table_id in ("1-mnist", "1-fmnist", "1-cifar10"):
        table = paper.table(table_id)
        code = next(r for r in table.rows if r.method == "FedReMa (code)")
        options = paper.cell_config(table, table.columns[0], code, paper.budget(table, "paper"))["fedrema"]
        assert options["probe_scale"] == 0.5 and options["peer_temperature"] == 1.0
        assert options["probe_draws"] == "per_client" and options["peer_weighting"] == "uniform"
        headline = next(r for r in table.rows if r.method == "FedReMa")
        assert "fedrema" not in headline.config  # the headline row keeps the paper's text


def test_cwfedavg_wdr_target_follows_the_authors_code():
    paper = load_paper("cwfedavg")
    table = paper.table("1-mnist")
    row = next(r for r in table.rows if r.algorithm == "cwfedavg")
    options = paper.cell_config(table, table.columns[0], row, paper.budget(table, "paper"))["cwfedavg"]
    assert options["empirical_from"] == "train_and_test" and options["wdr_half_factor"] is True


REGIME_RESULTS = Path(__file__).resolve().parent.parent / "docs" / "results" / "fedrema-1-mnist-regime"


def test_reuse_adopts_only_finished_runs_of_the_same_cells_and_settings(tmp_path):
    """--reuse: a committed table folder seeds a fresh table directory; other budgets are refused."""
    from pfedkit.experiments.comparison import _run_once
    from pfedkit.experiments.reproduce import adopt_finished_runs

    paper = load_paper("fedrema")
    table = paper.table("1-mnist")
    source = tmp_path / "source"
    shutil.copytree(REGIME_RESULTS, source)
    (source / "Other-s0").mkdir()
    for name in ("config.yaml", "summary.json"):
        shutil.copy(source / "MNIST-Local-s0" / name, source / "Other-s0" / name)
    secret = tmp_path / "secret.txt"
    secret.write_text("outside the results folder")
    (source / "MNIST-Local-s0" / "notes.txt").symlink_to(secret)  # planted in a shared folder
    out = tmp_path / "table"
    (out / "runs" / "MNIST-FedAvg-s0").mkdir(parents=True)  # a half run already there stays as it is
    regime = plan_table(paper, table, "regime", ["data_dir=nowhere"])
    outcome = adopt_finished_runs(source, plan_runs(out, regime.entries, regime.seeds), out)
    assert outcome["MNIST-Local-s0"] == outcome["MNIST-FedReMa-s0"] == outcome["MNIST-FedPAC-s0"] == "reused"
    assert outcome["MNIST-FedAvg-s0"].endswith("exists already (kept)")
    assert outcome["Other-s0"] == "not a run of this table at this budget"
    assert not (out / "runs" / "MNIST-FedAvg-s0" / "summary.json").exists()
    assert not (out / "runs" / "Other-s0").exists()
    assert not (out / "runs" / "MNIST-Local-s0" / "notes.txt").exists()  # links are not followed into out_dir
    planned = {record.run_dir.name: (record, config) for record, config in plan_runs(out, regime.entries, regime.seeds)}
    record, config = planned["MNIST-Local-s0"]
    summary, how = _run_once(record.run_dir, config, quiet=True)  # reused: no data is read (data_dir=nowhere)
    assert how == "reused" and summary == json.loads((source / "MNIST-Local-s0" / "summary.json").read_text())

    cpu = plan_table(paper, table, "cpu", ["data_dir=nowhere"])
    refused = adopt_finished_runs(source, plan_runs(tmp_path / "cpu", cpu.entries, cpu.seeds), tmp_path / "cpu")
    assert all(what.startswith("made with other settings") for name, what in refused.items() if name != "Other-s0")
    assert not (tmp_path / "cpu" / "runs").exists() or not any((tmp_path / "cpu" / "runs").iterdir())


def test_reuse_needs_one_table_and_a_directory(tmp_path, capsys):
    """Both refusals come before the data check and before any directory is made."""
    assert main(["reproduce", "fedrema", "--table", "1-mnist,2", "--budget", "smoke", "--out", str(tmp_path / "t"),
                 "--reuse", str(REGIME_RESULTS), "data_dir=nowhere"]) != 0
    assert "single --table" in capsys.readouterr().err
    assert main(["reproduce", "fedrema", "--table", "1-mnist", "--budget", "regime", "--out", str(tmp_path / "u"),
                 "--reuse", str(tmp_path / "missing"), "data_dir=nowhere"]) != 0
    assert "not a directory" in capsys.readouterr().err
    assert not (tmp_path / "t").exists() and not (tmp_path / "u").exists()


def test_table_only_writes_the_committed_table_without_data_or_runs(tmp_path, capsys):
    """`--reuse DIR --table-only` rebuilds a committed table on a machine without the data: the
    finished cells with their numbers, the missing ones pending, and no run started."""
    source, out = tmp_path / "source", tmp_path / "table"
    shutil.copytree(REGIME_RESULTS, source)
    shutil.rmtree(source / "MNIST-Local-s0")  # a row not finished yet
    # --seeds 2: the committed second seeds of some rows are cells of the table too
    assert main(["reproduce", "fedrema", "--table", "1-mnist", "--budget", "regime", "--out", str(out),
                 "--reuse", str(source), "--table-only", "--seeds", "2", "data_dir=nowhere"]) == 0
    paper = pd.read_csv(out / "paper.csv").set_index("method")
    stored = [json.loads(run.joinpath("summary.json").read_text()) for run in sorted(source.glob("MNIST-FedReMa-s*"))]
    assert len(stored) == paper.loc["FedReMa", "seeds"] == 2  # the mean over the committed seeds
    assert paper.loc["FedReMa", "ours"] == pytest.approx(
        100 * np.mean([summary[paper.loc["FedReMa", "metric"]] for summary in stored]))
    assert paper.loc["Local", "status"] == "pending"  # its run is not among the given ones
    # every committed run of the budget's rows is adopted (a row outside them needs --rows)
    fedrema = load_paper("fedrema")
    regime = plan_table(fedrema, fedrema.table("1-mnist"), "regime", ["data_dir=nowhere"], seeds=2)
    planned = {record.run_dir.name for record, _ in plan_runs(out, regime.entries, regime.seeds)}
    committed = {p.name for p in source.iterdir() if (p / "summary.json").is_file()}
    assert {p.name for p in (out / "runs").iterdir()} == committed & planned
    assert len(committed & planned) >= 8  # FedReMa, FedPAC (both heads) on 2 seeds, FedAvg, code variant
    assert "FedReMa" in capsys.readouterr().out
    empty = tmp_path / "empty"
    assert main(["reproduce", "fedrema", "--table", "1-mnist", "--budget", "regime", "--out", str(empty),
                 "--table-only", "data_dir=nowhere"]) != 0
    assert "no finished run" in capsys.readouterr().err


# ---- --rows and --seeds: a table grown row by row, seed by seed --------------------------------

PFEDPM_RESULTS = REGIME_RESULTS.parent / "pfedpm-1-mnist-regime"


def test_rows_choose_the_methods_and_their_order_any_row_of_the_table():
    paper = load_paper("pfedcs")
    table = paper.table("1-cifar10")
    plan = plan_table(paper, table, "regime", rows=["FedFomo", "FedAvg", "FedPer"], seeds=3)
    assert [e.label for e in plan.entries] == ["FedFomo", "FedAvg", "FedPer"]
    assert {e.group for e in plan.entries} == set(paper.budget(table, "regime").columns)  # the budget's column
    fedavg, fedper = plan.entries[1].config, plan.entries[2].config
    # a row the budget leaves out runs at the budget's settings, as the rows it keeps do
    assert fedper["rounds"] == fedavg["rounds"] == 60 and fedper["local_epochs"] == fedavg["local_epochs"] == 5
    assert plan.seeds == [0, 1, 2]
    assert {e.label for e in plan.scope} == {row.method for row in table.rows if row.algorithm is not None}
    assert plan_table(paper, table, "regime").scope is None  # the whole table: nothing else to keep


def test_rows_refuse_unknown_unimplemented_and_repeated_methods():
    paper = load_paper("pfedcs")
    with pytest.raises(ConfigError, match=r"no such row \(did you mean FedFomo\?\)"):
        plan_table(paper, paper.table("1-cifar10"), "cpu", rows=["FedFom"])
    with pytest.raises(ConfigError, match="Select None: not implemented"):
        plan_table(paper, paper.table("3"), "cpu", rows=["FedPer", "Select None"])
    with pytest.raises(ConfigError, match="named twice"):
        plan_table(paper, paper.table("1-cifar10"), "cpu", rows=["FedAvg", "FedAvg"])


def test_columns_choose_the_cells_and_their_order_and_keep_the_table_in_scope():
    paper = load_paper("dapfl")
    table = paper.table("1")
    budget_columns = paper.budget(table, "regime").columns
    plan = plan_table(paper, table, "regime", rows=["FedSoft", "FedAMP"], columns=[2])
    assert [(e.group, e.label) for e in plan.entries] == [(table.columns[1].name, "FedSoft"),
                                                          (table.columns[1].name, "FedAMP")]
    assert [e.config["partition"]["alpha"] for e in plan.entries] == [0.5, 0.5]
    # the scope: every row in the budget's columns, so --reuse and --table-only keep the other cells
    assert {e.group for e in plan.scope} == set(budget_columns)
    assert {e.label for e in plan.scope} == {row.method for row in table.rows if row.algorithm is not None}
    both = plan_table(paper, table, "regime", rows=["DA-PFL"], columns=[2, 1])
    assert [e.group for e in both.entries] == [table.columns[1].name, table.columns[0].name]
    # a column the budget leaves out runs at the budget's settings, and joins the scope
    outside = plan_table(paper, table, "regime", rows=["DA-PFL"], columns=[3])
    (entry,) = outside.entries
    assert entry.config["num_clients"] == 100 and entry.config["rounds"] == plan.entries[0].config["rounds"]
    assert {e.group for e in outside.scope} == {*budget_columns, table.columns[2].name}
    alone = plan_table(paper, table, "regime", columns=[1])  # the budget's rows, one column
    assert {e.label for e in alone.entries} == set(paper.budget(table, "regime").rows)
    assert alone.scope is not None


def test_columns_refuse_numbers_outside_the_table_repeats_and_words(tmp_path, capsys):
    paper = load_paper("dapfl")
    with pytest.raises(ConfigError, match=r"--columns 5: table 1 has columns 1-4: 1 = 20 clients"):
        plan_table(paper, paper.table("1"), "regime", columns=[5])
    with pytest.raises(ConfigError, match="named twice"):
        plan_table(paper, paper.table("1"), "regime", columns=[1, 1])
    assert main(["reproduce", "dapfl", "--table", "1", "--budget", "regime", "--columns", "alpha=0.5",
                 "--out", str(tmp_path / "t"), "data_dir=nowhere"]) == 2
    assert "column numbers as --list shows them" in capsys.readouterr().err
    assert main(["reproduce", "dapfl", "--budget", "regime", "--columns", "2", "--out", str(tmp_path / "t"),
                 "data_dir=nowhere"]) == 2
    assert "name a single --table" in capsys.readouterr().err
    assert not (tmp_path / "t").exists()


def test_seeds_must_be_positive_before_anything_is_made(tmp_path, capsys):
    assert main(["reproduce", "pfedcs", "--table", "1-cifar10", "--budget", "regime", "--seeds", "0",
                 "--out", str(tmp_path / "t"), "data_dir=nowhere"]) == 2
    assert "--seeds 0: at least 1" in capsys.readouterr().err
    assert not (tmp_path / "t").exists()


def test_the_heading_names_the_seed_range_when_rows_ran_different_numbers_of_seeds():
    paper = load_paper("pfedcs")
    plan = Plan(paper, synthetic_table(), "cpu", paper.budget(paper.table("1-cifar10"), "cpu"), [], [0, 1])
    two_and_one = [record("A", "M1", 0, 0.8), record("A", "M1", 1, 0.8), record("A", "M2", 0, 0.9)]
    assert "seeds: 1-2 (per row: the seeds column)" in paper_markdown(plan, paper_table(plan.table, two_and_one))
    both_two = two_and_one + [record("A", "M2", 1, 0.9)]
    assert "seeds: 2. " in paper_markdown(plan, paper_table(plan.table, both_two))


def test_the_heading_names_the_overrides_that_change_what_the_runs_compute():
    """A table made with `num_clients=20` is not the budget's table: its heading says so; where
    the data lie or how the runs execute (data_dir, backend, workers) changes no number, so it is not named."""
    paper = load_paper("cwfedavg")
    table = paper.table("1-mnist")
    changed = plan_table(paper, table, "regime", ["num_clients=20", "partition.pool_fraction=1.0",
                                                  "data_dir=nowhere", "backend=sequential", "workers=1"])
    assert changed.changed == ("num_clients=20", "partition.pool_fraction=1.0")
    assert {e.config["num_clients"] for e in changed.entries} == {20}
    text = paper_markdown(changed, paper_table(table, []))
    assert "changed by the overrides num_clients=20 partition.pool_fraction=1.0; seeds:" in text
    assert "data_dir" not in text and "backend" not in text
    plain = plan_table(paper, table, "regime", ["data_dir=nowhere", "threads=2"])
    assert plain.changed == () and "overrides" not in paper_markdown(plain, paper_table(table, []))


@needs_dataset("mnist")
def test_rows_grow_a_reused_table_and_keep_its_other_rows(tmp_path, capsys):
    """--reuse with --rows Local: Local's committed cells are reused (nothing trains), and the other
    rows adopted from the committed runs stay in the table. The kept cells are held to what the
    whole table shares, not to what the Local rows share (Local's rounds differ from the others')."""
    out = tmp_path / "table"
    assert main(["reproduce", "pfedpm", "--table", "1-mnist", "--budget", "regime", "--out", str(out), "-q",
                 "--reuse", str(PFEDPM_RESULTS), "--rows", "Local", f"data_dir={SHARED_DATASETS}"]) == 0
    log = capsys.readouterr().err
    assert log.count(" Local seed 0: reused") == 3 and ": ran (" not in log
    committed = {p.name for p in PFEDPM_RESULTS.iterdir() if (p / "summary.json").is_file()}
    pfedpm = load_paper("pfedpm")
    table = pfedpm.table("1-mnist")
    every_row = plan_table(pfedpm, table, "regime", rows=[row.method for row in table.rows if row.algorithm])
    committed_rows = {entry.label for entry in every_row.entries if run_name(entry, 0) in committed}
    paper = pd.read_csv(out / "paper.csv")
    ran = paper[paper["status"] == "ran"]
    assert "Local" in committed_rows and len(committed_rows) > 1
    assert set(ran["method"]) == committed_rows and len(ran) == len(committed_rows) * 3  # 3 columns, seed 0
    manifest = json.loads((out / "comparison.json").read_text())
    assert sum(len(entry["runs"]) for entry in manifest["entries"]) == len(committed)


@needs_dataset("mnist")
def test_rows_refuse_a_kept_cell_made_with_other_options_of_its_algorithm(tmp_path, capsys):
    """A finished cell of the table in the directory that is not the table's run of it (here
    pFedPM with another mixing weight a) is refused by name, not shown beside the others."""
    source, out = tmp_path / "source", tmp_path / "table"
    shutil.copytree(PFEDPM_RESULTS, source)
    config_file = source / "n_3-pFedPM-s0" / "config.yaml"
    config_file.write_text(config_file.read_text().replace("\n  a: 0.6\n", "\n  a: 0.9\n"))
    shutil.copytree(source, out / "runs", ignore=shutil.ignore_patterns("*.md"))  # as if run here earlier
    assert main(["reproduce", "pfedpm", "--table", "1-mnist", "--budget", "regime", "--out", str(out), "-q",
                 "--rows", "Local", f"data_dir={SHARED_DATASETS}"]) == 2
    err = capsys.readouterr().err
    assert "n_3-pFedPM-s0 was made with other settings" in err and "pfedpm.a" in err


def test_one_seed_shows_our_value_alone_where_the_spread_is_over_seeds():
    """With one seed a std over seeds is 0 by construction: the cell shows the value, no '± 0.00'."""
    paper = load_paper("pfedcs")
    plan = Plan(paper, synthetic_table(), "cpu", paper.budget(paper.table("1-cifar10"), "cpu"), [], [0])
    one = paper_markdown(plan, paper_table(plan.table, [record("A", "M1", 0, 0.8), record("A", "M2", 0, 0.9)]))
    assert "| M1 | best_acc | 80.00 | 1 |" in one and "± 0.00" not in one
    two = paper_markdown(plan, paper_table(plan.table, [record("A", "M1", 0, 0.8), record("A", "M1", 1, 0.6)]))
    assert "| M1 | best_acc | 70.00 ± 10.00 | 2 |" in two


def test_a_table_quoting_another_paper_is_not_checked_against_this_papers_text():
    """pFedPM's 1-mnist-fedproto quotes FedProto's paper (`quotes_from`), which is not stored: its
    quotes are exempt from the text check, the other tables' are not."""
    paper = load_paper("pfedpm")
    quoting = paper.table("1-mnist-fedproto")
    assert quoting.quotes_from and paper.stated(quoting)["batch_size"].value == 8
    own = paper.table("1-mnist")
    only = {"tables": [quoting]}
    assert quotes_not_in_text(paper.model_copy(update=only), "unrelated text") == []
    assert quotes_not_in_text(paper.model_copy(update={"tables": [own]}), "unrelated text") != []
    unmarked = quoting.model_copy(update={"quotes_from": None})
    assert quotes_not_in_text(paper.model_copy(update={"tables": [unmarked]}), "unrelated text") != []
