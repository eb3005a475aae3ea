"""Comparison plots (matplotlib, Agg backend): one panel per handle, metrics over steps."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

if TYPE_CHECKING:
    from hookline.storage.compare import FieldComparison

__all__ = ["plot_comparison"]

_METRIC_STYLE = {
    "cosine": {"color": "#1f77b4", "label": "cosine"},
    "rel_l2": {"color": "#d62728", "label": "rel_l2 = ||a-b|| / ||a||"},
    "norm_ratio": {"color": "#2ca02c", "label": "norm_ratio = ||b|| / ||a||"},
}
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
