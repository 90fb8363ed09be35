"""Small plotting helpers shared by reports (matplotlib, Agg backend, atomic PNG writes)."""
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


def save_figure(fig, path: str | Path) -> Path:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    _pyplot().close(fig)
    atomic_write_bytes(path, buffer.getvalue())
    return Path(path)


def heatmap(matrix: np.ndarray, path: str | Path, title: str, xlabel: str, ylabel: str,
            colorbar: str = "", vmin: float | None = None, vmax: float | None = None,
            figsize: tuple[float, float] | None = None) -> Path:
    plt = _pyplot()
    matrix = np.asarray(matrix, dtype=float)
    fig, ax = plt.subplots(figsize=figsize or (min(14, max(4, 0.35 * matrix.shape[1] + 2)),
                                               min(14, max(3, 0.3 * matrix.shape[0] + 1.5))))
    image = ax.imshow(matrix, aspect="auto", cmap="viridis", vmin=vmin, vmax=vmax)
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    fig.colorbar(image, ax=ax, label=colorbar)
    return save_figure(fig, path)


def heatmaps_side_by_side(matrices: Sequence[np.ndarray], titles: Sequence[str], path: str | Path,
                          suptitle: str, xlabel: str, ylabel: str, shared_scale: bool = True) -> Path:
    """Heatmaps in a row; `shared_scale`: one colour scale from 0 (else one colour bar each)."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(matrices), figsize=(5 * len(matrices), 4.5), squeeze=False)
    vmax = max(float(np.nanmax(m)) for m in matrices) if shared_scale else None
    for ax, matrix, title in zip(axes[0], matrices, titles):
        image = ax.imshow(np.asarray(matrix, dtype=float), aspect="auto", cmap="viridis",
                          vmin=0 if shared_scale else None, vmax=vmax)
        ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
        if not shared_scale:
            fig.colorbar(image, ax=ax)
    if shared_scale:
        fig.colorbar(image, ax=list(axes[0]))
    fig.suptitle(suptitle)
    return save_figure(fig, path)


def lines(xs: Sequence[float], series: dict[str, Sequence[float]], path: str | Path, title: str,
          xlabel: str, ylabel: str, vlines: dict[str, float] | None = None) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, ys in series.items():
        ax.plot(xs, ys, label=label)
    for label, x in (vlines or {}).items():
        ax.axvline(x, color="grey", linestyle="--", label=label)
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.legend()
    ax.grid(alpha=0.3)
    return save_figure(fig, path)


def bands(xs: Sequence[float], series: dict[str, tuple[Sequence[float], Sequence[float], Sequence[float]]],
          path: str | Path, title: str, xlabel: str, ylabel: str) -> Path:
    """One line per series with a shaded band: `series[label] = (middle, low, high)`."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, (middle, low, high) in series.items():
        line, = ax.plot(xs, middle, label=label)
        ax.fill_between(xs, low, high, color=line.get_color(), alpha=0.2, linewidth=0)
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3)
    return save_figure(fig, path)
