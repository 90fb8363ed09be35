"""Is a difference between two rows of a table a result or noise? The difference and its standard error.

A paper's order between two methods is reproduced, flipped, or a **tie** (within noise): a flip
whose |difference| is below `TIE_SE` = 2 standard errors is reported as a tie, not a rank.

The difference of two rows is that of their headline accuracies (the table's metric, in points,
mean over seeds). Its standard error, in points, comes in one of two kinds:

* **paired per client** (both rows' runs record per-client accuracies, `summary.json` "clients",
  and share a seed, hence the same partition, the same clients and test samples): for one seed,
  with d_k = a_k - b_k the per-client difference at the metric's round(s) and w_k the metric's
  client weights (test counts for a sample-weighted metric, 1 for an unweighted one), normalised
  to sum to 1, D = sum_k w_k d_k and

      SE_seed = sqrt( K / (K - 1) * sum_k w_k^2 (d_k - D)^2 )

  (with equal weights: the sample std of the d_k, ddof = 1, over sqrt(K)). Over S paired seeds
  the difference is the mean of the per-seed differences (of the headline metric) and

      SE = max( sqrt(sum_s SE_s^2) / S ,  std_s(D_s, ddof=1) / sqrt(S) )   (second term: S >= 2)

  the larger of the within-seed (client) error and the spread over seeds.

* **binomial** (the weaker estimate, used where a run has no per-client accuracies, as every run
  committed before this module): each row alone, a run's accuracy p over its n test samples has
  SE_run = sqrt(p (1 - p) / n) (an unweighted mean over K clients: sqrt(p (1 - p) sum_k 1/n_k) / K);
  a row's mean over its S seeds has SE = max(sqrt(sum_s SE_run,s^2) / S, std_s(p_s, ddof=1) / sqrt(S)),
  and the difference's SE = sqrt(SE_a^2 + SE_b^2) (in quadrature: unpaired, so it ignores that
  the two rows share clients). It treats a best-round maximum as one round's accuracy, so it
  understates that metric's noise.

`collapsed_kendall_tau` is Kendall's tau-b between our order and the paper's where a pair of
rows whose difference lies within `TIE_SE` standard errors counts as tied in ours.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

TIE_SE = 2.0  # a difference below this many standard errors is a tie
PAIRED = "paired per client"
BINOMIAL = "binomial, unpaired (weaker)"


def binomial_se(p: float, n_test: int | np.ndarray, weighted: bool = True) -> float:
    """SE of an accuracy p (a fraction) over test counts `n_test`: sqrt(p (1 - p) / n) for one
    count or a sample-weighted mean over clients (n = their sum); for an unweighted mean over K
    clients with counts n_k: sqrt(p (1 - p) sum_k 1/n_k) / K."""
    counts = np.atleast_1d(np.asarray(n_test, dtype=float))
    if weighted or len(counts) == 1:
        return math.sqrt(p * (1 - p) / counts.sum())
    return math.sqrt(p * (1 - p) * np.sum(1 / counts)) / len(counts)


def paired_client_se(diffs: np.ndarray, weights: np.ndarray) -> tuple[float, float]:
    """(D, SE) of the weighted mean D = sum w_k d_k of per-client differences `diffs` (weights
    normalised to sum 1): SE = sqrt(K / (K - 1) * sum w_k^2 (d_k - D)^2)."""
    diffs, weights = np.asarray(diffs, dtype=float), np.asarray(weights, dtype=float)
    if len(diffs) < 2:
        raise ValueError(f"a paired standard error needs at least 2 clients, got {len(diffs)}")
    weights = weights / weights.sum()
    mean = float(np.sum(weights * diffs))
    count = len(diffs)
    return mean, math.sqrt(count / (count - 1) * float(np.sum(weights ** 2 * (diffs - mean) ** 2)))


def combine_seeds(values: list[float], ses: list[float]) -> tuple[float, float]:
    """(mean, SE) over seeds of per-seed `values` with per-seed standard errors `ses`: the larger of
    sqrt(sum SE_s^2) / S and, with S >= 2, the spread over seeds std(values, ddof=1) / sqrt(S)."""
    count = len(values)
    if count == 0 or count != len(ses):
        raise ValueError(f"combine_seeds: {count} values and {len(ses)} standard errors")
    within = math.sqrt(sum(se ** 2 for se in ses)) / count
    if count < 2:
        return float(values[0]), within
    between = float(np.std(values, ddof=1)) / math.sqrt(count)
    return float(np.mean(values)), max(within, between)


@dataclass(frozen=True)
class RunAccuracy:
    """One run's headline accuracy (a fraction) and, where its summary records them, each client's
    accuracy at the same round(s) and test count."""
    value: float
    client_acc: np.ndarray | None = None
    n_test: np.ndarray | None = None


def client_key(metric: str) -> str:
    """The summary's `clients` entry a table metric pairs on: best_acc -> best_acc (the clients at
    the weighted best round), best_acc_unweighted -> best_acc_unweighted; final/last5/last10 are
    the same rounds for both weightings."""
    return metric if metric.startswith("best") else metric.removesuffix("_unweighted")


def run_accuracy(summary: dict[str, Any], metric: str, n_test: np.ndarray | None = None) -> RunAccuracy:
    """A summary's `metric` and its per-client accuracies (summary "clients", written since
    per-client accuracies are recorded); `n_test`: the clients' test counts for a summary without
    them (client_test_counts)."""
    clients = summary.get("clients") or {}
    values = clients.get(client_key(metric))
    counts = clients.get("n_test", n_test)
    return RunAccuracy(float(summary[metric]), None if values is None else np.asarray(values, dtype=float),
                       None if counts is None else np.asarray(counts, dtype=float))


@dataclass(frozen=True)
class Difference:
    """Row a minus row b, in points, with its standard error and how it was estimated."""
    diff: float
    se: float
    seeds: int
    kind: str  # PAIRED or BINOMIAL

    @property
    def tie(self) -> bool:
        """Within noise: |diff| < TIE_SE standard errors."""
        return abs(self.diff) < TIE_SE * self.se

    def text(self) -> str:
        """`+0.09 ± 0.25 (tie; binomial, unpaired (weaker), 1 seed)`."""
        seeds = f"{self.seeds} seed{'s' if self.seeds != 1 else ''}"
        return f"{self.diff:+.2f} ± {self.se:.2f} ({'tie; ' if self.tie else ''}{self.kind}, {seeds})"


def difference(a: dict[int, RunAccuracy], b: dict[int, RunAccuracy], weighted: bool) -> Difference:
    """Row a minus row b (runs by seed), in points: paired per client over the seeds both have when
    every one of those runs records per-client accuracies on the same number of clients; else
    binomial per row over all its seeds (module docstring)."""
    if not a or not b:
        raise ValueError("difference: each row needs at least one finished run")
    shared = sorted(set(a) & set(b))
    if shared and all(_pairable(a[s], b[s]) for s in shared):
        diffs, ses = [], []
        for seed in shared:
            weights = a[seed].n_test if weighted else np.ones(len(a[seed].client_acc))
            _, se = paired_client_se(a[seed].client_acc - b[seed].client_acc, weights)
            diffs.append(a[seed].value - b[seed].value)
            ses.append(se)
        mean, se = combine_seeds(diffs, ses)
        return Difference(100 * mean, 100 * se, len(shared), PAIRED)
    mean_a, se_a = _row_binomial(a, weighted)
    mean_b, se_b = _row_binomial(b, weighted)
    return Difference(100 * (mean_a - mean_b), 100 * math.hypot(se_a, se_b), min(len(a), len(b)), BINOMIAL)


def _pairable(a: RunAccuracy, b: RunAccuracy) -> bool:
    return (a.client_acc is not None and b.client_acc is not None and a.n_test is not None
            and len(a.client_acc) == len(b.client_acc) == len(a.n_test) >= 2)


def _row_binomial(runs: dict[int, RunAccuracy], weighted: bool) -> tuple[float, float]:
    missing = [seed for seed, run in runs.items() if run.n_test is None]
    if missing:
        raise ValueError(f"binomial SE: seed(s) {missing} have no test counts; pass n_test to run_accuracy")
    values = [run.value for run in runs.values()]
    return combine_seeds(values, [binomial_se(run.value, run.n_test, weighted) for run in runs.values()])


def collapsed_kendall_tau(ours: list[float], paper: list[float], tied: np.ndarray) -> float:
    """Kendall's tau-b of our values against the paper's, where `tied[i, j]` (ours within noise)
    makes pair (i, j) a tie in our order: (C - D) / sqrt((P - T_ours) (P - T_paper)) over the P
    pairs, C concordant, D discordant, T tied. NaN when either order is all ties."""
    count = len(ours)
    concordant = discordant = tied_ours = tied_paper = pairs = 0
    for i in range(count):
        for j in range(i + 1, count):
            pairs += 1
            ours_sign = 0 if tied[i, j] else np.sign(ours[i] - ours[j])
            paper_sign = np.sign(paper[i] - paper[j])
            tied_ours += ours_sign == 0
            tied_paper += paper_sign == 0
            if ours_sign and paper_sign:
                concordant += ours_sign == paper_sign
                discordant += ours_sign != paper_sign
    denominator = math.sqrt((pairs - tied_ours) * (pairs - tied_paper))
    return (concordant - discordant) / denominator if denominator else float("nan")


def client_test_counts(run_dir: Path, data_dir: str | None = None) -> np.ndarray:
    """Each client's test count of a committed run without per-client accuracies: its partition
    rebuilt from its config.yaml (needs the dataset; `data_dir` overrides the config's)."""
    from pfedkit.config import load_config
    from pfedkit.data.federated import split_indices
    from pfedkit.federation import split_plan

    config = load_config(Path(run_dir) / "config.yaml")
    if data_dir is not None:
        config = config.model_copy(update={"data_dir": data_dir})
    _, test_index = split_indices(split_plan(config), _dataset(config.dataset, config.data_dir, config))
    return np.array([len(rows) for rows in test_index], dtype=float)


_LOADED: dict[tuple, Any] = {}


def _dataset(name: str, data_dir: str | None, config):
    """config_dataset, loaded once per (dataset, data_dir): a table's runs share it."""
    from pfedkit.federation import config_dataset

    key = (name, data_dir)
    if key not in _LOADED:
        _LOADED.clear()  # one dataset in memory at a time
        _LOADED[key] = config_dataset(config)
    return _LOADED[key]


def committed_runs(folder: Path, column: str, method: str, metric: str,
                   data_dir: str | None = None) -> dict[int, RunAccuracy]:
    """{seed: RunAccuracy} of the runs of one table cell in a results folder (run directories named
    `COLUMN-METHOD-sSEED`, as `pfedkit reproduce` names them), test counts rebuilt where needed."""
    import json
    import re

    from pfedkit.experiments.comparison import run_name
    from pfedkit.experiments.comparison import Entry

    stem = run_name(Entry(method, {}, group=column), 0).removesuffix("-s0")
    runs = {}
    for run_dir in sorted(Path(folder).glob(f"{stem}-s*")):
        match = re.fullmatch(rf"{re.escape(stem)}-s(\d+)", run_dir.name)
        if match is None or not (run_dir / "summary.json").is_file():
            continue
        summary = json.loads((run_dir / "summary.json").read_text())
        counts = None if (summary.get("clients") or {}).get("n_test") else client_test_counts(run_dir, data_dir)
        runs[int(match.group(1))] = run_accuracy(summary, metric, counts)
    if not runs:
        raise ValueError(f"{folder}: no finished run of column {column!r}, method {method!r} ({stem}-sSEED)")
    return runs


def main(argv: list[str] | None = None) -> int:
    """`python -m pfedkit.experiments.verdicts FOLDER COLUMN METRIC A B [--data-dir DIR]`: row A
    minus row B of a committed results folder, ± its standard error, and whether it is a tie."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m pfedkit.experiments.verdicts", description=main.__doc__)
    parser.add_argument("folder", type=Path)
    parser.add_argument("column", help="the table column, as in the run names (e.g. MNIST, C_2, n_3)")
    parser.add_argument("metric", help="a summary.json key: best_acc, last10_acc_unweighted ...")
    parser.add_argument("a")
    parser.add_argument("b")
    parser.add_argument("--data-dir", default=None, help="where an old run's dataset is (to rebuild test counts)")
    args = parser.parse_args(argv)
    weighted = not args.metric.endswith("_unweighted")
    found = difference(committed_runs(args.folder, args.column, args.a, args.metric, args.data_dir),
                       committed_runs(args.folder, args.column, args.b, args.metric, args.data_dir), weighted)
    print(f"{args.a} - {args.b} ({args.metric}): {found.text()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
