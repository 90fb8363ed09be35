"""`pfedkit report RUN`: one HTML page (report/index.html) with the run's accuracy curves, the
spread over clients, client x class heatmaps of the data and of the output layer's row norms
(cwFedAvg Fig. 3/6 style), and the algorithm's own diagnostics plots.

Units: every accuracy on the page is in percent (0-100): the tables and the plots' axes alike
(metrics.csv and summary.json keep fractions 0-1; the report multiplies by PERCENT). The page
shows the run's whole config.yaml (the resolved config) in a collapsed block.

metrics.csv and summary.json are read and checked (`read_metrics`, `read_summary`) before any
figure is written: a damaged one is a one-line error naming it, and no half report is left.
diagnostics.pt and clients.npz are read as data, never unpickled (pfedkit/run_files.py): a run
sent for a report cannot run code; a damaged or foreign one is one error line naming it.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

from pfedkit.core.errors import ConfigError
from pfedkit.evaluation import round_table
from pfedkit.report.html import Section, render
from pfedkit.report.methods import draw_diagnostics
from pfedkit.report.plots import bands, heatmaps_side_by_side, lines
from pfedkit.run_files import DIAGNOSTICS, read_arrays, read_diagnostics

CLIENT_BAND = (10, 90)  # percentiles of the clients' accuracies drawn as the band
PERCENT = 100.0  # accuracies are stored as fractions and shown in %
ACCURACY_AXIS = "test accuracy (%)"
ACCURACY_NOTE = "accuracies in % (0-100), in the tables and on the plots' axes"
HEADLINE_CONFIG_KEYS = ("algorithm", "dataset", "model", "num_clients", "rounds", "seed")


def client_spread(metrics: pd.DataFrame) -> pd.DataFrame:
    """Per evaluated round: mean client accuracy and the CLIENT_BAND percentiles over clients
    (fractions 0-1, as in metrics.csv)."""
    evaluated = metrics.dropna(subset=["accuracy"]).groupby("round")["accuracy"]
    low, high = CLIENT_BAND
    return pd.DataFrame({"mean": evaluated.mean(), "low": evaluated.quantile(low / 100),
                         "high": evaluated.quantile(high / 100)})


def read_run(run_dir: Path) -> tuple[dict, pd.DataFrame]:
    if not (run_dir / "metrics.csv").is_file():
        raise FileNotFoundError(f"{run_dir} has no metrics.csv; expected a run or comparison directory")
    return read_config(run_dir), read_metrics(run_dir)


# The metrics.csv columns the report draws from (evaluation.round_table, client_spread).
METRICS_COLUMNS = ("round", "accuracy", "correct", "n_test", "balanced_acc", "loss")
DAMAGED_FIX = "it is damaged or not a pfedkit file: restore it from a copy, or run the run again"


def read_metrics(run_dir: Path) -> pd.DataFrame:
    """The run's metrics.csv; ConfigError (one line naming the file) when it is empty, not UTF-8
    CSV, or lacks a numeric column the report draws."""
    path = run_dir / "metrics.csv"
    try:
        metrics = pd.read_csv(path, encoding="utf-8")
    except UnicodeDecodeError as err:
        problem = f"not text (byte {err.start}: {err.reason})"
    except pd.errors.EmptyDataError:
        problem = "empty"
    except pd.errors.ParserError as err:
        problem = f"not a CSV table ({' '.join(str(err).split())})"
    else:
        missing = [name for name in METRICS_COLUMNS
                   if name not in metrics.columns or not pd.api.types.is_numeric_dtype(metrics[name])]
        if not missing:
            return metrics
        problem = f"no numeric column {', '.join(missing)}"
    raise ConfigError(f"{path.absolute()}: {problem}; {DAMAGED_FIX}")


def read_summary(run_dir: Path) -> dict | None:
    """The run's summary.json (None without one: a run still going, or killed); ConfigError (one
    line naming the file) when it is not UTF-8 JSON of an object."""
    path = run_dir / "summary.json"
    if not path.is_file():
        return None
    try:
        summary = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as err:
        problem = f"not text (byte {err.start}: {err.reason})"
    except json.JSONDecodeError as err:
        problem = f"not JSON ({err.msg} at line {err.lineno}, column {err.colno})"
    else:
        if isinstance(summary, dict):
            return summary
        problem = f"JSON of a {type(summary).__name__}, not of an object"
    raise ConfigError(f"{path.absolute()}: {problem}; {DAMAGED_FIX}")


def read_config(run_dir: Path) -> dict:
    """The run's config.yaml (a one-line ConfigError naming it when it is not UTF-8 YAML of a mapping)."""
    from pfedkit.config import read_yaml_file

    path = run_dir / "config.yaml"
    config = read_yaml_file(path, str(path))
    if not isinstance(config, dict):
        raise ConfigError(f"{path}: not a pfedkit config (expected a mapping of keys); report a run directory")
    return config


def run_figures(run_dir: Path, out_dir: Path) -> list[Path]:
    """The run's own figures: curves, client spread, heatmaps (when clients.npz exists), diagnostics."""
    from pfedkit.algorithms import get_algorithm

    config, metrics = read_run(run_dir)
    # the run's data files first: a damaged or foreign one stops the report before it draws anything
    diagnostics_file = run_dir / DIAGNOSTICS
    diagnostics = read_diagnostics(diagnostics_file) if diagnostics_file.is_file() else None
    tables = client_tables(run_dir)
    title = f"{config['algorithm']} on {config['dataset']}"
    table = round_table(metrics)
    written = [lines(table.index, {"sample-weighted": PERCENT * table["acc_weighted"],
                                   "unweighted": PERCENT * table["acc_mean"],
                                   "worst client": PERCENT * table["acc_worst"]},
                     out_dir / "accuracy.png", title, "round", ACCURACY_AXIS)]
    spread = PERCENT * client_spread(metrics)
    low, high = CLIENT_BAND
    written.append(bands(spread.index, {f"clients: mean, {low}-{high}th percentile": (
        spread["mean"], spread["low"], spread["high"])}, out_dir / "accuracy_clients.png",
        f"{title}: spread over clients", "round", f"client {ACCURACY_AXIS}"))
    if tables is not None:
        written += client_heatmaps(tables, out_dir, title)
    if diagnostics is not None:
        written += draw_diagnostics(get_algorithm(config["algorithm"]), diagnostics, out_dir)
    return written


def client_tables(run_dir: Path) -> dict[str, np.ndarray] | None:
    """clients.npz's per client x class arrays (None for runs made before it existed)."""
    path = run_dir / "clients.npz"
    if not path.is_file():
        return None
    return read_arrays(path, "per-client table", "delete it to report the rest of the run")


def client_heatmaps(arrays: dict[str, np.ndarray], out_dir: Path, title: str) -> list[Path]:
    """Training counts next to the output layer's row norms, and per-class test accuracy."""
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
            accuracy = PERCENT * arrays["class_correct"] / arrays["class_total"]
        written.append(heatmaps_side_by_side([accuracy], ["test accuracy per class in % (last evaluation; "
                                                          "hatched grey: no test samples)"],
                                             out_dir / "clients_class_accuracy.png", title, "class", "client",
                                             vmax=PERCENT))
    return written


def report_run(run_dir: str | Path) -> list[Path]:
    """Write run_dir/report/ (PNGs and index.html); returns the files written, the page last."""
    run_dir = Path(run_dir)
    out_dir = run_dir / "report"
    summary = read_summary(run_dir)  # read (and checked) before any figure is written
    figures = run_figures(run_dir, out_dir)
    config = read_config(run_dir)
    sections = config_sections(run_dir, config)
    if summary is not None:
        note = "; ".join(part for part in (summary.get("headline", ""), ACCURACY_NOTE) if part)
        sections.append(Section("Summary", note, tables=[summary_frame(summary)]))
    sections.append(Section("Figures", images=figures))
    page = render(f"{config['algorithm']} on {config['dataset']}: {run_dir.name}", sections, out_dir / "index.html")
    return figures + [page]


def config_sections(run_dir: Path, config: dict) -> list[Section]:
    """A one-line headline of the config, then config.yaml as written by the run (every resolved
    key), collapsed: it is long and most readers want the curves first."""
    headline = "; ".join(f"{key}: {config[key]}" for key in HEADLINE_CONFIG_KEYS if key in config)
    return [Section("Configuration", headline),
            Section(f"config.yaml: the resolved config ({len(config)} keys)",
                    preformatted=(run_dir / "config.yaml").read_text(), collapsed=True)]


def summary_frame(summary: dict) -> pd.DataFrame:
    keys = ("best_acc", "last5_acc", "final_acc", "best_acc_unweighted", "last5_acc_unweighted",
            "final_acc_worst", "final_balanced_acc")
    frame = pd.DataFrame({key: [PERCENT * summary[key] if summary.get(key) is not None else np.nan] for key in keys})
    frame["MB_up"] = summary.get("bytes_up", 0) / 1e6
    frame["s_per_round"] = summary.get("sec_per_round")
    return frame
