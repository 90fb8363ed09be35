"""FedProto's code's running per-client accuracy (pfedkit/experiments/running_accuracy.py)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from pfedkit.experiments.running_accuracy import describe, final_counts, main, running_accuracies


def test_each_clients_value_pools_the_counts_of_every_client_before_it():
    # 9/10, then (9 + 5) / (10 + 10), then (9 + 5 + 30) / (10 + 10 + 40)
    np.testing.assert_allclose(running_accuracies(np.array([9, 5, 30]), np.array([10, 10, 40])),
                               [90.0, 70.0, 100.0 * 44 / 60])


def test_the_last_value_is_the_pooled_accuracy_and_the_spread_shrinks():
    rng = np.random.default_rng(0)
    total = rng.integers(20, 200, size=20)
    correct = rng.binomial(total, rng.uniform(0.5, 1.0, size=20))
    running = running_accuracies(correct, total)
    assert running[-1] == pytest.approx(100.0 * correct.sum() / total.sum())
    assert running.std() < (100.0 * correct / total).std()


def test_equal_accuracies_give_the_same_value_for_every_client():
    np.testing.assert_allclose(running_accuracies(np.array([8, 4, 16]), np.array([10, 5, 20])), [80.0] * 3)


def test_counts_that_cannot_be_accuracies_are_refused():
    with pytest.raises(ValueError, match="one count per client"):
        running_accuracies(np.array([1, 2]), np.array([3]))
    with pytest.raises(ValueError, match="correct <= total"):
        running_accuracies(np.array([5]), np.array([4]))
    with pytest.raises(ValueError, match="total > 0"):
        running_accuracies(np.array([0]), np.array([0]))


def test_a_runs_counts_come_in_client_order_from_its_summary(tmp_path):
    summary = {"clients": {"client": [1, 0], "n_test": [40, 10], "final_acc": [0.5, 0.9]}}
    correct, total = final_counts(summary)
    np.testing.assert_array_equal(correct, [9, 20])
    np.testing.assert_array_equal(total, [10, 40])
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    # per client 90 and 50: mean 70 ± 20; running 90 then 29/50 = 58: mean 74 ± 16
    assert describe(tmp_path).endswith("per client 70.00 ± 20.00; running (FedProto's code) 74.00 ± 16.00")
    with pytest.raises(ValueError, match="no per-client accuracies"):
        final_counts({})


def test_the_command_names_a_directory_that_is_not_a_finished_run_and_goes_on(tmp_path, capsys):
    finished, unfinished = tmp_path / "done", tmp_path / "running"
    finished.mkdir(), unfinished.mkdir()
    (finished / "summary.json").write_text(json.dumps({"clients": {"client": [0], "n_test": [4], "final_acc": [0.5]}}))
    assert main([str(unfinished), str(finished)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"{unfinished}: no summary.json: not a finished run directory"
    assert lines[1].startswith(f"{finished}: per client 50.00 ± 0.00")
