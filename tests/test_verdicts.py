"""A difference between two rows with its standard error, the tie rule, the collapsed Kendall tau,
and the per-client accuracies a run's summary records so that future tables can be paired."""
from __future__ import annotations

import math

import numpy as np
import pytest

from pfedkit.experiments.verdicts import (BINOMIAL, PAIRED, RunAccuracy, binomial_se, collapsed_kendall_tau,
                                          combine_seeds, difference, paired_client_se, run_accuracy)


def test_binomial_se_is_the_square_root_of_p_one_minus_p_over_n():
    # 98.5 % on 2,400 test images: ~0.25 point (the one-run noise)
    assert 100 * binomial_se(0.985, 2400) == pytest.approx(0.2481, abs=1e-4)
    assert binomial_se(0.9, np.array([100, 300])) == pytest.approx(math.sqrt(0.09 / 400))
    # unweighted mean over clients: sqrt(p(1-p) sum 1/n_k) / K
    assert binomial_se(0.9, np.array([100, 300]), weighted=False) == pytest.approx(
        math.sqrt(0.09 * (1 / 100 + 1 / 300)) / 2)


def test_paired_se_uses_n_minus_one_and_the_weights():
    diffs = np.array([0.01, 0.03, -0.01, 0.05])
    mean, se = paired_client_se(diffs, np.ones(4))
    assert mean == pytest.approx(0.02)
    assert se == pytest.approx(np.std(diffs, ddof=1) / 2)  # ddof = 1: n - 1, not n
    _, weighted = paired_client_se(diffs, np.array([1, 1, 1, 3]))
    w = np.array([1, 1, 1, 3]) / 6
    d = np.sum(w * diffs)
    assert weighted == pytest.approx(math.sqrt(4 / 3 * np.sum(w ** 2 * (diffs - d) ** 2)))


def test_pairing_removes_the_client_difficulty_both_rows_share():
    """Two rows that differ by a constant 0.5 point on every client, over clients of very different
    difficulty: paired, the difference is exact (SE 0); unpaired it would be swamped."""
    rng = np.random.default_rng(0)
    base = rng.uniform(0.6, 0.99, size=20)
    counts = np.full(20, 120.0)
    a = RunAccuracy(float(np.mean(base + 0.005)), base + 0.005, counts)
    b = RunAccuracy(float(np.mean(base)), base, counts)
    found = difference({0: a}, {0: b}, weighted=True)
    assert found.kind == PAIRED and found.diff == pytest.approx(0.5) and found.se == pytest.approx(0, abs=1e-9)
    assert not found.tie


def test_seeds_combine_within_and_between():
    mean, se = combine_seeds([0.1, 0.3], [0.05, 0.05])
    assert mean == pytest.approx(0.2)
    within, between = math.sqrt(2 * 0.05 ** 2) / 2, np.std([0.1, 0.3], ddof=1) / math.sqrt(2)
    assert se == pytest.approx(max(within, between)) and se == pytest.approx(between)
    assert combine_seeds([0.1, 0.1], [0.05, 0.05])[1] == pytest.approx(within)  # no spread: the clients' error
    assert combine_seeds([0.4], [0.07]) == (0.4, pytest.approx(0.07))


def test_binomial_fallback_is_labelled_and_in_quadrature():
    counts = np.full(20, 120.0)
    a, b = RunAccuracy(0.9850, None, counts), RunAccuracy(0.9841, None, counts)
    found = difference({0: a}, {0: b}, weighted=True)
    assert found.kind == BINOMIAL and "weaker" in found.kind
    assert found.diff == pytest.approx(0.09)
    assert found.se == pytest.approx(100 * math.hypot(binomial_se(0.985, 2400), binomial_se(0.9841, 2400)))
    # FedReMa vs FedAvg on seed 0 (+0.09): a tie, not a rank
    assert found.tie and "tie" in found.text()


def test_a_difference_is_a_tie_below_two_standard_errors_not_one():
    counts = np.full(20, 120.0)
    se_one = 100 * math.hypot(binomial_se(0.985, 2400), binomial_se(0.980, 2400))
    found = difference({0: RunAccuracy(0.985, None, counts)}, {0: RunAccuracy(0.980, None, counts)}, True)
    assert se_one < found.diff < 2 * se_one  # between 1 and 2 SE: still a tie
    assert found.tie
    far = difference({0: RunAccuracy(0.99, None, counts)}, {0: RunAccuracy(0.97, None, counts)}, True)
    assert not far.tie


def test_collapsed_tau_counts_noise_pairs_as_ties():
    ours, paper = [3.0, 2.0, 1.0], [2.0, 3.0, 1.0]
    none_tied = np.zeros((3, 3), dtype=bool)
    assert collapsed_kendall_tau(ours, paper, none_tied) == pytest.approx(1 / 3)
    tied = none_tied.copy()
    tied[0, 1] = tied[1, 0] = True  # the flipped pair within noise
    assert collapsed_kendall_tau(ours, paper, tied) == pytest.approx(2 / math.sqrt(2 * 3))


def test_summary_records_each_clients_accuracy(small_config):
    """A tiny run's summary has every client's accuracy and test count, and they give back the
    sample-weighted final, last-10 and best-round accuracies of the summary."""
    from pfedkit.runs import run

    small_config["rounds"] = 4
    summary = run(small_config).summary
    clients = summary["clients"]
    counts = np.array(clients["n_test"], dtype=float)
    assert len(counts) == small_config["num_clients"] and counts.min() > 0
    for key in ("final_acc", "best_acc"):
        values = np.array(clients[key])
        assert np.sum(counts * values) / counts.sum() == pytest.approx(summary[key])
    assert np.mean(clients["final_acc"]) == pytest.approx(summary["final_acc_unweighted"])
    assert np.mean(clients["best_acc_unweighted"]) == pytest.approx(summary["best_acc_unweighted"])
    assert np.sum(counts * np.array(clients["last10_acc"])) / counts.sum() == pytest.approx(summary["last10_acc"])
    paired = run_accuracy(summary, "best_acc")
    assert paired.client_acc is not None and paired.n_test is not None
    assert difference({0: paired}, {0: paired}, weighted=True).diff == 0


def test_paper_md_sets_every_row_against_the_papers_method_with_ties():
    """`pfedkit reproduce`'s paper.md: each row that ran against the paper's method (its first row
    with the paper's algorithm), ours ± SE (paired here: the summaries carry per-client accuracies),
    the paper's difference and the order word; the Kendall tau again with noise pairs as ties."""
    from pathlib import Path

    from pfedkit.experiments.comparison import Entry, RunRecord
    from pfedkit.experiments.paper_presets import Table, load_paper
    from pfedkit.experiments.reproduce import Plan, pair_table, paper_markdown, paper_table, with_collapsed_tau

    table = Table(id="1", source="Table 1", caption="test", metric="best_acc", seeds=1, columns=[{"name": "A"}],
                  rows=[{"method": "FedAvg", "algorithm": "fedavg", "paper": [90.0]},
                        {"method": "Near", "algorithm": "local", "paper": [96.0]},
                        {"method": "Far", "algorithm": "fedprox", "paper": [95.0]},
                        {"method": "Ours", "algorithm": "fedrema", "paper": [95.5]}])
    rng = np.random.default_rng(1)
    base = rng.uniform(0.85, 0.99, size=20)
    counts = [100] * 20

    def record(method: str, shift: np.ndarray) -> RunRecord:
        accs = base + shift
        return RunRecord(Entry(method, {}, group="A"), 0, Path("."), {
            "best_acc": float(np.mean(accs)), "clients": {"n_test": counts, "best_acc": list(accs)}})

    records = [record("Ours", 0 * base), record("FedAvg", np.full(20, -0.05)),
               record("Near", rng.normal(0.0005, 0.02, size=20)),  # within noise of Ours, paper puts it above
               record("Far", np.full(20, 0.01) + rng.normal(0, 0.001, size=20))]  # above Ours, paper below
    pairs = pair_table("fedrema", table, records).set_index("method")
    assert set(pairs["against"]) == {"Ours"} and set(pairs["se_kind"]) == {"paired per client"}
    assert pairs.loc["FedAvg", "diff"] == pytest.approx(-5.0) and pairs.loc["FedAvg", "order"] == "as printed"
    assert pairs.loc["Near", "order"] == "tie" and abs(pairs.loc["Near", "diff"]) < 2 * pairs.loc["Near", "se"]
    assert pairs.loc["Far", "order"] == "flipped" and pairs.loc["Far", "paper_diff"] == pytest.approx(-0.5)
    result = with_collapsed_tau(paper_table(table, records), table, records)
    paper = load_paper("fedrema")
    text = paper_markdown(Plan(paper, table, "smoke", paper.budgets["smoke"], [], [0]), result,
                          pair_table("fedrema", table, records))
    assert "Against Ours" in text and "| Near |" in text and "| tie |" in text and "| flipped |" in text
    assert "with the pairs inside 2 SE as ties" in text
    tau, tau_ties = result["kendall_tau"].iloc[0], result["kendall_tau_ties"].iloc[0]
    assert tau_ties != pytest.approx(tau)  # the Near-Ours flip no longer counts against the order


def test_the_command_line_reads_a_results_folder(tmp_path, capsys):
    """`python -m pfedkit.experiments.verdicts FOLDER COLUMN METRIC A B`: the runs of two cells of a
    results folder (named as `pfedkit reproduce` names them), paired where they carry clients."""
    import json

    from pfedkit.experiments.verdicts import committed_runs, main

    counts = [100] * 4
    for method, shift in (("FedReMa", 0.0), ("FedPAC (FC head)", 0.01)):
        for seed in (0, 1):
            accs = [0.90 + shift, 0.95 + shift, 0.97 + shift + 0.001 * seed, 0.92 + shift]
            run_dir = tmp_path / f"MNIST-{method.replace(' (', '_').replace(')', '').replace(' ', '_')}-s{seed}"
            run_dir.mkdir()
            (run_dir / "summary.json").write_text(json.dumps(
                {"best_acc": float(np.mean(accs)), "clients": {"n_test": counts, "best_acc": accs}}))
    runs = committed_runs(tmp_path, "MNIST", "FedPAC (FC head)", "best_acc")
    assert sorted(runs) == [0, 1] and runs[0].client_acc is not None
    assert main([str(tmp_path), "MNIST", "best_acc", "FedPAC (FC head)", "FedReMa"]) == 0
    out = capsys.readouterr().out
    assert "FedPAC (FC head) - FedReMa (best_acc): +1.00 ± 0.00" in out and "paired per client, 2 seeds" in out
    with pytest.raises(ValueError, match="no finished run"):
        committed_runs(tmp_path, "MNIST", "MOON", "best_acc")


def test_per_client_accuracies_take_the_rounds_each_metric_names():
    """Synthetic metrics, 3 clients over 12 rounds, best round 6 (not the last): each client's
    best-round, last-5, last-10 and final accuracy, weighted back to the summary's numbers."""
    import pandas as pd

    from pfedkit.evaluation import summarize

    counts = np.array([10, 20, 30])
    rows = []
    for rnd in range(1, 13):
        for cid, n in enumerate(counts):
            correct = int(min(n, n * (0.3 + 0.05 * rnd + 0.02 * cid))) if rnd != 6 else int(n)
            rows.append({"round": rnd, "client": cid, "n_test": int(n), "correct": correct, "accuracy": correct / n,
                         "balanced_acc": correct / n, "loss": 1.0, "bytes_up": 0, "bytes_down": 0})
    summary = summarize(pd.DataFrame(rows), algorithm="fedavg", dataset="digits", rounds=12, class_correct=None,
                        class_total=None, train_counts=np.zeros((3, 10)))
    clients = summary["clients"]
    assert summary["best_round"] == 6 and clients["best_acc"] == [1.0, 1.0, 1.0]
    for key in ("final_acc", "last5_acc", "last10_acc", "best_acc"):
        weighted = float(np.sum(counts * np.array(clients[key])) / counts.sum())
        assert weighted == pytest.approx(summary[key]), key
    assert clients["last5_acc"] != clients["last10_acc"] != clients["final_acc"]
