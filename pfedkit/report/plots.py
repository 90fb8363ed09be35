"""Small plotting helpers shared by reports (matplotlib, Agg backend, atomic PNG writes).

Axes that count things (rounds, clients, classes) get integer ticks: matplotlib's default
locator puts ticks at 1.5, 2.5... on a 5-round run, and there is no round 2.5. Line and band
plots do this whenever every x value is a whole number; heatmaps always (their cells are
indexed by row and column number).

Line, band and panel figures are PAGE_WIDTH wide: at the saved dpi they fill the reports' page
(html.py: 1200 px at most), so a reader needs no zoom. A heatmap cell without a value (NaN: a
class with no test samples, a client absent that round) is drawn hatched grey, which no colour
scale here (viridis) contains: white would read as the scale's light end."""
from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from pfedkit.atomic import atomic_write_bytes


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def integer_ticks(axis) -> None:
    """Ticks on whole numbers only (matplotlib picks how many)."""
    from matplotlib.ticker import MaxNLocator

    axis.set_major_locator(MaxNLocator(integer=True))


def integer_x_if_whole(ax, xs: Sequence[float]) -> None:
    """Integer x ticks when every x is a whole number (rounds); a fractional x keeps the default."""
    values = np.asarray(list(xs), dtype=float)
    if len(values) and np.all(np.isfinite(values)) and np.all(values == np.round(values)):
        integer_ticks(ax.xaxis)


PAGE_WIDTH = 12.0  # inches: 1,320 px at DPI, about 1,170 once saved tight: the page's width
DPI = 110
MISSING_FACE, MISSING_HATCH = "0.82", "0.45"  # grey behind NaN cells, and its hatching's colour


def save_figure(fig, path: str | Path) -> Path:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=DPI, bbox_inches="tight")
    _pyplot().close(fig)
    atomic_write_bytes(path, buffer.getvalue())
    return Path(path)


def hatch_missing(ax) -> None:
    """NaN cells of an image are transparent (the colour map's "bad" colour): what shows through
    is the axes' background, made hatched grey here."""
    ax.set_facecolor(MISSING_FACE)
    ax.patch.set_hatch("//")
    ax.patch.set_edgecolor(MISSING_HATCH)


def heatmap(matrix: np.ndarray, path: str | Path, title: str, xlabel: str, ylabel: str,
            colorbar: str = "", vmin: float | None = None, vmax: float | None = None,
            figsize: tuple[float, float] | None = None) -> Path:
    plt = _pyplot()
    matrix = np.asarray(matrix, dtype=float)
    fig, ax = plt.subplots(figsize=figsize or (min(14, max(4, 0.35 * matrix.shape[1] + 2)),
                                               min(14, max(3, 0.3 * matrix.shape[0] + 1.5))))
    image = ax.imshow(matrix, aspect="auto", cmap="viridis", vmin=vmin, vmax=vmax)
    hatch_missing(ax)
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    integer_ticks(ax.xaxis)
    integer_ticks(ax.yaxis)
    fig.colorbar(image, ax=ax, label=colorbar)
    return save_figure(fig, path)


def heatmaps_side_by_side(matrices: Sequence[np.ndarray], titles: Sequence[str], path: str | Path,
                          suptitle: str, xlabel: str, ylabel: str, shared_scale: bool = True,
                          vmax: float | None = None) -> Path:
    """Heatmaps in a row; `shared_scale`: one colour scale from 0 to `vmax` (default: the largest
    value), else one colour bar each."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(matrices), figsize=(5 * len(matrices), 4.5), squeeze=False)
    if shared_scale and vmax is None:
        vmax = max(float(np.nanmax(m)) for m in matrices)
    elif not shared_scale:
        vmax = None
    for ax, matrix, title in zip(axes[0], matrices, titles):
        image = ax.imshow(np.asarray(matrix, dtype=float), aspect="auto", cmap="viridis",
                          vmin=0 if shared_scale else None, vmax=vmax)
        hatch_missing(ax)
        ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
        integer_ticks(ax.xaxis)
        integer_ticks(ax.yaxis)
        if not shared_scale:
            fig.colorbar(image, ax=ax)
    if shared_scale:
        fig.colorbar(image, ax=list(axes[0]))
    fig.suptitle(suptitle)
    return save_figure(fig, path)


def lines(xs: Sequence[float], series: dict[str, Sequence[float]], path: str | Path, title: str,
          xlabel: str, ylabel: str, vlines: dict[str, float] | None = None,
          ylim: tuple[float, float] | None = None) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(PAGE_WIDTH, 4))
    for label, ys in series.items():
        ax.plot(xs, ys, label=label)
    for label, x in (vlines or {}).items():
        ax.axvline(x, color="grey", linestyle="--", label=label)
    finish_axes(ax, xs, title, xlabel, ylabel, ylim)
    return save_figure(fig, path)


def bands(xs: Sequence[float], series: dict[str, tuple[Sequence[float], Sequence[float], Sequence[float]]],
          path: str | Path, title: str, xlabel: str, ylabel: str,
          ylim: tuple[float, float] | None = None) -> Path:
    """One line per series with a shaded band: `series[label] = (middle, low, high)`. Bands of
    more than a few series overlap into one blur: give those to `panels`."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(PAGE_WIDTH, 4))
    for label, (middle, low, high) in series.items():
        line, = ax.plot(xs, middle, label=label)
        ax.fill_between(xs, low, high, color=line.get_color(), alpha=0.2, linewidth=0)
    finish_axes(ax, xs, title, xlabel, ylabel, ylim)
    return save_figure(fig, path)


def panels(xs: Sequence[float], series: dict[str, tuple[Sequence[float], Sequence[float], Sequence[float]]],
           path: str | Path, title: str, xlabel: str, ylabel: str, columns: int = 4) -> Path:
    """One small panel per series (`series[label] = (middle, low, high)`, a line and its band), all
    on the same axes ranges; behind each, the other series' middle lines in light grey, so a
    panel still compares. Several bands never overlap in one plot."""
    plt = _pyplot()
    count = len(series)
    cols = min(columns, count)
    rows = -(-count // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(PAGE_WIDTH, 2.4 * rows + 0.8), sharex=True, sharey=True,
                             squeeze=False)
    for index, (ax, (label, (middle, low, high))) in enumerate(zip(axes.flat, series.items())):
        for other, (other_middle, _, _) in series.items():
            if other != label:
                ax.plot(xs, other_middle, color="0.82", linewidth=1, label="_other methods")
        ax.plot(xs, middle, color=f"C{index % 10}", label=label)
        ax.fill_between(xs, low, high, color=f"C{index % 10}", alpha=0.25, linewidth=0)
        ax.set_title(label, fontsize="medium")
        ax.grid(alpha=0.3)
        ax.xaxis.set_tick_params(labelbottom=True)  # every panel readable on its own
        integer_x_if_whole(ax, xs)
    for ax in axes.flat[count:]:
        fig.delaxes(ax)
    for ax in axes[:, 0]:
        ax.set_ylabel(ylabel)
    for ax in axes.flat[max(0, count - cols):count]:
        ax.set_xlabel(xlabel)
    fig.suptitle(title)
    fig.tight_layout()
    return save_figure(fig, path)


def finish_axes(ax, xs: Sequence[float], title: str, xlabel: str, ylabel: str,
                ylim: tuple[float, float] | None) -> None:
    """Title, labels, integer round ticks, legend and grid of a line or band plot."""
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    if ylim is not None:
        ax.set_ylim(*ylim)
    integer_x_if_whole(ax, xs)
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3)
