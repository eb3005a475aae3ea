"""Comparison plots (matplotlib, Agg backend): one panel per handle, metrics over steps; or, for
the representation metrics, a layers x steps heatmap per metric."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

if TYPE_CHECKING:
    from hookline.storage.compare import FieldComparison

__all__ = ["plot_comparison", "plot_heatmap"]

_METRIC_STYLE = {
    "cosine": {"color": "#1f77b4", "label": "cosine"},
    "rel_l2": {"color": "#d62728", "label": "rel_l2 = ||a-b|| / ||a||"},
    "norm_ratio": {"color": "#2ca02c", "label": "norm_ratio = ||b|| / ||a||"},
    "cka": {"color": "#9467bd", "label": "linear CKA"},
    "procrustes": {"color": "#ff7f0e", "label": "Procrustes distance (angular, rad)"},
}
#: Heatmap colour scales: (colormap, vmin, vmax); bright = similar for both.
_HEAT = {"cka": ("viridis", 0.0, 1.0), "procrustes": ("viridis_r", 0.0, math.pi / 2)}
#: At most this many layer rows in a heatmap.
MAX_ROWS = 60
_FIELD_STYLES = ["-", "--", ":", "-."]
_MARKERS = ["o", "s", "^", "D"]


def _x(steps: np.ndarray, calls: np.ndarray) -> np.ndarray:
    """x positions: the step, with several calls of one step spread within it."""
    x = steps.astype(float)
    if calls.size and calls.max() > 0:
        ncalls = calls.max() + 1
        x = x + calls / (ncalls + 1)
    return x


def plot_comparison(
    results: Sequence[FieldComparison],
    out: str | Path,
    *,
    metrics: Sequence[str],
    title: str | None = None,
    label_a: str = "A",
    label_b: str = "B",
    max_panels: int = 24,
) -> Path:
    """Write a PNG with one panel per handle; in each, every selected metric over the common
    steps (one line per field). Returns the path written."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    out = Path(out)
    by_handle: dict[str, list[FieldComparison]] = {}
    for r in results:
        if r.status == "ok" and len(r.steps):
            by_handle.setdefault(r.handle, []).append(r)
    handles = list(by_handle)[:max_panels]
    n = max(1, len(handles))
    ncols = 1 if n == 1 else 2 if n in (2, 4) else 3
    nrows = math.ceil(n / ncols)
    fig, axes = plt.subplots(
        nrows, ncols, figsize=(5.2 * ncols, 3.1 * nrows + 1.0), squeeze=False, sharex=True,
        layout="constrained",
    )
    flat = axes.ravel()
    field_styles: dict[str, str] = {}  # field name -> line style, in order of first appearance
    for ax, h in zip(flat, handles):
        _draw_panel(ax, h, by_handle[h], metrics, field_styles)
    for ax in flat[len(handles):]:
        ax.set_visible(False)
    if not handles:
        flat[0].set_visible(True)
        flat[0].text(0.5, 0.5, "nothing to plot: no handle has common steps", ha="center", va="center",
                     transform=flat[0].transAxes)
        flat[0].set_axis_off()
    for ax in axes[-1]:
        ax.set_xlabel("step")
    for row in axes:
        row[0].set_ylabel(metrics[0] if len(metrics) == 1 else "metric value")
    fig.suptitle(title or f"A = {label_a}   vs   B = {label_b}", fontsize=11)
    if handles:
        _legend(fig, metrics, field_styles, multi_field=any(len(by_handle[h]) > 1 for h in handles))
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _marker(field_styles: dict[str, str], name: str) -> str:
    return _MARKERS[list(field_styles).index(name) % len(_MARKERS)]


def _draw_panel(ax: Any, h: str, fields: list[FieldComparison], metrics: Sequence[str],
                field_styles: dict[str, str]) -> None:
    """One handle's panel: every metric of every field over the steps (distributed: one line per rank)."""
    for r in fields:
        ls = field_styles.setdefault(str(r.field), _FIELD_STYLES[len(field_styles) % len(_FIELD_STYLES)])
        mk = _marker(field_styles, str(r.field))
        x = _x(r.steps, r.calls)
        groups = [np.ones(len(x), bool)] if r.ranks is None else [r.ranks == k for k in np.unique(r.ranks)]
        for m in metrics:
            y = r.values.get(m)
            if y is None:
                continue
            for sel in groups:
                ax.plot(x[sel], y[sel], linestyle=ls, color=_METRIC_STYLE[m]["color"], marker=mk,
                        markersize=3, linewidth=1.6)
    ax.set_title(h if len(fields) > 1 else f"{h}  ·  {fields[0].field}", fontsize=10)
    ax.grid(True, alpha=0.3)
    if "cosine" in metrics or "norm_ratio" in metrics:
        ax.axhline(1.0, color="#999999", linewidth=0.8, zorder=0)
    if "rel_l2" in metrics:
        ax.axhline(0.0, color="#999999", linewidth=0.8, zorder=0)


def _legend(fig: Any, metrics: Sequence[str], field_styles: dict[str, str], multi_field: bool) -> None:
    """Colours name the metrics; line styles and markers the fields (when a panel has several)."""
    from matplotlib.lines import Line2D

    proxies = [Line2D([], [], color=_METRIC_STYLE[m]["color"], linewidth=2) for m in metrics]
    labels = [_METRIC_STYLE[m]["label"] for m in metrics]
    if multi_field:
        for f, ls in field_styles.items():
            proxies.append(Line2D([], [], color="#555555", linestyle=ls, marker=_marker(field_styles, f),
                                  markersize=3))
            labels.append(f)
    fig.legend(proxies, labels, loc="outside lower center", ncol=min(len(labels), 4 if multi_field else 3),
               fontsize=9, frameon=False)


def _heat_rows(results: Sequence[FieldComparison], metric: str) -> tuple[list[str], list[tuple[int, int]], np.ndarray]:
    """Row labels (layer, with its all-steps value), column keys ``(step, call)`` and the matrix."""
    rows: list[tuple[str, dict[tuple[int, int], float]]] = []
    for r in results:
        if r.status != "ok" or not len(r.steps) or metric not in r.values:
            continue
        ranks = [None] if r.ranks is None else [int(k) for k in np.unique(r.ranks)]
        for rank in ranks:
            sel = np.ones(len(r.steps), bool) if rank is None else r.ranks == rank
            cells = {(int(s), int(c)): float(v) for s, c, v in
                     zip(r.steps[sel], r.calls[sel], r.values[metric][sel])}
            name = f"{r.handle} · {r.field}" + (f" · rank {rank}" if rank is not None else "")
            total = r.overall.get(metric, float("nan"))
            rows.append((name + ("" if total != total else f"  (all: {total:.3f})"), cells))
    rows = rows[:MAX_ROWS]
    cols = sorted({k for _, cells in rows for k in cells})
    mat = np.full((len(rows), len(cols)), np.nan)
    pos = {k: j for j, k in enumerate(cols)}
    for i, (_, cells) in enumerate(rows):
        for k, v in cells.items():
            mat[i, pos[k]] = v
    return [name for name, _ in rows], cols, mat


def plot_heatmap(results: Sequence[FieldComparison], out: str | Path, *, metrics: Sequence[str],
                 label_a: str = "A", label_b: str = "B") -> Path:
    """Write a PNG with one heatmap per representation metric: layers (handle and field) down,
    common steps across, the value over all steps in each row's label. Returns the path."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    out = Path(out)
    panels = [(m, *_heat_rows(results, m)) for m in metrics]
    n_rows = max([len(p[1]) for p in panels] + [1])
    n_cols = max([len(p[2]) for p in panels] + [1])
    fig, axes = plt.subplots(len(panels), 1, squeeze=False, layout="constrained",
                             figsize=(min(4.0 + 0.22 * n_cols, 24.0), len(panels) * (1.4 + 0.3 * n_rows) + 0.6))
    for ax, (m, names, cols, mat) in zip(axes[:, 0], panels):
        if not names:
            ax.text(0.5, 0.5, "nothing to plot: no layer has common steps", ha="center", va="center",
                    transform=ax.transAxes)
            ax.set_axis_off()
            continue
        cmap, lo, hi = _HEAT[m]
        im = ax.imshow(np.ma.masked_invalid(mat), aspect="auto", interpolation="nearest", cmap=cmap, vmin=lo, vmax=hi)
        ax.set_yticks(range(len(names)), names, fontsize=8)
        stride = max(1, len(cols) // 24)
        several = any(c for _, c in cols)
        ax.set_xticks(range(0, len(cols), stride),
                      [f"{s}.{c}" if several else str(s) for s, c in cols[::stride]], fontsize=8, rotation=90)
        ax.set_xlabel("step" + (".call" if several else ""))
        ax.set_title(_METRIC_STYLE[m]["label"], fontsize=10)
        fig.colorbar(im, ax=ax, shrink=0.9)
    fig.suptitle(f"A = {label_a}   vs   B = {label_b}", fontsize=11)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
