"""Comparisons over seeds (`pfedkit compare --seeds`), resume, tables, and the HTML reports."""
from __future__ import annotations

import json
import re
import struct

import numpy as np
import pandas as pd
import pytest

import pfedkit
from pfedkit.cli import main, parse_seeds
from pfedkit.core.errors import ConfigError
from pfedkit.engine.simulate import Simulation
from pfedkit.evaluation import classifier_row_norms, round_table
from pfedkit.experiments.comparison import Entry, mean_std, run_comparison, seed_table, write_seed_table
from pfedkit.report.comparison_report import report_comparison
from pfedkit.report.run_report import report_run

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def entries(small_config, names=("fedavg", "local")):
    return [Entry(name, {**small_config, "algorithm": name}) for name in names]


def test_seed_table_is_mean_and_std_of_the_separate_runs(small_config, tmp_path):
    records = run_comparison(tmp_path / "cmp", entries(small_config), [0, 1], log=lambda _: None)
    table = seed_table(records)
    for name in ("fedavg", "local"):
        separate = [pfedkit.run({**small_config, "algorithm": name, "seed": seed,
                                 "out_dir": str(tmp_path / "alone")}).summary for seed in (0, 1)]
        row = table.loc[("", name)]
        for column, key in (("best", "best_acc"), ("last5_unweighted", "last5_acc_unweighted")):
            values = [s[key] for s in separate]
            assert values[0] != values[1]  # the seeds differ ...
            assert row[f"{column}_mean"] == pytest.approx(np.mean(values), abs=1e-12)
            assert row[f"{column}_std"] == pytest.approx(np.std(values), abs=1e-12)
            assert row[f"{column}_std"] > 0  # ... so the spread over seeds is not zero
        assert row["seeds"] == 2


def test_entries_share_each_seeds_partition(small_config, tmp_path):
    records = run_comparison(tmp_path / "cmp", entries(small_config), [0, 1], log=lambda _: None)
    partitions = {(r.entry.label, r.seed): dict(np.load(r.run_dir / "partition.npz")) for r in records}
    for seed in (0, 1):
        fedavg, local = partitions[("fedavg", seed)], partitions[("local", seed)]
        assert all(np.array_equal(fedavg[key], local[key]) for key in fedavg)
    assert not all(np.array_equal(partitions[("fedavg", 0)][k], partitions[("fedavg", 1)][k])
                   for k in partitions[("fedavg", 0)])


def test_interrupted_comparison_resumes_to_the_same_numbers(small_config, tmp_path, monkeypatch):
    reference = run_comparison(tmp_path / "ref", entries(small_config), [0, 1], log=lambda _: None)
    original, calls = Simulation.run_round, {"n": 0}

    def crash_in_third_run(self, state):  # runs: fedavg s0, fedavg s1 (killed after round 2), ...
        calls["n"] += 1
        if calls["n"] == small_config["rounds"] + 3:
            raise KeyboardInterrupt
        return original(self, state)

    monkeypatch.setattr(Simulation, "run_round", crash_in_third_run)
    with pytest.raises(KeyboardInterrupt):
        run_comparison(tmp_path / "cmp", entries(small_config), [0, 1], log=lambda _: None)
    monkeypatch.setattr(Simulation, "run_round", original)
    log = []
    resumed = run_comparison(tmp_path / "cmp", entries(small_config), [0, 1], log=log.append)
    assert ["reused" in line for line in log] == [True, False, False, False]
    assert "resumed" in log[1] and "ran" in log[2]
    for ref, again in zip(reference, resumed):
        assert (ref.run_dir / "metrics.csv").read_bytes() == (again.run_dir / "metrics.csv").read_bytes()
    keep = [c for c in seed_table(reference).columns if not c.startswith("s_per_round")]
    pd.testing.assert_frame_equal(seed_table(reference)[keep], seed_table(resumed)[keep])


def test_a_comparison_directory_refuses_other_settings(small_config, tmp_path):
    run_comparison(tmp_path / "cmp", entries(small_config, ("fedavg",)), [0], log=lambda _: None)
    changed = [Entry("fedavg", {**small_config, "lr": 0.01})]
    with pytest.raises(ConfigError, match="other settings"):
        run_comparison(tmp_path / "cmp", changed, [0], log=lambda _: None)
    # where and how fast a run executes may change on resume
    moved = [Entry("fedavg", {**small_config, "backend": "processes", "workers": 2})]
    (record,) = run_comparison(tmp_path / "cmp", moved, [0], log=lambda _: None)
    assert record.summary["backend"] == "sequential"  # reused, not re-run


def test_finished_runs_drop_their_checkpoint(small_config, tmp_path):
    (record,) = run_comparison(tmp_path / "cmp", entries(small_config, ("fedavg",)), [0], log=lambda _: None)
    assert (record.run_dir / "summary.json").is_file()
    assert not (record.run_dir / "checkpoints" / "latest.pt").exists()


def test_identical_cells_share_one_run(small_config, tmp_path):
    same = [Entry("best row", {**small_config}), Entry("final row", {**small_config})]
    log = []
    records = run_comparison(tmp_path / "cmp", same, [0], log=log.append)
    assert len(log) == 1 and records[0].run_dir == records[1].run_dir


def test_mean_std_ignores_missing_values():
    assert mean_std([0.5, float("nan"), 0.7]) == pytest.approx((0.6, 0.1))
    assert all(np.isnan(v) for v in mean_std([float("nan")]))


def test_compare_cli_writes_tables(small_config, tmp_path, capsys):
    overrides = [f"{k}={v}" for k, v in small_config.items() if k not in ("partition", "algorithm")]
    out = tmp_path / "cmp"
    assert main(["compare", "--algorithms", "fedavg,local", "--seeds", "0,1", "--out", str(out), "-q",
                 *overrides]) == 0
    table = pd.read_csv(out / "table.csv")
    assert table["label"].tolist() == ["fedavg", "local"] and (table["seeds"] == 2).all()
    markdown = (out / "table.md").read_text()
    assert "| fedavg | 2 |" in markdown and "±" in markdown
    assert "comparison directory" in capsys.readouterr().out


def test_compare_cut_midway_keeps_the_table_of_its_finished_cells(small_config, tmp_path, monkeypatch):
    from pfedkit.experiments import comparison

    overrides = [f"{k}={v}" for k, v in small_config.items() if k not in ("partition", "algorithm")]
    out = tmp_path / "cmp"
    real, calls = comparison._run_once, []

    def cut_at_the_second_run(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt  # the session ends while the second method trains
        return real(*args, **kwargs)

    monkeypatch.setattr(comparison, "_run_once", cut_at_the_second_run)
    assert main(["compare", "--algorithms", "fedavg,local", "--seeds", "0", "--out", str(out), "-q",
                 *overrides]) != 0  # interrupted
    assert pd.read_csv(out / "table.csv")["label"].tolist() == ["fedavg"]
    records = comparison.finished_records(out)
    assert [(r.entry.label, r.seed) for r in records] == [("fedavg", 0)]
    assert records[0].summary == json.loads((out / "runs" / "fedavg-s0" / "summary.json").read_text())


@pytest.mark.parametrize("text, seeds", [("0,1,2", [0, 1, 2]), ("3-5", [3, 4, 5]), ("7", [7])])
def test_parse_seeds(text, seeds):
    assert parse_seeds(text) == seeds


@pytest.mark.parametrize("text", ["", "a,b", "1,1", "5-3"])
def test_parse_seeds_rejects_bad_input(text):
    with pytest.raises(ConfigError, match="--seeds"):
        parse_seeds(text)


# ---- run artefacts the reports draw -------------------------------------------------------------

def test_classifier_row_norms_read_the_output_layer():
    import torch

    weight = torch.tensor([[3.0, 4.0], [0.0, 1.0], [1.0, 0.0]])
    params = {"body.fc.weight": torch.ones(3, 2), "head.fc.weight": weight, "head.fc.bias": torch.ones(3)}
    assert classifier_row_norms(params, 3).tolist() == [5.0, 1.0, 1.0]
    assert np.isnan(classifier_row_norms({"body.fc.weight": torch.ones(3, 2)}, 3)).all()


def test_clients_npz_holds_counts_and_head_norms(small_config):
    result = pfedkit.run({**small_config, "algorithm": "local"})
    with np.load(result.run_dir / "clients.npz") as saved:
        arrays = dict(saved)
    n_train = result.metrics.groupby("client")["n_train"].first().to_numpy()
    assert np.array_equal(arrays["train_counts"].sum(1), n_train)
    assert arrays["head_row_norms"].shape == arrays["train_counts"].shape
    assert np.array_equal(arrays["class_total"], arrays["test_counts"])
    last = result.metrics[result.metrics["round"] == small_config["rounds"]]
    assert np.array_equal(arrays["class_correct"].sum(1), last["correct"].to_numpy())


# ---- HTML reports ---------------------------------------------------------------------------

def referenced_files(page):
    """Every file the HTML page refers to by src= or href= (the page writer quotes them with ')."""
    return [(page.parent / target).resolve() for target in re.findall(r"(?:src|href)='([^']+)'", page.read_text())]


def check_page(page, written):
    """The page's every reference exists, and every PNG written is on the page."""
    references = referenced_files(page)
    assert references and all(path.is_file() for path in references)
    pngs = {p.resolve() for p in written if p.suffix == ".png"}
    assert pngs <= set(references)


def test_run_report_page(small_config):
    result = pfedkit.run({**small_config, "algorithm": "cwfedavg"})
    written = report_run(result.run_dir)
    page = written[-1]
    assert page.name == "index.html"
    names = {p.name for p in written}
    assert {"accuracy.png", "accuracy_clients.png", "clients_data_and_head_norms.png",
            "cwfedavg_class_distribution.png"} <= names
    check_page(page, written)


def test_comparison_report_page(small_config, tmp_path):
    out = tmp_path / "cmp"
    records = run_comparison(out, entries(small_config), [0, 1], log=lambda _: None)
    write_seed_table(out, records)
    written = report_comparison(out)
    check_page(written[-1], written)
    text = written[-1].read_text()
    assert "fedavg" in text and "local" in text and "<table" in text


def read_scalars(folder):
    """(tag, step, value) of every scalar in a TensorBoard event folder (TFRecord framing)."""
    from tensorboardX.proto import event_pb2

    scalars = []
    for path in folder.iterdir():
        data = path.read_bytes()
        offset = 0
        while offset < len(data):
            (length,) = struct.unpack("<Q", data[offset:offset + 8])
            event = event_pb2.Event.FromString(data[offset + 12:offset + 12 + length])
            offset += 12 + length + 4
            scalars += [(v.tag, event.step, v.simple_value) for v in event.summary.value]
    return scalars


def test_tensorboard_events_hold_the_accuracy_curve(small_config, tmp_path):
    pytest.importorskip("tensorboardX")
    result = pfedkit.run(small_config)
    assert main(["report", str(result.run_dir), "tensorboard=true"]) == 0
    scalars = read_scalars(result.run_dir / "report" / "tensorboard" / result.run_dir.name)
    curve = {step: value for tag, step, value in scalars if tag == "accuracy/weighted"}
    expected = round_table(result.metrics)["acc_weighted"]
    assert curve == pytest.approx(expected.to_dict(), abs=1e-6)


def test_report_rejects_unknown_options(small_config, capsys):
    result = pfedkit.run(small_config)
    assert main(["report", str(result.run_dir), "colour=red"]) == 2
    assert "tensorboard" in capsys.readouterr().err
