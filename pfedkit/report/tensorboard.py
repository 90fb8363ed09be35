"""TensorBoard event files from recorded runs (`pfedkit report DIR tensorboard=true`).

Written after the fact from metrics.csv, so a run pays nothing for it and any old run can be
viewed: `tensorboard --logdir DIR/report/tensorboard`. Needs the optional `tensorboardX` package
(`pip install -e '.[tensorboard]'`).
"""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from pfedkit.core.errors import ConfigError
from pfedkit.evaluation import round_table


def write_events_of(target: Path) -> list[Path]:
    """Event folders in target/report/tensorboard for a run, or for every finished run of a
    comparison directory."""
    import json

    from pfedkit.experiments.comparison import MANIFEST

    if (target / MANIFEST).is_file():
        manifest = json.loads((target / MANIFEST).read_text())
        runs = {Path(p).name: target / p for entry in manifest["entries"] for p in entry["runs"].values()
                if (target / p / "metrics.csv").is_file()}
    else:
        runs = {target.name: target}
    return write_events(runs, target / "report" / "tensorboard")


def write_events(run_dirs: dict[str, Path], out_dir: Path) -> list[Path]:
    """One event folder per run (named by the key): per-round accuracies, loss and bytes."""
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        raise ConfigError("tensorboard=true needs the tensorboardX package: pip install -e '.[tensorboard]'") from None
    folders = []
    for name, run_dir in run_dirs.items():
        metrics = pd.read_csv(run_dir / "metrics.csv")
        table = round_table(metrics)
        traffic = metrics.groupby("round")[["bytes_up", "bytes_down"]].sum() / 1e6
        folder = out_dir / name
        with SummaryWriter(logdir=str(folder)) as writer:
            for rnd, row in table.iterrows():
                writer.add_scalar("accuracy/weighted", row["acc_weighted"], rnd)
                writer.add_scalar("accuracy/unweighted", row["acc_mean"], rnd)
                writer.add_scalar("accuracy/worst_client", row["acc_worst"], rnd)
                writer.add_scalar("loss/test", row["loss"], rnd)
            for rnd, row in traffic.iterrows():
                writer.add_scalar("traffic/MB_up", row["bytes_up"], rnd)
                writer.add_scalar("traffic/MB_down", row["bytes_down"], rnd)
        folders.append(folder)
    return folders
