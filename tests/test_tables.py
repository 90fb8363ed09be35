"""The plain-text tables a user reads after `pfedkit run` and `pfedkit compare`: every number a
run's options add (new clients' accuracy, epsilon) is in the table, not only in summary.json, and a
one-seed comparison prints values, not "± 0.00"."""
from __future__ import annotations

import json

import pytest

from pfedkit.cli import main

RUN = ["dataset=digits", "num_clients=5", "rounds=2", "threads=1", "batch_size=20", "lr=0.05", "seed=1"]


def printed_run(tmp_path, capsys, *options: str) -> tuple[dict[str, str], dict]:
    """`pfedkit run` with `options`: the printed table as {column: cell of the run's row}, the
    lines below it, and the run's summary.json."""
    assert main(["run", "-q", *RUN, f"out_dir={tmp_path / 'runs'}", *options]) == 0
    out = capsys.readouterr().out.splitlines()
    header, _, row = out[:3]
    columns = [name.strip() for name in header.split("  ") if name.strip()]
    cells = row.split()
    assert len(cells) == len(columns), (columns, cells)
    (run_dir,) = (tmp_path / "runs").iterdir()
    return dict(zip(columns, cells)), {"notes": out[3:], **json.loads((run_dir / "summary.json").read_text())}


def test_run_table_shows_the_new_clients_accuracy(tmp_path, capsys):
    cells, summary = printed_run(tmp_path, capsys, "new_clients=2")
    assert cells["new clients"] == f"{100 * summary['new_clients_headline_acc']:.2f}%"
    assert cells["headline"] == f"{100 * summary['headline_acc']:.2f}%"
    assert any(line.startswith("new clients:") and "2 clients" in line for line in summary["notes"])


def test_run_table_shows_epsilon_under_dp(tmp_path, capsys):
    pytest.importorskip("dp_accounting")
    cells, summary = printed_run(tmp_path, capsys, "dp.level=client")
    assert summary["epsilon"] > 0
    assert cells["epsilon"] == f"{summary['epsilon']:.3g}"
    assert any(line.startswith("epsilon:") and f"delta {summary['delta']:g}" in line and "client" in line
               for line in summary["notes"])


def test_run_table_without_those_options_has_no_such_columns(tmp_path, capsys):
    cells, _ = printed_run(tmp_path, capsys)
    assert "new clients" not in cells and "epsilon" not in cells


# ---- s_per_round: the rounds after the first ---------------------------------------------------

def slow_first_round(monkeypatch, seconds: float) -> None:
    """Make the first round a Simulation runs `seconds` slower, inside its timed part (what the
    first run of a process pays: the first optimiser imports torch._dynamo, kernels warm up)."""
    import time

    from pfedkit.engine.simulate import Simulation

    original = Simulation.round_participants

    def participants(self, rnd):
        if not getattr(self, "_test_slowed", False):
            self._test_slowed = True
            time.sleep(seconds)
        return original(self, rnd)

    monkeypatch.setattr(Simulation, "round_participants", participants)


def test_seconds_per_round_leave_out_the_first_round_of_a_process(tmp_path, monkeypatch, small_config):
    import pfedkit

    slow_first_round(monkeypatch, 1.5)
    summary = pfedkit.run(small_config).summary
    assert summary["seconds"] > 1.5  # the run's whole time still counts it
    assert summary["sec_first_round"] > 1.5
    assert summary["sec_per_round"] < 0.5 * summary["sec_first_round"]
    rest = (summary["seconds"] - summary["sec_first_round"]) / (small_config["rounds"] - 1)
    assert summary["sec_per_round"] == pytest.approx(rest, abs=1e-3)


def test_a_resumed_run_leaves_out_its_first_round_after_the_resume(tmp_path, monkeypatch, small_config):
    from conftest import interrupt_and_resume

    config = {**small_config, "rounds": 4}
    slow_first_round(monkeypatch, 1.0)  # the uninterrupted run and the crashed one each pay it once
    _, _, done, resumed = interrupt_and_resume(config, tmp_path, monkeypatch, after_round=2)
    assert done == 2
    # rounds 1 (crashed process) and 3 (resumed process) are start-up rounds: 2 left, both fast
    summary = resumed.summary
    assert summary["seconds"] > 1.0 and summary["sec_per_round"] < 0.5


# ---- pfedkit compare: one seed prints values -----------------------------------------------------

def printed_compare(out, capsys, seeds: str) -> list[list[str]]:
    """The rows of the table `pfedkit compare` prints (cells after method and seeds)."""
    assert main(["compare", "-q", "--algorithms", "fedavg,local", "--seeds", seeds, "--out", str(out),
                 *RUN[:-1]]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    return [[cell.strip() for cell in line.strip("|").split("|")][2:] for line in lines[1:]]


def test_one_seed_comparison_prints_values_without_spread(tmp_path, capsys):
    rows = printed_compare(tmp_path / "cmp", capsys, "0")
    assert len(rows) == 2 and all(cell and "±" not in cell for row in rows for cell in row), rows
    assert float(rows[0][0]) > 1  # best, in %
    table_md = (tmp_path / "cmp" / "table.md").read_text()
    assert "±" not in table_md.split("\n\n")[0] and "one seed" in table_md.split("\n\n")[1]
    # a second seed in the same directory: now every cell is mean ± std
    rows = printed_compare(tmp_path / "cmp", capsys, "0,1")
    assert all(" ± " in cell for row in rows for cell in row), rows
