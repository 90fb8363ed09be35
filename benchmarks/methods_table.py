"""One Markdown table of a `benchmarks/methods_table.sh` sweep: a row per method, for each setting
(dataset and partition) the mean ± std over seeds of the last-5 sample-weighted accuracy and of the
best round.

Each setting is a `pfedkit compare` directory (OUT_DIR/<dataset>-<partition>/table.csv); a method not
run in a setting shows "-". FedAvg and Local come first (the anchors), the others alphabetically.
With --published FILE (benchmarks/methods_published.yaml) each setting also gets a "published" column:
the source's value with a footnote index; the footnotes (source, setting, what differs) follow the table.

Usage: python benchmarks/methods_table.py OUT_DIR [--published FILE]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd
import yaml

SETTING_ORDER = ("mnist-dir0.1", "mnist-pat2", "cifar10-dir0.1", "cifar10-pat2",
                 "fashion_mnist-dir0.1", "fashion_mnist-pat2")  # the last two: PFLlib's leaderboard's
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


def read_published(path: Path) -> dict[str, dict[str, dict]]:
    """{setting: {method: {value, source, setting, differs, ...}}}; ValueError naming an unknown setting or method."""
    from pfedkit.algorithms import algorithm_names

    published = yaml.safe_load(path.read_text()) or {}
    for setting, methods in published.items():
        if setting not in SETTING_ORDER:
            raise ValueError(f"{path}: unknown setting {setting!r} (known: {', '.join(SETTING_ORDER)})")
        unknown = sorted(set(methods) - set(algorithm_names()))
        if unknown:
            raise ValueError(f"{path}: {setting}: pfedkit has no method {', '.join(unknown)}")
    return published


def method_order(settings: dict[str, pd.DataFrame], published: dict | None = None) -> list[str]:
    methods = sorted({m for table in settings.values() for m in table.index}
                     | {m for entries in (published or {}).values() for m in entries})
    return [m for m in ANCHORS if m in methods] + [m for m in methods if m not in ANCHORS]


def seeds_cell(settings: dict[str, pd.DataFrame], method: str) -> str:
    counts = sorted({int(t.at[method, "seeds"]) for t in settings.values() if method in t.index})
    return "/".join(str(c) for c in counts) or "-"


def markdown(settings: dict[str, pd.DataFrame], published: dict | None = None) -> str:
    """The table; with `published`, a "published" column per setting and its footnotes under the table."""
    header = ["method", "seeds"]
    for s in settings:
        header += [f"{s} last5 / best"] + ([f"{s} published"] if published is not None else [])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    notes: dict[tuple, int] = {}  # (source, setting, differs) -> footnote index
    for method in method_order(settings, published):
        cells = [f"`{method}`", seeds_cell(settings, method)]
        for s, t in settings.items():
            cells.append(f"{percent(t, method, 'last5')} / {percent(t, method, 'best')}")
            if published is not None:
                entry = published.get(s, {}).get(method)
                if entry is None:
                    cells.append("-")
                    continue
                index = notes.setdefault((entry["source"], entry["setting"], entry["differs"]), len(notes) + 1)
                cells.append(f"{entry['value']:.2f} [{index}]")
        lines.append("| " + " | ".join(cells) + " |")
    if notes:
        lines.append("")
        lines += [f"[{i}] {source}. Setting: {setting}. Differs: {differs}."
                  for (source, setting, differs), i in notes.items()]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(usage=__doc__.strip().splitlines()[-1].removeprefix("Usage: "))
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--published", type=Path)
    args = parser.parse_args(argv)
    if not args.out_dir.is_dir():
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    settings = read_settings(args.out_dir)
    if not settings:
        print(f"no OUT_DIR/<setting>/table.csv under {args.out_dir}: run benchmarks/methods_table.sh first",
              file=sys.stderr)
        return 2
    try:
        published = read_published(args.published) if args.published else None
    except ValueError as error:
        print(error, file=sys.stderr)
        return 2
    print(markdown(settings, published))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
