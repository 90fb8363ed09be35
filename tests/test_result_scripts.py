"""The scripts behind docs/results.md: bf16 parity, pFedPM's grid of a on validation, per-round curves, paired clients."""
from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import yaml

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_metrics(run_dir: Path, accuracies: dict[int, list[float]]) -> Path:
    """metrics.csv with one row per client and round (client i's accuracy = accuracies[round][i])."""
    run_dir.mkdir(parents=True)
    rows = [{"round": rnd, "client": client, "accuracy": acc}
            for rnd, values in accuracies.items() for client, acc in enumerate(values)]
    pd.DataFrame(rows).to_csv(run_dir / "metrics.csv", index=False)
    return run_dir


def test_parity_compares_unweighted_round_means_over_common_complete_rounds(tmp_path):
    parity = load_script("precision_parity")
    a = write_metrics(tmp_path / "a", {1: [0.5, 0.7], 2: [0.6, 0.8], 3: [0.9, 0.9]})
    # b's round 3 is half written (one client): it is not a round b has evaluated
    b = write_metrics(tmp_path / "b", {1: [0.5, 0.5], 2: [0.8, 0.8], 3: [0.1]})
    series_a, series_b = parity.per_round_accuracy(a), parity.per_round_accuracy(b)
    assert list(series_b.index) == [1, 2]
    assert series_a[1] == pytest.approx(60.0)  # unweighted mean of 50 % and 70 %
    result = parity.parity(series_a, series_b)
    assert result["rounds"] == 2
    assert result["max_abs_diff"] == pytest.approx(10.0)  # round 1: 60 vs 50; round 2: 70 vs 80
    assert result["mean_abs_diff"] == pytest.approx(10.0)
    assert result["last_mean_a"] == pytest.approx(65.0)
    assert result["last_mean_b"] == pytest.approx(65.0)
    assert parity.parity(series_a, series_b, last=1)["last_mean_b"] == pytest.approx(80.0)


def test_grid_runs_the_tables_pfedpm_cells_on_validation_with_only_a_changed():
    grid = load_script("pfedpm_a_grid")
    entries = grid.grid_entries("1-mnist", [0.2, 0.8], None, "data")
    assert [(entry.group, entry.label) for entry in entries] == [
        (n, label) for n in ("n=3", "n=4", "n=5") for label in ("a=0.2", "a=0.8")]
    from pfedkit.experiments.paper_presets import load_paper
    from pfedkit.experiments.reproduce import plan_table
    paper = load_paper("pfedpm")
    table = paper.table("1-mnist")
    cells = {entry.group: entry.config for entry in plan_table(paper, table, "regime", ["data_dir=data"]).entries
             if entry.label == "pFedPM"}
    for entry in entries:
        cell = cells[entry.group]
        assert entry.config["validation_fraction"] == grid.VALIDATION_FRACTION > 0
        assert entry.config["pfedpm"]["a"] == float(entry.label.removeprefix("a="))
        assert entry.config["pfedpm"]["lam"] == cell["pfedpm"]["lam"]
        assert {k: v for k, v in entry.config.items() if k not in ("pfedpm", "validation_fraction")} == \
            {k: v for k, v in cell.items() if k != "pfedpm"}


def test_grid_picks_each_columns_best_a_and_the_smaller_a_on_a_tie():
    grid = load_script("pfedpm_a_grid")
    scores = {("n=3", 0.2): 0.90, ("n=3", 0.4): 0.95, ("n=3", 0.6): 0.95, ("n=4", 0.2): 0.97, ("n=4", 0.4): 0.93}
    records = [SimpleNamespace(entry=SimpleNamespace(label=f"a={a:g}", group=column),
                               summary={"final_acc_unweighted": score}) for (column, a), score in scores.items()]
    records.append(SimpleNamespace(entry=SimpleNamespace(label="a=0.8", group="n=4"), summary={}))  # not finished
    table = grid.grid_table(records)
    assert table.loc[0.4, "n=3"] == pytest.approx(95.0)
    assert grid.best_a(table) == {"n=3": 0.4, "n=4": 0.2}
    text = grid.grid_markdown(table)  # without pandas' optional tabulate
    assert text.splitlines()[0] == "| a | n=3 | n=4 |" and "| 0.4 | 95.00 | 93.00 |" in text
    assert "| 0.6 | 95.00 | - |" in text  # n=4 did not run a = 0.6


def test_per_round_curves_take_the_unweighted_mean_over_clients(tmp_path):
    curves = load_script("per_round_curves")
    rows = [  # client 0: 10 test samples, client 1: 90; round 2 evaluated only as far as client 0
        {"round": 1, "client": 0, "n_test": 10, "correct": 5, "accuracy": 0.5, "balanced_acc": 0.4, "loss": 1.0},
        {"round": 1, "client": 1, "n_test": 90, "correct": 81, "accuracy": 0.9, "balanced_acc": 0.8, "loss": 1.0},
        {"round": 2, "client": 0, "n_test": 10, "correct": 7, "accuracy": 0.7, "balanced_acc": 0.6, "loss": 1.0}]
    (tmp_path / "a").mkdir()
    pd.DataFrame(rows).to_csv(tmp_path / "a" / "metrics.csv", index=False)
    frame = curves.curves(curves.parse([f"A={tmp_path / 'a'}"]))
    assert list(frame["method"]) == ["A", "A"] and list(frame["round"]) == [1, 2]
    assert frame["accuracy"].tolist() == pytest.approx([0.7, 0.7])  # (0.5 + 0.9) / 2, not (5 + 81) / 100
    assert frame["balanced_acc"].tolist() == pytest.approx([0.6, 0.6])
    with pytest.raises(SystemExit, match="LABEL=RUN_DIR"):
        curves.parse([str(tmp_path / "a")])


def write_clients(run_dir: Path, correct: list[list[int]], total: list[list[int]]) -> Path:
    run_dir.mkdir(parents=True)
    np.savez(run_dir / "clients.npz", class_correct=np.array(correct), class_total=np.array(total))
    return run_dir


def test_paired_clients_takes_b_minus_a_per_client_with_its_standard_error(tmp_path):
    script = load_script("paired_clients")
    total = [[10, 0], [5, 5], [2, 18]]  # three clients of 10, 10 and 20 test samples
    a = write_clients(tmp_path / "a", [[5, 0], [4, 4], [2, 14]], total)  # 50, 80, 80 %
    b = write_clients(tmp_path / "b", [[8, 0], [4, 4], [1, 13]], total)  # 80, 80, 70 %
    result = script.paired(a, b)
    assert result["clients"] == 3
    assert result["mean_a"] == pytest.approx(70.0) and result["mean_b"] == pytest.approx(230 / 3)  # unweighted
    assert result["diff"] == pytest.approx(20 / 3)  # (+30 + 0 - 10) / 3: B - A, not A - B
    assert result["stderr"] == pytest.approx(np.std([30.0, 0.0, -10.0], ddof=1) / np.sqrt(3))
    assert (result["b_above"], result["b_below"], result["level"]) == (1, 1, 1)
    other = write_clients(tmp_path / "other", [[5, 0], [4, 4], [2, 14]], [[10, 0], [5, 5], [3, 17]])
    with pytest.raises(SystemExit, match="same clients"):
        script.paired(a, other)  # another partition: pairing its clients would be meaningless
    fewer = write_clients(tmp_path / "fewer", [[5, 0], [4, 4]], [[10, 0], [5, 5]])
    with pytest.raises(SystemExit, match="same clients"):
        script.paired(a, fewer)  # another client count
    with pytest.raises(SystemExit, match="no clients.npz"):
        script.paired(a, tmp_path)


def test_methods_table_puts_each_settings_seed_means_in_its_column(small_config, tmp_path, capsys):
    from pfedkit.experiments.comparison import Entry, run_comparison, write_seed_table

    script = load_script("methods_table")
    quiet = dict(log=lambda _: None)
    settings = {"mnist-pat2": dict(small_config, partition={"scheme": "pathological", "classes_per_client": 2}),
                "mnist-dir0.1": small_config}
    runs = {}
    for setting, config in settings.items():  # written out of SETTING_ORDER: the table reorders them
        names = ("fedper", "local", "fedavg") if setting == "mnist-dir0.1" else ("fedavg",)
        records = run_comparison(tmp_path / setting, [Entry(n, {**config, "algorithm": n}) for n in names],
                                 [0, 1] if setting == "mnist-dir0.1" else [0], **quiet)
        write_seed_table(tmp_path / setting, records)
        runs[setting] = records
    table = script.markdown(script.read_settings(tmp_path))
    lines = table.splitlines()
    assert lines[0] == "| method | seeds | mnist-dir0.1 last5 / best | mnist-pat2 last5 / best |"
    assert [line.split(" | ")[0] for line in lines[2:]] == ["| `fedavg`", "| `local`", "| `fedper`"]  # anchors first
    fedavg_dir = [r.summary for r in runs["mnist-dir0.1"] if r.entry.label == "fedavg"]
    last5 = [100 * s["last5_acc"] for s in fedavg_dir]
    best = [100 * s["best_acc"] for s in fedavg_dir]
    fedavg_pat = next(r.summary for r in runs["mnist-pat2"] if r.entry.label == "fedavg")
    assert lines[2] == (f"| `fedavg` | 1/2 | {np.mean(last5):.2f} ± {np.std(last5):.2f} / "
                        f"{np.mean(best):.2f} ± {np.std(best):.2f} | "
                        f"{100 * fedavg_pat['last5_acc']:.2f} / {100 * fedavg_pat['best_acc']:.2f} |")
    assert lines[3].endswith("| - / - |")  # local: not run on mnist-pat2
    assert script.main([str(tmp_path / "nothing")]) == 2
    (tmp_path / "empty").mkdir()
    assert script.main([str(tmp_path / "empty")]) == 2
    assert "run benchmarks/methods_table.sh first" in capsys.readouterr().err


def test_methods_table_puts_published_values_beside_each_setting_with_footnotes(tmp_path, capsys):
    script = load_script("methods_table")
    runs = tmp_path / "runs" / "mnist-dir0.1"
    runs.mkdir(parents=True)
    pd.DataFrame({"label": ["fedavg", "fedala"], "seeds": [1, 1], "last5_mean": [0.9, 0.95], "last5_std": [0, 0],
                  "best_mean": [0.91, 0.96], "best_std": [0, 0]}).to_csv(runs / "table.csv", index=False)
    entry = {"source": "Paper X, Table 1", "quote": "FedALA | 97.66", "setting": "FMNIST, Dir(0.1), 2000 rounds",
             "differs": "dataset FMNIST; 2000 rounds, not 20"}
    published = tmp_path / "published.yaml"
    published.write_text(yaml.safe_dump({"mnist-dir0.1": {"fedala": {"value": 97.66, **entry}},
                                         "mnist-pat2": {"fedala": {"value": 99.57, **entry}}}))
    assert script.main([str(tmp_path / "runs"), "--published", str(published)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "| method | seeds | mnist-dir0.1 last5 / best | mnist-dir0.1 published |"
    assert lines[2] == "| `fedavg` | 1 | 90.00 / 91.00 | - |"  # no published value: "-"
    assert lines[3] == "| `fedala` | 1 | 95.00 / 96.00 | 97.66 [1] |"
    assert lines[5] == ("[1] Paper X, Table 1. Setting: FMNIST, Dir(0.1), 2000 rounds. "
                        "Differs: dataset FMNIST; 2000 rounds, not 20.")
    assert len(lines) == 6  # mnist-pat2 was not run: no column, no footnote
    for bad, message in [({"cifar10-dir0.5": {}}, "unknown setting 'cifar10-dir0.5'"),
                         ({"mnist-dir0.1": {"fedfoo": {"value": 1.0, **entry}}}, "pfedkit has no method fedfoo")]:
        published.write_text(yaml.safe_dump(bad))
        assert script.main([str(tmp_path / "runs"), "--published", str(published)]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1  # one line
    shipped = script.read_published(BENCHMARKS / "methods_published.yaml")  # the shipped file is valid
    fields = {"value", "source", "quote", "setting", "differs"}
    assert all(set(e) >= fields for methods in shipped.values() for e in methods.values())
