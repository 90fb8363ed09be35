"""Evaluation summaries: weighted vs unweighted means, best round, last-5, class groups, bytes."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from pfedkit.core.contract import message_bytes
from pfedkit.evaluation import evaluate_logits_fn, group_accuracy, round_table, summarize


def metrics_frame():
    # round 1: client 0 9/10, client 1 10/90 ; round 2: 5/10 and 80/90 ; round 3: 10/10, 0/90
    rows = []
    for rnd, results in ((1, [(9, 10), (10, 90)]), (2, [(5, 10), (80, 90)]), (3, [(10, 10), (0, 90)])):
        for cid, (correct, n) in enumerate(results):
            rows.append({"round": rnd, "client": cid, "correct": correct, "n_test": n, "accuracy": correct / n,
                         "loss": 1.0, "balanced_acc": correct / n, "bytes_up": 100, "bytes_down": 50})
    return pd.DataFrame(rows)


def test_weighted_and_unweighted_means_differ_as_defined():
    table = round_table(metrics_frame())
    assert table.loc[1, "acc_weighted"] == pytest.approx(19 / 100)
    assert table.loc[1, "acc_mean"] == pytest.approx((0.9 + 10 / 90) / 2)
    assert table.loc[2, "acc_worst"] == pytest.approx(0.5)


def test_summary_best_round_and_totals():
    summary = summarize(metrics_frame(), algorithm="x", dataset="d", rounds=3, class_correct=None,
                        class_total=None, train_counts=np.zeros((2, 2)))
    assert summary["best_round"] == 2 and summary["best_acc"] == pytest.approx(0.85)
    assert summary["best_acc_unweighted"] == pytest.approx((0.5 + 80 / 90) / 2)
    assert summary["final_acc"] == pytest.approx(0.1) and summary["final_acc_unweighted"] == pytest.approx(0.5)
    assert summary["last5_acc"] == pytest.approx((0.19 + 0.85 + 0.1) / 3)
    assert summary["bytes_up"] == 600 and summary["bytes_down"] == 300


def test_summary_says_how_far_the_last_ten_rounds_moved_and_the_steps_a_round():
    """25 rounds of 2 clients: client 0 right r times in 100 in round r, client 1 always half;
    client 1 trains 3 steps a round, client 0 only in odd rounds (5 steps), dropped in round 25."""
    rows = []
    for rnd in range(1, 26):
        for cid, (correct, n) in enumerate(((rnd, 100), (50, 100))):
            rows.append({"round": rnd, "client": cid, "correct": correct, "n_test": n, "accuracy": correct / n,
                         "loss": 1.0, "balanced_acc": 0.0, "bytes_up": 0, "bytes_down": 0,
                         "participated": int(cid == 1 or rnd % 2 == 1),
                         "train_steps": 3 if cid == 1 else (5 if rnd % 2 == 1 and rnd < 25 else 0),
                         "dropped": int(cid == 0 and rnd == 25)})
    summary = summarize(pd.DataFrame(rows), algorithm="x", dataset="d", rounds=25, class_correct=None,
                        class_total=None, train_counts=np.zeros((2, 2)))
    # rounds 16-25 against 6-15: client 0's accuracy moved by 10 points, the mean over clients by 5
    assert summary["last10_acc_unweighted"] - summary["prev10_acc_unweighted"] == pytest.approx(0.05)
    assert summary["prev10_acc"] == pytest.approx(np.mean([(r + 50) / 200 for r in range(6, 16)]))
    # participants' rows only (client 0's even rounds and its dropped round 25 left out)
    assert summary["train_steps_min"] == 3 and summary["train_steps_max"] == 5
    assert summary["train_steps_mean"] == pytest.approx((25 * 3 + 12 * 5) / 37)
    short = summarize(pd.DataFrame(rows[:38]), algorithm="x", dataset="d", rounds=19, class_correct=None,
                      class_total=None, train_counts=np.zeros((2, 2)))
    assert short["prev10_acc"] is None  # fewer than 20 evaluated rounds: nothing to compare with


def test_group_accuracy_uses_training_counts_thresholds():
    train_counts = np.array([[100, 50, 10, 0]])
    class_correct = np.array([[9, 4, 1, 0]])
    class_total = np.array([[10, 5, 2, 3]])
    groups = group_accuracy(class_correct, class_total, train_counts)
    assert groups == {"few": 0.5, "medium": 0.8, "many": 0.9, "absent": 0.0}


def test_evaluate_counts_per_class_hits():
    logits = torch.tensor([[2.0, 0.0], [0.0, 1.0], [3.0, 0.0]])
    y = torch.tensor([0, 0, 1])
    result = evaluate_logits_fn(lambda xb: xb, logits, y, num_classes=2, batch_size=2)
    assert result.correct == 1 and result.n_test == 3
    assert result.class_correct.tolist() == [1, 0] and result.class_total.tolist() == [2, 1]
    assert result.balanced_accuracy == pytest.approx(0.25)


def test_message_bytes_counts_payloads():
    message = {"params": {"w": torch.zeros(3, 4), "b": torch.zeros(4, dtype=torch.float64)},
               "weight": 17, "counts": np.zeros(10, dtype=np.int64)}
    assert message_bytes(message) == 48 + 32 + 8 + 80
    assert message_bytes({}) == 0


def early_peak_frame(rounds: int = 12) -> pd.DataFrame:
    """Two clients (10 and 90 test samples) whose accuracy peaks in round 2 and then drifts down:
    the best round is not among the last 5 or 10, and weighted and unweighted means differ."""
    rows = []
    for rnd in range(1, rounds + 1):
        small, large = (10, 90) if rnd == 2 else (max(0, 8 - rnd // 2), 30 + rnd)
        for cid, (correct, n) in enumerate(((small, 10), (large, 90))):
            rows.append({"round": rnd, "client": cid, "correct": correct, "n_test": n, "accuracy": correct / n,
                         "loss": 1.0, "balanced_acc": correct / n, "bytes_up": 0, "bytes_down": 0})
    return pd.DataFrame(rows)


@pytest.mark.parametrize("point", ["best", "last5", "last10", "final"])
@pytest.mark.parametrize("weighting", ["weighted", "unweighted"])
def test_the_headline_is_the_point_and_weighting_asked_for(point, weighting):
    """Computed here from the rows: per round the weighted mean (pooled correct / pooled n) or the
    unweighted mean over clients, then the best round, the mean of the last 5 or 10, or the last."""
    frame = early_peak_frame()
    per_round = []
    for _, rows in frame.groupby("round"):
        per_round.append(rows["correct"].sum() / rows["n_test"].sum() if weighting == "weighted"
                         else rows["accuracy"].mean())
    expected = {"best": max(per_round), "last5": np.mean(per_round[-5:]), "last10": np.mean(per_round[-10:]),
                "final": per_round[-1]}
    assert per_round.index(max(per_round)) == 1  # round 2: outside the last 10 of 12 rounds
    assert len({round(v, 9) for v in expected.values()}) == 4  # four different answers
    summary = summarize(frame, algorithm="x", dataset="d", rounds=12, class_correct=None, class_total=None,
                        train_counts=np.zeros((2, 2)), weighting=weighting, point=point)
    assert summary["headline_acc"] == pytest.approx(expected[point], abs=1e-12)
    assert weighting in summary["headline"] and summary["best_round"] == 2
