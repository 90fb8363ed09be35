"""The plain-text table of run summaries that `pfedkit run` and `pfedkit flower simulate | local`
print after a run (one row per summary.json).

Every number a run's options add to summary.json is a column too, shown only when some run has it:
`new clients` (config new_clients: the clients that never trained, at the headline's point) and
`epsilon` (config dp: the run's guarantee after the rounds done). Columns are separated by two
spaces, so that a name of two words ("final acc") still reads as one column."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Column:
    name: str
    width: int
    cell: Callable[[dict], str]


def _pct(value) -> str:
    return "-" if value is None else f"{100 * value:.2f}%"


def _epsilon(value) -> str:
    return "-" if value is None else f"{value:.3g}"


COLUMNS = (
    Column("headline", 9, lambda s: _pct(s.get("headline_acc"))),
    Column("final acc", 9, lambda s: _pct(s["final_acc"])),
    Column("last-5 acc", 10, lambda s: _pct(s["last5_acc"])),
    Column("best acc", 8, lambda s: _pct(s["best_acc"])),
    Column("best round", 10, lambda s: str(s["best_round"])),
)
NEW_CLIENTS = Column("new clients", 11, lambda s: _pct(s.get("new_clients_headline_acc")))
EPSILON = Column("epsilon", 8, lambda s: _epsilon(s.get("epsilon")))
COSTS = (
    Column("MB up", 8, lambda s: f"{s['bytes_up'] / 1e6:.2f}"),
    Column("seconds", 8, lambda s: f"{s['seconds']:.1f}"),
)


def results_table(summaries: list[dict]) -> str:
    """One row per run summary: headline, final, last-5 and best accuracy, best round, the new
    clients' accuracy and epsilon where a run has them, MB uploaded and seconds; then the
    headline's definition and how the other columns are computed."""
    columns = list(COLUMNS)
    columns += [column for column, key in ((NEW_CLIENTS, "new_clients_headline_acc"), (EPSILON, "epsilon"))
                if any(s.get(key) is not None for s in summaries)]
    columns += COSTS
    header = "  ".join([f"{'algorithm':<12}"] + [f"{c.name:>{c.width}}" for c in columns])
    lines = [header, "-" * len(header)]
    for s in summaries:
        lines.append("  ".join([f"{s['algorithm']:<12}"] + [f"{c.cell(s):>{c.width}}" for c in columns]))
    headlines = sorted({s.get("headline", "") for s in summaries} - {""})
    lines.append("headline: " + " | ".join(headlines) if headlines else "")
    lines.append("other columns: sample-weighted mean over clients' test splits; best round is chosen on test data")
    lines += dict.fromkeys(note for s in summaries for note in option_notes(s))  # once each, in order
    return "\n".join(line for line in lines if line)


def option_notes(summary: dict) -> list[str]:
    """What the new clients and epsilon columns are, for the run that has them."""
    notes = []
    if summary.get("new_clients_headline_acc") is not None:
        count, epochs = len(summary.get("new_clients") or []), summary.get("new_client_finetune", 0)
        notes.append(f"new clients: the {count} clients that never trained (config new_clients), evaluated on "
                     f"what a joining client receives after {epochs} local epochs; the headline's point and "
                     "weighting; every other accuracy is the participants'")
    if summary.get("epsilon") is not None:
        notes.append(f"epsilon: the ({summary['epsilon']:.3g}, delta {summary.get('delta'):g}) guarantee of "
                     f"dp.level={summary.get('dp_level')} after the {summary.get('rounds_done')} rounds done "
                     "(docs/privacy.md)")
    return notes
