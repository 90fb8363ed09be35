"""One Markdown table of a `benchmarks/methods_table.sh` sweep: a row per method, for each setting
(dataset and partition) the mean ± std over seeds of the last-5 sample-weighted accuracy and of the
best round.

Each setting is a `pfedkit compare` directory (OUT_DIR/<dataset>-<partition>/table.csv); a method not
run in a setting shows "-". FedAvg and Local come first (the anchors), the others alphabetically.

Usage: python benchmarks/methods_table.py OUT_DIR
"""
from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd

SETTING_ORDER = ("mnist-dir0.1", "mnist-pat2", "cifar10-dir0.1", "cifar10-pat2")
ANCHORS = ("fedavg", "local")


def read_settings(out_dir: Path) -> dict[str, pd.DataFrame]:
    """Each setting's table.csv indexed by method label, in SETTING_ORDER, then any other setting."""
    found = {p.parent.name: p for p in sorted(out_dir.glob("*/table.csv"))}
    order = [s for s in SETTING_ORDER if s in found] + [s for s in found if s not in SETTING_ORDER]
    return {s: pd.read_csv(found[s]).set_index("label") for s in order}


def percent(table: pd.DataFrame, method: str, column: str) -> str:
    """"mean ± std" in % over the row's seeds; the value alone with one seed; "-" if not run."""
    if method not in table.index or pd.isna(table.at[method, f"{column}_mean"]):
        return "-"
    mean, std = 100 * table.at[method, f"{column}_mean"], 100 * table.at[method, f"{column}_std"]
    return f"{mean:.2f}" if int(table.at[method, "seeds"]) <= 1 else f"{mean:.2f} ± {std:.2f}"


def method_order(settings: dict[str, pd.DataFrame]) -> list[str]:
    methods = sorted({m for table in settings.values() for m in table.index})
    return [m for m in ANCHORS if m in methods] + [m for m in methods if m not in ANCHORS]


def seeds_cell(settings: dict[str, pd.DataFrame], method: str) -> str:
    counts = sorted({int(t.at[method, "seeds"]) for t in settings.values() if method in t.index})
    return "/".join(str(c) for c in counts)


def markdown(settings: dict[str, pd.DataFrame]) -> str:
    header = ["method", "seeds"] + [f"{s} last5 / best" for s in settings]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for method in method_order(settings):
        cells = [f"`{method}`", seeds_cell(settings, method)]
        cells += [f"{percent(t, method, 'last5')} / {percent(t, method, 'best')}" for t in settings.values()]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)



def main(argv: list[str]) -> int:
    if len(argv) != 1 or not Path(argv[0]).is_dir():
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    settings = read_settings(Path(argv[0]))
    if not settings:
        print(f"no OUT_DIR/<setting>/table.csv under {argv[0]}: run benchmarks/methods_table.sh first",
              file=sys.stderr)
        return 2
    print(markdown(settings))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
