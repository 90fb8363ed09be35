"""Per-round curves of both libraries and the row that compares them.

A curves file (one per split and method, committed under docs/results/conformance/<split>/) has
one line per library, seed and evaluated round: `library` (pfedkit and one other: PFLlib or FL-bench),
`seed`, `round`, `accuracy` (sample-weighted over all clients' test rows, a fraction). The other
library's round 0 (the initial model) is kept in the file; rows use rounds 1..R, which both sides evaluate.

A row: per library, the mean over seeds of the best accuracy, of the mean of the last 10 rounds
and of the round of the best; the spread is the range (max - min) over seeds of the last-10 means;
the differences are pfedkit minus the other library. Agreement: |difference of last-10 means| at most the
larger of the two sides' spreads.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pandas as pd

LAST = 10
COLUMNS = ["library", "seed", "round", "accuracy"]
LIBRARIES = ("pfedkit", "PFLlib", "FL-bench")


def other_library(curves: pd.DataFrame) -> str:
    """The library a curves file compares pfedkit with (PFLlib when the file holds only pfedkit)."""
    others = sorted(set(curves["library"]) - {"pfedkit"})
    if len(others) > 1:
        raise ValueError(f"a curves file compares pfedkit with one library, not {others}")
    return others[0] if others else "PFLlib"


def pfedkit_curve(run_dir: Path) -> dict[int, float]:
    """{round: sample-weighted accuracy} of a pfedkit run directory's metrics.csv."""
    from pfedkit.evaluation import round_table

    table = round_table(pd.read_csv(Path(run_dir) / "metrics.csv"))
    return {int(rnd): float(acc) for rnd, acc in table["acc_weighted"].items()}


def curve_frame(library: str, seed: int, curve: dict[int, float]) -> pd.DataFrame:
    return pd.DataFrame({"library": library, "seed": seed, "round": list(curve), "accuracy": list(curve.values())},
                        columns=COLUMNS)


@dataclass(frozen=True)
class SideSummary:
    seeds: int
    best: float            # mean over seeds, percent
    last10: float          # mean over seeds, percent
    round_of_best: float   # mean over seeds
    spread: float          # max - min over seeds of the last-10 means, percent
    rounds: int
    first: int = 1         # the first round compared (2 where the other library never evaluates round 1)


def seed_summary(accuracy: pd.Series) -> tuple[float, float, int]:
    """(best %, last-10 mean %, round of best) of one seed's accuracy indexed by round (>= 1)."""
    accuracy = accuracy.sort_index()
    return 100 * accuracy.max(), 100 * accuracy.iloc[-LAST:].mean(), int(accuracy.idxmax())


def side_summary(curves: pd.DataFrame, library: str, rounds: int, first: int = 1) -> SideSummary | None:
    """One library's summary over its seeds, counting only seeds evaluated at every round first..rounds."""
    side = curves[(curves["library"] == library) & (curves["round"].between(first, rounds))]
    per_seed = [seed_summary(group.set_index("round")["accuracy"]) for _, group in side.groupby("seed")
                if group["round"].nunique() == rounds - first + 1]
    if not per_seed:
        return None
    best, last10, at = zip(*per_seed)
    return SideSummary(len(per_seed), sum(best) / len(best), sum(last10) / len(last10), sum(at) / len(at),
                       max(last10) - min(last10), rounds, first)


@dataclass(frozen=True)
class Row:
    method: str
    pfedkit: SideSummary | None
    other: SideSummary | None     # the other library's side (PFLlib or FL-bench: other_library)
    other_library: str = "PFLlib"

    @property
    def complete(self) -> bool:
        return self.pfedkit is not None and self.other is not None

    def difference(self, name: str) -> float:
        return getattr(self.pfedkit, name) - getattr(self.other, name)

    @property
    def within_spread(self) -> bool:
        return abs(self.difference("last10")) <= max(self.pfedkit.spread, self.other.spread)


def compare(method: str, curves: pd.DataFrame, rounds: int, first: int = 1) -> Row:
    """Both sides over rounds first..rounds (first > 1 where a side never evaluates the early rounds:
    FL-bench's test path starts after one aggregation, its CCVR curve at round 2)."""
    other = other_library(curves)
    return Row(method, side_summary(curves, "pfedkit", rounds, first), side_summary(curves, other, rounds, first),
               other)


def first_common_round(curves: pd.DataFrame) -> int:
    """The first round (>= 1) from which every library in the file has a point: where one side's
    curve starts later, the row compares both from there."""
    evaluated = curves[curves["round"] >= 1].groupby("library")["round"].min()
    return int(evaluated.max()) if len(evaluated) else 1


def paired_last10(curves: pd.DataFrame, rounds: int) -> dict[int, float]:
    """{seed: pfedkit's last-10 mean minus the other library's, in points} for the seeds both sides
    completed (a seed is the same partition on both sides)."""
    other = other_library(curves)
    window = curves[curves["round"].between(rounds - LAST + 1, rounds)]
    means = window.groupby(["library", "seed"])["accuracy"].agg(["mean", "count"])
    complete = means[means["count"] == LAST]["mean"]
    seeds = sorted(set(complete.get("pfedkit", pd.Series()).index) & set(complete.get(other, pd.Series()).index))
    return {int(s): 100 * (complete["pfedkit"][s] - complete[other][s]) for s in seeds}


def markdown_row(row: Row, verdict: str) -> str:
    """| method | rounds | seeds | pfedkit best / last-10 / round | the other library's ... | differences | spread | verdict |"""
    if not row.complete:
        return f"| {row.method} | | | | | | | not run yet |"
    kit, lib = row.pfedkit, row.other
    sides = [f"{s.best:.2f} / {s.last10:.2f} / {s.round_of_best:.0f}" for s in (kit, lib)]
    differences = (f"{row.difference('best'):+.2f} / {row.difference('last10'):+.2f} / "
                   f"{row.difference('round_of_best'):+.0f}")
    spread = f"{kit.spread:.2f} / {lib.spread:.2f}"
    rounds = f"{kit.rounds}" if kit.first == 1 else f"{kit.rounds} (rounds {kit.first}-{kit.rounds} compared)"
    return f"| {row.method} | {rounds} | {kit.seeds} + {lib.seeds} | {sides[0]} | {sides[1]} | {differences} | {spread} | {verdict} |"


def table_header(other: str = "PFLlib") -> str:
    return (f"| method | rounds | seeds (pfedkit + {other}) | pfedkit best / last-10 / round of best | "
            f"{other} best / last-10 / round of best | difference (pfedkit − {other}) | seed spread of last-10 "
            f"(pfedkit / {other}) | verdict |\n|---|---|---|---|---|---|---|---|")



def read_curves(path: Path) -> pd.DataFrame:
    return pd.read_csv(path)
