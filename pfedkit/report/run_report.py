"""`pfedkit report RUN`: one HTML page (report/index.html) with the run's accuracy curves, the
spread over clients, client x class heatmaps of the data and of the output layer's row norms
(cwFedAvg Fig. 3/6 style), and the algorithm's own diagnostics plots."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import torch
import yaml

from pfedkit.evaluation import round_table
from pfedkit.report.html import Section, render
from pfedkit.report.plots import bands, heatmaps_side_by_side, lines

CLIENT_BAND = (10, 90)  # percentiles of the clients' accuracies drawn as the band


def client_spread(metrics: pd.DataFrame) -> pd.DataFrame:
    """Per evaluated round: mean client accuracy and the CLIENT_BAND percentiles over clients."""
    evaluated = metrics.dropna(subset=["accuracy"]).groupby("round")["accuracy"]
    low, high = CLIENT_BAND
    return pd.DataFrame({"mean": evaluated.mean(), "low": evaluated.quantile(low / 100),
                         "high": evaluated.quantile(high / 100)})


def read_run(run_dir: Path) -> tuple[dict, pd.DataFrame]:
    if not (run_dir / "metrics.csv").is_file():
        raise FileNotFoundError(f"{run_dir} has no metrics.csv; expected a run or comparison directory")
    return read_config(run_dir), pd.read_csv(run_dir / "metrics.csv")


def read_config(run_dir: Path) -> dict:
    return yaml.safe_load((run_dir / "config.yaml").read_text())


def run_figures(run_dir: Path, out_dir: Path) -> list[Path]:
    """The run's own figures: curves, client spread, heatmaps (when clients.npz exists), diagnostics."""
    from pfedkit.algorithms import get_algorithm

    config, metrics = read_run(run_dir)
    title = f"{config['algorithm']} on {config['dataset']}"
    table = round_table(metrics)
    written = [lines(table.index, {"sample-weighted": table["acc_weighted"], "unweighted": table["acc_mean"],
                                   "worst client": table["acc_worst"]},
                     out_dir / "accuracy.png", title, "round", "test accuracy")]
    spread = client_spread(metrics)
    low, high = CLIENT_BAND
    written.append(bands(spread.index, {f"clients: mean, {low}-{high}th percentile": (
        spread["mean"], spread["low"], spread["high"])}, out_dir / "accuracy_clients.png",
        f"{title}: spread over clients", "round", "client test accuracy"))
    written += client_heatmaps(run_dir, out_dir, title)
    diagnostics_file = run_dir / "diagnostics.pt"
    if diagnostics_file.is_file():
        written += get_algorithm(config["algorithm"]).report(torch.load(diagnostics_file, weights_only=False),
                                                             out_dir)
    return written


def client_heatmaps(run_dir: Path, out_dir: Path, title: str) -> list[Path]:
    """Training counts next to the output layer's row norms, and per-class test accuracy."""
    path = run_dir / "clients.npz"
    if not path.is_file():  # runs made before clients.npz existed
        return []
    with np.load(path) as saved:
        arrays = dict(saved)
    written = []
    norms = arrays.get("head_row_norms")
    if norms is not None and not np.isnan(norms).all():
        written.append(heatmaps_side_by_side(
            [arrays["train_counts"], norms], ["training samples", "output-layer row norm (last evaluation)"],
            out_dir / "clients_data_and_head_norms.png", f"{title}: per client x class", "class", "client",
            shared_scale=False))
    else:
        written.append(heatmaps_side_by_side([arrays["train_counts"]], ["training samples"],
                                             out_dir / "clients_data.png", title, "class", "client"))
    if "class_correct" in arrays:
        with np.errstate(invalid="ignore", divide="ignore"):
            accuracy = arrays["class_correct"] / arrays["class_total"]
        written.append(heatmaps_side_by_side([accuracy], ["test accuracy per class (last evaluation; blank: "
                                                          "no test samples)"],
                                             out_dir / "clients_class_accuracy.png", title, "class", "client"))
    return written


def report_run(run_dir: str | Path) -> list[Path]:
    """Write run_dir/report/ (PNGs and index.html); returns the files written, the page last."""
    run_dir = Path(run_dir)
    out_dir = run_dir / "report"
    figures = run_figures(run_dir, out_dir)
    config = read_config(run_dir)
    summary_file = run_dir / "summary.json"
    sections = [Section("Configuration", yaml.safe_dump({k: config[k] for k in (
        "algorithm", "dataset", "num_clients", "rounds", "seed") if k in config}, sort_keys=False).replace("\n", "; "))]
    if summary_file.is_file():
        import json

        summary = json.loads(summary_file.read_text())
        sections.append(Section("Summary", summary.get("headline", ""), tables=[summary_frame(summary)]))
    sections.append(Section("Figures", images=figures))
    page = render(f"{config['algorithm']} on {config['dataset']}: {run_dir.name}", sections, out_dir / "index.html")
    return figures + [page]


def summary_frame(summary: dict) -> pd.DataFrame:
    keys = ("best_acc", "last5_acc", "final_acc", "best_acc_unweighted", "last5_acc_unweighted",
            "final_acc_worst", "final_balanced_acc")
    frame = pd.DataFrame({key: [100 * summary[key] if summary.get(key) is not None else np.nan] for key in keys})
    frame["MB_up"] = summary.get("bytes_up", 0) / 1e6
    frame["s_per_round"] = summary.get("sec_per_round")
    return frame
