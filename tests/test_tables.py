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
