"""The HTML reports as a reader meets them: a comparison table that fits (headline columns, no
index, no empty columns), accuracies in % on the page and on every axis, whole-number round
ticks, every seed's figures, seed links that open that run's own report, and the run page
showing the whole resolved config."""
from __future__ import annotations

import html
import re
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import yaml

import pfedkit
from pfedkit.evaluation import round_table
from pfedkit.experiments.comparison import SUMMARY_COLUMNS, Entry, run_comparison, write_seed_table
from pfedkit.report import plots
from pfedkit.report.comparison_report import HEADLINE_COLUMNS, paper_cells, report_comparison
from pfedkit.report.html import table_html
from pfedkit.report.run_report import report_run

CONFIG = {"dataset": "digits", "num_clients": 4, "rounds": 3, "threads": 1, "batch_size": 20, "lr": 0.05,
          "partition": {"scheme": "dirichlet", "alpha": 0.5}}
METHODS = ("fedavg", "local")
SEEDS = (0, 1)


class Page(HTMLParser):
    """What a reader sees of a page: tables (header cells, rows, inside a <details> or not), links
    (href, text), images, <pre> blocks."""

    def __init__(self, text: str):
        super().__init__()
        self.tables: list[dict] = []
        self.links: list[tuple[str, str]] = []
        self.images: list[str] = []
        self.pre: list[str] = []
        self._details = 0
        self._cell: list[str] | None = None
        self._href: str | None = None
        self._link_text: list[str] = []
        self._in_pre = False
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "details":
            self._details += 1
        elif tag == "table":
            self.tables.append({"header": [], "rows": [], "collapsed": self._details > 0})
        elif tag == "tr" and self.tables:
            self.tables[-1]["rows"].append([])
        elif tag in ("th", "td"):
            self._cell = []
        elif tag == "a":
            self._href, self._link_text = attrs["href"], []
        elif tag == "img":
            self.images.append(attrs["src"])
        elif tag == "pre":
            self._in_pre = True
            self.pre.append("")

    def handle_endtag(self, tag):
        if tag == "details":
            self._details -= 1
        elif tag in ("th", "td") and self._cell is not None:
            text = "".join(self._cell).strip()
            table = self.tables[-1]
            (table["header"] if tag == "th" else table["rows"][-1]).append(text)
            self._cell = None
        elif tag == "a":
            self.links.append((self._href, "".join(self._link_text).strip()))
            self._href = None
        elif tag == "pre":
            self._in_pre = False

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)
        if self._href is not None:
            self._link_text.append(data)
        if self._in_pre:
            self.pre[-1] += data


class FigureLog:
    """Every figure the report helpers save, read just before it is written: per axes its labels,
    the x ticks inside the view, the y values of its lines and the values of its images."""

    def __init__(self):
        self.axes: list[dict] = []

    def save(self, original):
        def capture(fig, path):
            fig.canvas.draw()
            pixels = np.asarray(fig.canvas.buffer_rgba())[..., :3] / 255
            for ax in fig.axes:
                low, high = sorted(ax.get_xlim())
                ylow, yhigh = sorted(ax.get_ylim())
                self.axes.append({
                    "file": Path(path).name, "title": ax.get_title(), "xlabel": ax.get_xlabel(),
                    "ylabel": ax.get_ylabel(), "suptitle": fig.get_suptitle(),
                    "xticks": [t for t in ax.get_xticks() if low <= t <= high],
                    "yticks": [t for t in ax.get_yticks() if ylow <= t <= yhigh], "ylim": (ylow, yhigh),
                    "lines": [np.asarray(line.get_ydata(), dtype=float) for line in ax.get_lines()
                              if line.get_label() and not line.get_label().startswith("_")],
                    "bands": len(ax.collections),  # fill_between areas (line and band plots)
                    "images": [np.asarray(image.get_array(), dtype=float) for image in ax.get_images()],
                    "cell_colours": [cell_colours(ax, image, pixels) for image in ax.get_images()]})
            return original(fig, path)
        return capture


def cell_colours(ax, image, pixels: np.ndarray) -> np.ndarray:
    """What a reader sees of each cell of a heatmap: the mean RGB (0-1) of a 7 x 7 pixel patch at
    the cell's centre, as rendered. [rows, cols, 3]."""
    values = np.asarray(image.get_array(), dtype=float)
    colours = np.zeros(values.shape + (3,))
    for row, col in np.ndindex(values.shape):
        x, y = ax.transData.transform((col, row))
        px, py = int(round(x)), int(round(pixels.shape[0] - y))
        colours[row, col] = pixels[py - 3:py + 4, px - 3:px + 4].reshape(-1, 3).mean(0)
    return colours


def reported_comparison(root: Path, seeds: list[int], report, config: dict = CONFIG,
                        methods: tuple[str, ...] = METHODS) -> tuple[list, FigureLog, object]:
    """`methods` (default fedavg and local) over `seeds` in `root` (one torch thread), their seed
    table, then `report(root)` with every figure it saves logged: (records, figure log, what report
    returned)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    log = FigureLog()
    try:
        records = run_comparison(root, [Entry(name, {**config, "algorithm": name}) for name in methods], seeds,
                                 log=lambda _: None)
        write_seed_table(root, records)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(plots, "save_figure", log.save(plots.save_figure))
            reported = report(root)
    finally:
        torch.set_num_threads(threads)
    return records, log, reported


@pytest.fixture(scope="module")
def comparison(tmp_path_factory):
    """fedavg and local, seeds 0 and 1, and the comparison report, with every saved figure logged."""
    root = tmp_path_factory.mktemp("report") / "cmp"
    records, log, written = reported_comparison(root, list(SEEDS), report_comparison)
    page = written[-1]
    return {"root": root, "written": written, "page": page, "parsed": Page(page.read_text()), "figures": log,
            "records": records}


# ---- the comparison table ----------------------------------------------------------------------

def test_comparison_table_shows_the_headline_columns_without_index_or_group(comparison):
    visible = [t for t in comparison["parsed"].tables if not t["collapsed"]]
    assert len(visible) == 1
    header = visible[0]["header"]
    # no index column, no `group`; `new_clients` only where runs evaluated clients that never trained,
    # `epsilon` only where runs had dp
    assert header == ["method", "seeds", *(c for c in HEADLINE_COLUMNS if c not in ("new_clients", "epsilon"))]
    assert [row[0] for row in visible[0]["rows"][1:]] == list(METHODS)
    # every cell is "mean ± std", the accuracies in % (a fraction would read 0.xx)
    best = [float(row[2].split(" ± ")[0]) for row in visible[0]["rows"][1:]]
    assert all(1 < value <= 100 for value in best)


def test_the_other_columns_are_collapsed_and_none_is_empty(comparison):
    collapsed = [t for t in comparison["parsed"].tables if t["collapsed"]]
    assert len(collapsed) == 1
    header = collapsed[0]["header"]
    others = [c for c in SUMMARY_COLUMNS if c not in HEADLINE_COLUMNS]
    assert header[:2] == ["method", "seeds"] and set(header[2:]) <= set(others)
    for table in comparison["parsed"].tables:
        assert "group" not in table["header"] and "" not in table["header"]
        for position in range(len(table["header"])):
            assert any(row[position] not in ("", "-") for row in table["rows"][1:])


def test_the_page_says_what_was_compared(comparison):
    about = html.unescape(comparison["page"].read_text()).split("About", 1)[1].split("Results", 1)[0]
    for fact in ("dataset: digits (model mlp)", "clients: 4", "partition: dirichlet (alpha 0.5)", "rounds: 3",
                 "local training: 1 epoch, batch 20, lr 0.05", "seeds 0, 1"):
        assert fact in about, (fact, about)


def test_more_columns_names_exactly_the_columns_it_shows(comparison):
    text = html.unescape(comparison["page"].read_text())
    (named,) = re.findall(r"<summary>More columns: (.*?) \(", text)
    (collapsed,) = [t for t in comparison["parsed"].tables if t["collapsed"]]
    assert named.split(", ") == collapsed["header"][2:]  # e.g. no "epsilon" without a dp run


def test_a_dp_comparison_shows_epsilon_among_the_headline_columns_as_compare_prints_it(tmp_path):
    pytest.importorskip("dp_accounting")
    root = tmp_path / "cmp"
    _, _, written = reported_comparison(root, [0], report_comparison, {**CONFIG, "dp": {"level": "client"}},
                                        ("fedavg", "fedper"))
    (visible,) = [t for t in Page(written[-1].read_text()).tables if not t["collapsed"]]
    assert visible["header"][2:5] == ["best", "last5", "epsilon"]
    epsilon = float(pd.read_csv(root / "table.csv")["epsilon_mean"][0])
    assert visible["rows"][1][4] == f"{epsilon:.3f}"  # one seed: the value alone


def test_tables_drop_the_index_and_empty_columns():
    frame = pd.DataFrame({"group": ["", ""], "method": ["a", "b"], "missing": [np.nan, np.nan],
                          "blank": [" ", None], "acc": [81.234, np.nan]}, index=[7, 8])
    parsed = Page(table_html(frame))
    (table,) = parsed.tables
    assert table["header"] == ["method", "acc"]
    assert table["rows"][1:] == [["a", "81.23"], ["b", "-"]]  # no index values 7, 8


def test_paper_table_is_compact():
    paper = pd.DataFrame({"column": ["pathological"] * 2, "method": ["FedAvg", "Ditto"], "algorithm": ["fedavg", None],
                          "metric": ["best_acc"] * 2, "paper": [80.0, 85.5], "paper_std": [1.0, np.nan],
                          "ours": [78.25, np.nan], "ours_std": [0.5, np.nan], "seeds": [2, 0],
                          "status": ["ran", "not implemented"], "diff": [-1.75, np.nan], "rank_ours": [1.0, np.nan],
                          "rank_paper": [2.0, np.nan], "kendall_tau": [np.nan, np.nan], "order_differs": [True, False]})
    cells = paper_cells(paper)
    assert list(cells.columns) == ["column", "method", "metric", "ours", "seeds", "paper", "diff",
                                   "rank ours / paper", "order"]
    assert cells["ours"].tolist() == ["78.25 ± 0.50", "not implemented"]
    assert cells["paper"].tolist() == ["80.00 ± 1.00", "85.50"]
    assert cells["rank ours / paper"].tolist() == ["1 / 2", "-"] and cells["order"].tolist() == ["≠", ""]


# ---- units and ticks -------------------------------------------------------------------------

def accuracy_axes(figures: FigureLog) -> list[dict]:
    return [ax for ax in figures.axes if "accuracy" in ax["ylabel"] and ax["lines"]]


def test_accuracy_axes_are_in_percent_like_the_tables(comparison):
    axes = accuracy_axes(comparison["figures"])
    assert len(axes) >= 2 + len(METHODS) * (1 + 2 * len(SEEDS))  # groups, methods, every seed's two curves
    text = html.unescape(comparison["page"].read_text())
    assert "accuracies in %" in text
    for ax in axes:
        assert "(%)" in ax["ylabel"], ax
        values = np.concatenate(ax["lines"])
        assert 1 < np.nanmax(values) <= 100, (ax["file"], np.nanmax(values))
        assert max(ax["yticks"]) > 1  # the axis runs in %, not 0-1
    # the seed curve of a run is its round table in %
    record = next(r for r in comparison["records"] if r.entry.label == "fedavg" and r.seed == 0)
    expected = 100 * round_table(pd.read_csv(record.run_dir / "metrics.csv"))["acc_weighted"].to_numpy()
    run_axes = [ax for ax in axes if ax["file"] == "accuracy.png"]
    assert any(np.allclose(ax["lines"][0], expected) for ax in run_axes)


def test_class_accuracy_heatmap_is_in_percent(comparison):
    heatmaps = [ax for ax in comparison["figures"].axes if ax["file"] == "clients_class_accuracy.png" and ax["images"]]
    assert heatmaps
    for ax in heatmaps:
        assert "%" in ax["title"]
        assert 1 < np.nanmax(ax["images"][0]) <= 100


def test_round_axes_have_whole_number_ticks(comparison):
    round_axes = [ax for ax in comparison["figures"].axes if ax["xlabel"] == "round"]
    assert len(round_axes) >= 2 + len(METHODS) * (1 + 2 * len(SEEDS))
    for ax in round_axes:
        assert ax["xticks"] and all(float(t).is_integer() for t in ax["xticks"]), (ax["file"], ax["xticks"])


def test_heatmap_ticks_are_whole_numbers(tmp_path, monkeypatch):
    log = FigureLog()
    monkeypatch.setattr(plots, "save_figure", log.save(plots.save_figure))
    plots.heatmap(np.arange(4.0).reshape(2, 2), tmp_path / "h.png", "t", "class", "client")
    plots.heatmaps_side_by_side([np.ones((2, 2))], ["t"], tmp_path / "s.png", "s", "round", "client")
    heatmaps = [ax for ax in log.axes if ax["images"]]
    assert len(heatmaps) == 2
    for ax in heatmaps:  # matplotlib's default puts ticks at -0.5, 0, 0.5... on a 2 x 2 image
        assert all(float(t).is_integer() for t in ax["xticks"] + ax["yticks"]), (ax["xticks"], ax["yticks"])


# ---- the comparison's figures ---------------------------------------------------------------------

def axes_of(figures: FigureLog, file: str) -> list[dict]:
    return [ax for ax in figures.axes if ax["file"] == file]


def test_all_methods_together_are_lines_and_client_bands_get_one_panel_each(comparison):
    (overview,) = axes_of(comparison["figures"], "all_seeds.png")
    assert overview["bands"] == 0 and len(overview["lines"]) == len(METHODS)  # seed means, no overlapping bands
    spread = axes_of(comparison["figures"], "all_clients.png")
    assert [ax["title"] for ax in spread] == list(METHODS)
    assert all(ax["bands"] == 1 and len(ax["lines"]) == 1 for ax in spread)  # its own band; others grey, unlabelled
    assert len({ax["ylim"] for ax in spread}) == 1


def test_per_method_figures_share_one_y_range(comparison):
    figures = [axes_of(comparison["figures"], f"all_{method}_seeds.png")[0] for method in METHODS]
    assert len({ax["ylim"] for ax in figures}) == 1
    low, high = figures[0]["ylim"]
    assert all(low <= np.nanmin(line) and np.nanmax(line) <= high for ax in figures for line in ax["lines"])


def test_comparison_figures_fill_the_page_width(comparison):
    page_width = int(re.search(r"max-width:(\d+)px", comparison["page"].read_text()).group(1))
    for png in (comparison["root"] / "report").glob("*.png"):
        width = int.from_bytes(png.read_bytes()[16:20], "big")  # the PNG header's IHDR width
        assert width >= 0.85 * page_width, (png.name, width, page_width)


def test_heatmap_cells_without_value_are_hatched_grey_not_a_colour_of_the_scale(tmp_path, monkeypatch):
    log = FigureLog()
    monkeypatch.setattr(plots, "save_figure", log.save(plots.save_figure))
    matrix = np.array([[0.0, np.nan, 100.0], [50.0, 100.0, 25.0], [75.0, 10.0, np.nan]])
    plots.heatmaps_side_by_side([matrix], ["accuracy"], tmp_path / "h.png", "t", "class", "client", vmax=100.0)
    (ax,) = [ax for ax in log.axes if ax["images"]]
    colours = ax["cell_colours"][0]
    missing, present = colours[np.isnan(matrix)], colours[~np.isnan(matrix)]
    assert np.abs(missing[0] - missing[1]).max() < 0.05  # every missing cell looks alike
    for colour in missing:
        assert np.linalg.norm(colour - 1.0) > 0.2, colour  # not white (the page's background)
        assert np.linalg.norm(present - colour, axis=1).min() > 0.2, colour  # nor a colour of the scale


# ---- every seed, and links to each run's own report -----------------------------------------------

def test_every_seed_gets_its_figures_on_the_comparison_page(comparison):
    root, page = comparison["root"], comparison["page"]
    shown = {(page.parent / src).resolve() for src in comparison["parsed"].images}
    for record in comparison["records"]:
        assert (record.run_dir / "report" / "accuracy.png").resolve() in shown, record.run_dir.name
    for method in METHODS:
        assert (root / "report" / f"all_{method}_seeds.png").resolve() in shown


def test_seed_links_open_that_runs_own_report(comparison):
    page = comparison["page"]
    links = [(text, (page.parent / href).resolve()) for href, text in comparison["parsed"].links]
    for record in comparison["records"]:
        run_dir = record.run_dir.resolve()
        targets = [target for text, target in links if text.startswith(f"seed {record.seed}")
                   and run_dir in target.parents]
        assert targets, f"no link for seed {record.seed} into {run_dir}"
        for target in targets:
            assert target.suffix == ".html" and target.is_file()
            assert record.run_dir.name in target.read_text()  # the run's page, titled with its name
    for target in {(page.parent / href).resolve() for href, _ in comparison["parsed"].links}:
        assert target.suffix == ".html"  # no link opens a JSON file


# ---- the run page -------------------------------------------------------------------------------

def test_run_page_shows_the_whole_resolved_config(tmp_path, one_torch_thread):
    result = pfedkit.run({**CONFIG, "algorithm": "fedper", "seed": 2, "out_dir": str(tmp_path / "runs")})
    page = report_run(result.run_dir)[-1]
    parsed = Page(page.read_text())
    stored = yaml.safe_load((result.run_dir / "config.yaml").read_text())
    assert len(stored) > 10
    (shown,) = parsed.pre
    assert yaml.safe_load(shown) == stored  # every top-level key, with its value
    text = page.read_text()
    assert "<details>" in text and text.index("<details>") < text.index("<pre>")  # collapsed
    summary = next(t for t in parsed.tables if "best_acc" in t["header"])
    assert summary["header"][0] == "best_acc"  # no index column
    assert float(summary["rows"][1][0]) == pytest.approx(100 * result.summary["best_acc"], abs=0.01)


# ---- one seed, and what `pfedkit report` prints ----------------------------------------------------

@pytest.fixture(scope="module")
def one_seed(tmp_path_factory):
    """fedavg and local with seed 0 only, reported through the command line (its output kept)."""
    import contextlib
    import io

    from pfedkit.cli import main

    def report_printed(root: Path) -> str:
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            assert main(["report", str(root)]) == 0
        return printed.getvalue()

    root = tmp_path_factory.mktemp("one-seed") / "cmp"
    _, log, printed = reported_comparison(root, [0], report_printed)
    page = root / "report" / "index.html"
    return {"root": root, "page": page, "parsed": Page(page.read_text()), "figures": log, "printed": printed}


def test_one_seed_page_shows_values_not_a_spread(one_seed):
    tables = one_seed["parsed"].tables
    assert tables and all("±" not in cell for table in tables for row in table["rows"] for cell in row)
    text = html.unescape(one_seed["page"].read_text())
    assert "Results (one seed)" in text and "mean ± std" not in text
    titles = [ax["title"] for ax in one_seed["figures"].axes if ax["file"].startswith("all_")]
    assert titles and not any("min-max over seeds" in title or "over seeds 0" in title for title in titles)
    assert all(f"{method}: seed 0" in titles for method in METHODS)


def test_report_prints_the_page_and_a_count_not_every_file(one_seed):
    lines = one_seed["printed"].splitlines()
    written = list(one_seed["root"].rglob("report/*"))  # the comparison's and each run's report files
    assert len(lines) == 1, lines
    assert lines[0].startswith(str(one_seed["page"])) and f"{len(written)} files" in lines[0], (lines, len(written))
